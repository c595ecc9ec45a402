"""End to end: the real trainers under torchrun on the tiny kit (gloo, CPU)."""
import json
import os
import shutil

import pytest
from e2e import flags_argv, torchrun

pytestmark = pytest.mark.slow

DATA = lambda kit: os.path.join(kit, "data")  # noqa: E731


def _rl_args(kit, sft, **over):
    d = DATA(kit)
    args = {"pretrain": sft, "prompt_data": f"{d}/prompts_train.jsonl", "eval_dataset": f"{d}/prompts_eval.jsonl",
            "remote_rm_url": "builtin:arithmetic", "generate_max_len": 6, "rollout_batch_size": 8,
            "n_samples_per_prompt": 4, "train_batch_size": 16, "micro_train_batch_size": 8,
            "micro_rollout_batch_size": 32}
    args.update(over)
    return flags_argv(args)


def test_grpo_colocated_hybrid_reward_rises(tiny_kit, sft_model, tmp_path):
    args = _rl_args(tiny_kit, sft_model, rollout_batch_size=16, n_samples_per_prompt=8, train_batch_size=32,
                    micro_train_batch_size=16, micro_rollout_batch_size=128, actor_learning_rate=2e-4,
                    lr_scheduler="constant", max_global_steps=60, eval_steps=30, colocate_all_models=True,
                    vllm_enable_sleep=True, deepspeed_enable_sleep=True, seed=1, save_path=tmp_path / "grpo",
                    eval_n_samples_per_prompt=4, eval_temperature=1.0)
    train, ev, out = torchrun("rlhf.train_grpo", 2, args, tmp_path, str(tmp_path / "logs"))
    assert len(train) == 60
    acc = [r["reward_accuracy"] for r in train]
    early, late = sum(acc[:15]) / 15, sum(acc[-15:]) / 15
    assert late > early + 0.05, (early, late)
    for r in train:
        assert 0 <= r["kl"] < 1 and r["tokens_per_s"] > 0 and r["response_len"] > 0
        for k in ("time_rollout", "time_actor_update", "time_weight_sync", "entropy", "clip_frac", "policy_loss", "grad_norm"):
            assert k in r
    assert len(ev) == 2
    for e in ev:  # OpenRLHF's eval keys (no datasource column: "default"); 4 samples per prompt
        assert 0 <= e["eval_default_pass1"] <= e["eval_default_pass4"] <= 1, e
    with open(tmp_path / "logs" / "generations.jsonl") as fh:  # --log_val_generations 4 (default) per eval
        assert [json.loads(line)["step"] for line in fh] == [30] * 4 + [60] * 4
    assert os.path.isfile(tmp_path / "grpo" / "model.safetensors")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "grpo"))


def test_separate_roles_broadcast_sync_async(tiny_kit, sft_model, tmp_path):
    """actor on ranks 0-1, ref on 2, rollout on 3 (weights by broadcast), one-step off-policy async."""
    common = dict(actor_num_gpus_per_node=2, ref_num_gpus_per_node=1, vllm_num_engines=1, async_train=True,
                  actor_learning_rate=1e-4, lr_warmup_ratio=0.0,
                  enable_is_correction=True, max_global_steps=3, eval_steps=-1, save_path=tmp_path / "m")
    train, _, _ = torchrun("rlhf.train_grpo", 4, _rl_args(tiny_kit, sft_model, **common), tmp_path,
                           str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["time_weight_sync"] > 0 and r["kl"] >= 0 for r in train)
    # step 1 was generated with the weights it trains; steps 2-3 with the weights of one update earlier
    assert train[0]["rollout_logprob_gap"] < 1e-4
    for r in train[1:]:
        assert r["rollout_logprob_gap"] > 1e-3 and r["rollout_logprob_gap"] > 100 * train[0]["rollout_logprob_gap"]


def test_resume_continues_exactly(tiny_kit, sft_model, tmp_path):
    ck = tmp_path / "ck"
    base = dict(max_global_steps=4, save_steps=2, ckpt_path=ck, eval_steps=0, save_path=tmp_path / "m",
                colocate_all_models=True)
    full, _, _ = torchrun("rlhf.train_grpo", 2, _rl_args(tiny_kit, sft_model, **base), tmp_path,
                          str(tmp_path / "a"))
    shutil.rmtree(ck / "global_step_4")
    (ck / ".tmp-global_step_4").mkdir()  # a crash mid-save is ignored
    resumed, _, out = torchrun("rlhf.train_grpo", 2, _rl_args(tiny_kit, sft_model, load_checkpoint=True, **base),
                               tmp_path, str(tmp_path / "b"))
    assert "[resume] from" in out and "global_step_2" in out
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        for k in ("reward", "policy_loss", "kl", "grad_norm", "response_len"):
            assert a[k] == b[k], (k, a[k], b[k])


def test_async_resume_restarts_the_queue_and_continues_the_prompt_stream(tiny_kit, sft_model, tmp_path):
    """--async_train K=2 with partial rollout (chunks of 2 of 6 tokens) and oversampling (6 groups in flight for
    batches of 4), actor 0 / rollout 1, saved at step 2 and resumed: the queue is not checkpointed, only each
    engine's place in its prompt stream (trainer state ``async_queue``); the resume generates the K batches again
    with the resumed weights, from the prompts after those the first run had drawn."""
    from rlhf.utils.checkpoint import load_trainer_state

    ck = tmp_path / "ck"
    base = dict(max_global_steps=4, save_steps=2, ckpt_path=ck, eval_steps=0, save_path=tmp_path / "m",
                rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8, micro_train_batch_size=4,
                actor_num_gpus_per_node=1, vllm_num_engines=1, async_train=True, async_queue_size=2,
                partial_rollout=True, partial_rollout_chunk=2, vllm_generate_batch_size=6)
    full, _, _ = torchrun("rlhf.train_grpo", 2, _rl_args(tiny_kit, sft_model, **base), tmp_path, str(tmp_path / "a"))
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert [r["async/age_max"] for r in full[:2]] == [0, 1], full  # the warm-up's two batches: the first weights
    # the SFT model stops at varying lengths: groups complete in different rounds, new ones are drawn in their
    # place, and some are still in flight when a batch is full: they continue under the next weights
    assert any(r["async/partial_frac"] > 0 for r in full), [r["async/partial_frac"] for r in full]
    drawn = lambda rows: sum(r["async/drawn_prompts"] for r in rows)  # noqa: E731
    saved = load_trainer_state(str(ck / "global_step_2"))["async_queue"]["drawn"]
    # at step 2 the batches of steps 3 and 4 were already generated (K=2 ahead): every prompt of the run was drawn
    assert list(saved.values()) == [drawn(full)] and drawn(full) > 2 * 4, (saved, drawn(full))
    shutil.rmtree(ck / "global_step_4")
    os.remove(tmp_path / "m" / "model.safetensors")
    resumed, _, out = torchrun("rlhf.train_grpo", 2, _rl_args(tiny_kit, sft_model, load_checkpoint=True, **base),
                               tmp_path, str(tmp_path / "b"))
    assert "[resume] from" in out and "global_step_2" in out
    assert "[resume] the async queue restarts" in out, out[-3000:]
    assert [r["step"] for r in resumed] == [3, 4]
    # the queue restarted: steps 3 and 4 are the new warm-up, generated with the resumed weights (ages 0 and 1)
    assert [r["async/age_max"] for r in resumed] == [0, 1], resumed
    # the resumed stream went on from the first run's place: its checkpoint at step 4 counts both runs' draws
    after = load_trainer_state(str(ck / "global_step_4"))["async_queue"]["drawn"]
    assert list(after.values()) == [drawn(full) + drawn(resumed)], (saved, after, drawn(resumed))
    assert drawn(resumed) >= 2 * 4, resumed
    assert os.path.isfile(tmp_path / "m" / "model.safetensors")


def test_ppo_gae_critic_and_reward_model_on_own_ranks(tiny_kit, sft_model, tmp_path):
    """actor 0, critic + reward model on 1, rollout on 2; critic trained (gae)."""
    args = _rl_args(tiny_kit, sft_model, advantage_estimator="gae", n_samples_per_prompt=1, rollout_batch_size=8,
                    train_batch_size=8, remote_rm_url=None, reward_pretrain=os.path.join(tiny_kit, "reward"),
                    actor_num_gpus_per_node=1, critic_num_gpus_per_node=1, reward_num_gpus_per_node=1,
                    colocate_critic_reward=True, vllm_num_engines=1, max_global_steps=2, eval_steps=0,
                    save_path=tmp_path / "m", critic_learning_rate=1e-3)
    train, _, _ = torchrun("rlhf.train_ppo", 3, args, tmp_path, str(tmp_path / "logs"))
    assert len(train) == 2
    for r in train:
        assert r["value_loss"] > 0 and "critic_grad_norm" in r and r["reward_std"] > 0
