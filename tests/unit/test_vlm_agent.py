"""OpenRLHF's examples/python/vlm_multiturn_agent.py (git blob 4f63b339 at OpenRLHF main), unchanged, trains 2 GRPO
steps on the tiny VLM kit (Qwen2-VL from a config) with the HF engine: the prompt's image goes to ``execute``, the
environment's screenshots (``environment_images``) join the episode with their placeholders expanded, every turn
generates with all of the episode's images, and the trained rows carry them (pixel_values / image_grid_thw) into
the reference, old-log-prob and update forwards."""
import os
import random

import pytest
import torch
from helpers.e2e import flags_argv
from test_openrlhf_agent_examples import _capture, _openrlhf_example, _rows, _segments

VLM_AGENT = ("vlm_multiturn_agent.py", "4f63b3399d0d19553dc30bd57171ece9123839d3")


@pytest.fixture(scope="module")
def vlm_kit(tmp_path_factory):
    from rlhf.models.tiny_vlm_kit import make_tiny_vlm

    return make_tiny_vlm(str(tmp_path_factory.mktemp("vlmagent") / "kit"), n_train=8, n_eval=2)


def _train(kit, agent, tmp_path, monkeypatch):
    from rlhf.config import parse
    from rlhf.rl.trainer import RLTrainer
    from rlhf.train_grpo import GRPO_DEFAULTS
    from rlhf.utils.logging import read_metrics

    runs = _capture(monkeypatch)
    d = os.path.join(kit, "data")
    args = dict(pretrain=kit, prompt_data=f"{d}/vlm_prompts_train.jsonl", input_key="input", label_key="label",
                apply_chat_template=True, eval_holdout=0.0, agent_func_path=agent, rollout_engine="hf",
                generate_max_len=4, max_steps=150, prompt_max_len=1024, max_len=1100, rollout_batch_size=2,
                n_samples_per_prompt=2, train_batch_size=4, micro_train_batch_size=2, micro_rollout_batch_size=4,
                max_global_steps=2, seed=7, lr_warmup_ratio=0.0, actor_learning_rate=1e-3, use_kl_loss=True,
                init_kl_coef=0.01, logprob_gap_interval=1, log_dir=tmp_path / "logs", save_path=tmp_path / "m",
                ckpt_path=tmp_path / "ck", no_progress_bar=True)
    cfg = parse("grpo", flags_argv(args), GRPO_DEFAULTS)
    trainer = RLTrainer(cfg, "grpo")
    try:
        trainer.fit()
    finally:
        trainer.close()
    return [r for r in read_metrics(os.path.join(cfg.logging.log_dir, "metrics.jsonl")) if r["split"] == "train"], runs


def test_openrlhf_vlm_agent_trains_two_grpo_steps_with_images(vlm_kit, tmp_path, monkeypatch):
    from rlhf.data.images import ImageInputs

    random.seed(11)
    vis = ImageInputs.from_model_dir(vlm_kit)
    pad = vis.image_token_id
    rows, runs = _train(vlm_kit, _openrlhf_example(*VLM_AGENT, tmp_path), tmp_path, monkeypatch)
    assert [r["step"] for r in rows] == [1, 2], f"2 training steps expected, got {rows}"
    gaps = [r["rollout_logprob_gap"] for r in rows]
    assert max(gaps) < 1e-4, f"HF engine vs trainer log-probs on the agent's image rows: gap {gaps}"
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in rows), rows
    env_images = 0
    for step, run in enumerate(runs, 1):
        batch = run["batch"]
        assert batch.pixel_values is not None and len(batch.image_grid_thw) == len(run["results"]), \
            f"step {step}: the agent's rows carry no images"
        for i, (res, (ids, mask)) in enumerate(zip(run["results"], _rows(batch))):
            n_img = len(res["images"])
            turns = len(res["action_ranges"])
            # its step shows a screenshot after the 2nd turn (step_idx 2: never the last, max_steps is 3 or 4)
            assert n_img == 1 + (turns >= 2), f"step {step} row {i}: {n_img} images after {turns} turns"
            env_images += n_img - 1
            grid = batch.image_grid_thw[i]
            assert grid.size(0) == n_img and batch.pixel_values[i].size(0) == int(grid.prod(-1).sum()), \
                f"step {step} row {i}: the row's image fields {tuple(grid.shape)} do not hold its {n_img} images"
            obs = res["observation_tokens"]
            assert sum(t == pad for t in obs) == int((grid.prod(-1) // 4).sum()), \
                f"step {step} row {i}: placeholders in the episode != its images' token counts"
            img_pos = [j for j, t in enumerate(ids) if t == pad]
            assert all(mask[j] == 0 for j in img_pos), f"step {step} row {i}: an image token has action mask 1"
            assert _segments(ids, mask, 1) == [obs[s:e] for s, e in res["action_ranges"]], \
                f"step {step} row {i}: action mask != action_ranges"
    done = [r for run in runs for r in run["results"] if not r["truncated"]]
    assert done and all(r["extra_logs"]["step_count"] == r["extra_logs"]["max_steps"] == len(r["action_ranges"])
                        for r in done), "no episode ran to its agent's own end (3 or 4 steps)"
    assert any(r["grad_norm"] > 0 for r in rows), f"no step had a reward spread to train on: {rows}"
    assert env_images > 0, "no episode got an environment screenshot: the test did not exercise environment_images"
    print(f"vlm agent: gaps {gaps}, environment images {env_images}, turns "
          f"{[[len(r['action_ranges']) for r in run['results']] for run in runs]}, rewards {[r['reward'] for r in rows]}")


def test_image_turns_are_checked_and_vllm_refuses_them_alone(vlm_kit):
    """A turn whose placeholders do not match its images is refused as vLLM refuses it (not generated with a wrong
    image count); a vLLM per-request step fails an image request alone, naming the engine that runs it."""
    from PIL import Image

    from rlhf.agents.episode_images import expand_images, request_images
    from rlhf.data.images import ImageInputs
    from rlhf.engines.requests import Request
    from rlhf.engines.rollout import SamplingParams
    from rlhf.engines.vllm_requests import step_llm

    vis = ImageInputs.from_model_dir(vlm_kit)
    img = Image.new("RGB", (28, 28), (200, 10, 10))  # the agent's screenshot size: 32x32 after resize, 4 tokens
    ids = expand_images(vis, [5, vis.image_token_id, 6], [img])
    assert ids == [5] + [vis.image_token_id] * 4 + [6], ids
    px, grid = request_images(vis, ids, img)
    assert grid.tolist() == [[1, 4, 4]] and px.size(0) == 16, (grid, px.shape)
    with pytest.raises(ValueError, match="5 image tokens for 1 image"):
        request_images(vis, ids + [vis.image_token_id], [img])
    with pytest.raises(ValueError, match="--pretrain is a text-only model"):
        expand_images(None, ids, [img])

    class Engine:  # vllm/v1/engine/llm_engine.py's calls step_llm makes
        added = []

        def abort_request(self, ids):
            pass

        def add_request(self, rid, prompt, params, lora_request=None):
            self.added.append(rid)

        def get_num_unfinished_requests(self):
            return len(self.added)

        def step(self):
            return []

    llm = type("LLM", (), {"llm_engine": Engine(), "_preprocess_cmpl_one": lambda self, p: p})()
    out = step_llm(llm, None, [Request("a", ids, SamplingParams(n=1), (px, grid))], (), eos=0)
    assert out.failed and out.failed[0][0] == "a" and "--rollout_engine hf" in out.failed[0][1], out
    assert llm.llm_engine.added == [], "an image request reached vLLM without its images"

