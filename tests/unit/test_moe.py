"""MoE (issue 45 items 3-4): transformers' expert kernels agree, the router hooks record and replay (R3 / R2) with
the router's own softmax weights, the HF rollout engine returns its routing, and the replay closes the
rollout-vs-trainer routing mismatch and log-prob gap."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers.models import tiny_moe

from rlhf.config.cli import ConfigUsageError, parse
from rlhf.engines.hf_engine import HFEngine
from rlhf.engines.rollout import SamplingParams
from rlhf.models import moe
from rlhf.models.forward import action_logprobs, packed_action_logprobs
from rlhf.roles.routing import RouteLog


def _lm_loss(model, ids):
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    return out.loss, out.aux_loss


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 96, (3, 11), generator=g)


def test_expert_kernels_agree_on_loss_aux_loss_and_grads(tokens):
    """eager (a loop over experts), batched_mm and grouped_mm all run on CPU here (torch 2.13) and give the same
    loss, load-balancing aux loss and gradients to 1e-5; --experts_implementation reaches transformers."""
    got = {}
    for impl in ("eager", "batched_mm", "grouped_mm"):
        m = tiny_moe(experts_implementation="eager")
        moe.set_experts(m, impl)
        assert m.config._experts_implementation == impl
        loss, aux = _lm_loss(m, tokens)
        loss.backward()
        got[impl] = (float(loss), float(aux), {n: p.grad.clone() for n, p in m.named_parameters()})
    base = got["eager"]
    assert base[1] > 1.0, "aux loss of a 4-expert top-2 router is E * sum f_e P_e >= 1-ish; 0 means it was not read"
    for impl, (loss, aux, grads) in got.items():
        assert loss == pytest.approx(base[0], abs=1e-5) and aux == pytest.approx(base[1], abs=1e-5), impl
        worst = max(float((grads[n] - base[2][n]).abs().max()) for n in grads)
        assert worst < 1e-5, f"{impl}: gradients differ from eager by {worst}"
    cfg = parse("grpo", ["--pretrain", "x", "--ds.experts_implementation", "batched_mm"])
    assert cfg.parallel.experts_implementation == "batched_mm"


def test_replaying_the_routers_own_choices_changes_nothing_and_other_ids_are_used(tokens):
    """Replay keeps the router's softmax: replaying its own top-k gives the same loss and gradients (router weights
    included) to 1e-6; replaying other ids routes by them, and the router still gets a gradient through them."""
    m = tiny_moe()
    with moe.Routing(m, record=True) as r0:
        loss0, _ = _lm_loss(m, tokens)
    loss0.backward()
    g0 = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    with moe.Routing(m, replay=r0.natural, record=True) as r1:
        loss1, _ = _lm_loss(m, tokens)
    loss1.backward()
    assert float(loss1) == pytest.approx(float(loss0), abs=1e-6)
    assert all(torch.allclose(p.grad, g0[n], atol=1e-6) for n, p in m.named_parameters()), "replay changed grads"
    assert torch.equal(r1.used, r0.natural)
    other = (r0.natural + 1) % 4  # still two distinct experts per token
    other[::3] = moe.NO_ROUTE  # no record: the router's own choice
    m.zero_grad()
    with moe.Routing(m, replay=other, record=True) as r2:
        loss2, _ = _lm_loss(m, tokens)
    loss2.backward()
    want = torch.where(other >= 0, other, r2.natural)
    assert torch.equal(r2.used, want), "replayed ids were not the ones routed to"
    assert abs(float(loss2) - float(loss0)) > 1e-4, "routing by other experts must change the loss"
    assert float(m.model.layers[0].mlp.gate.weight.grad.abs().sum()) > 0, "the router lost its gradient"


def test_a_checkpointed_recompute_replays_the_same_ids(tokens):
    """keep=True: the backward's recompute (gradient checkpointing) routes by the replayed ids, so the gradients
    equal the plain replayed forward's."""
    ids = None
    grads = []
    for ckpt in (False, True):
        m = tiny_moe()
        m.train()
        if ckpt:
            m.gradient_checkpointing_enable()
        if ids is None:
            with moe.Routing(m, record=True) as r:
                m(input_ids=tokens)
            ids = (r.natural + 1) % 4
        with moe.Routing(m, replay=ids, keep=True):
            loss = m(input_ids=tokens, labels=tokens).loss
        loss.backward()
        moe.clear(m)
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    worst = max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0])
    assert worst < 1e-6, f"the recompute routed differently: gradients differ by {worst}"


def _rollout(engine_dtype):
    """A bf16 (or fp32) HF rollout engine and an fp32 trainer copy of the same MoE policy (a narrow router, wide
    experts: which expert matters); one generate of 8 prompts (awkward lengths) x 2 samples, routing recorded."""
    trainer = tiny_moe(router_std=0.03, expert_std=1.0, seed=2)
    engine = HFEngine(copy.deepcopy(trainer).to(engine_dtype), SimpleNamespace(pad_token_id=0, eos_token_id=2))
    assert engine.record_routing()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (4, 2, 7, 5, 3, 6, 9, 1)]
    b = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=4))
    return trainer, b


def _forward(log: RouteLog, model, b, packed: bool):
    with log.forward("old", b.routed_experts, b.attention_mask, packed) as r, torch.no_grad():
        if packed:
            lp = packed_action_logprobs(model, b.sequences, b.attention_mask, b.action_mask)
        else:
            lp = action_logprobs(model, b.sequences, b.attention_mask, b.num_actions)[0]
    return lp, r, log.take()


def test_r3_replays_the_rollout_engines_routing_and_closes_the_gap():
    """The HF engine (bf16) returns (B, P + R, L * k) routing, -1 on padding; the fp32 trainer without replay
    routes some tokens elsewhere (mismatch > 0) and with R3 routes every token as the rollout did (mismatch 0),
    padded or packed alike, and its log-probs move closer to the rollout's."""
    trainer, b = _rollout(torch.bfloat16)
    L, k = len(moe.routers(trainer)), 2
    assert b.routed_experts.shape == (*b.sequences.shape, L * k)
    real = b.attention_mask.bool()
    assert bool((b.routed_experts[~real] == -1).all()) and bool((b.routed_experts[real] >= 0).all())
    mask = b.action_mask.float()

    def gap(lp):
        return float(((lp - b.rollout_logprobs).abs() * mask).sum() / mask.sum())

    lp_off, _, m_off = _forward(RouteLog("off", trainer, actor=True), trainer, b, packed=False)
    assert m_off["router/old_mismatch"] == m_off["router/old_mismatch_own"] > 0, m_off
    r3 = RouteLog("R3", trainer, actor=True)
    lp_r3, r, m_r3 = _forward(r3, trainer, b, packed=False)
    assert m_r3["router/old_mismatch"] == 0.0 and m_r3["router/old_mismatch_own"] == m_off["router/old_mismatch"]
    used = r.used.view(*b.sequences.shape, -1)
    assert torch.equal(used[real], b.routed_experts[real]), "a token was not routed as in the rollout"
    assert gap(lp_r3) < 0.6 * gap(lp_off), (gap(lp_r3), gap(lp_off))  # measured 1.0e-3 vs 3.5e-3
    lp_packed, _, m_packed = _forward(r3, trainer, b, packed=True)
    assert m_packed["router/old_mismatch"] == 0.0
    assert torch.allclose(lp_packed * mask, lp_r3 * mask, atol=1e-5), "packed replay read the wrong token's ids"


def test_fp32_engine_routes_as_the_trainer():
    """Same weights, same dtype: the trainer's own routing is the engine's on every token (the hook and the
    engine's record agree on the token order) and the log-probs match to 1e-5."""
    trainer, b = _rollout(torch.float32)
    lp, _, m = _forward(RouteLog("off", trainer, actor=True), trainer, b, packed=True)
    assert m["router/old_mismatch"] == 0.0
    assert torch.allclose(lp * b.action_mask, b.rollout_logprobs, atol=1e-5)


def test_load_metrics_and_mismatch_by_hand():
    """2 layers x top-2 of 4 experts over 3 tokens (the last one padding)."""
    used = torch.tensor([[0, 1, 2, 3], [0, 2, 2, 3], [3, 1, 0, 1]])
    valid = torch.tensor([True, True, False])
    got = moe.load_metrics(used, 2, 4, valid)
    # layer 0: counts [2, 1, 1, 0] -> max 2 / mean 1; layer 1: [0, 0, 2, 2] -> 2 / 1
    assert got == {"router/load_max_l0": 2.0, "router/load_max_l1": 2.0, "router/load_max": 2.0}
    other = torch.tensor([[1, 0, 3, 2], [0, 2, 2, 1], [0, 0, 0, 0]])  # token 0: same sets; token 1: layer 1 differs
    assert moe.mismatch(used, other, 2, valid) == 0.5


@pytest.mark.parametrize("argv, words", [
    (["--router_replay", "R3"], "--rollout_engine hf"),
    (["--router_replay", "R3", "--rollout_engine", "hf", "--ring_attn_size", "2", "--packing_samples"],
     "--ring_attn_size 1"),
    (["--router_replay", "R2", "--use_dynamic_batch"], "drop --use_dynamic_batch"),
])
def test_router_replay_refuses_what_it_cannot_replay(argv, words):
    with pytest.raises(ConfigUsageError) as e:
        parse("grpo", ["--pretrain", "x", *argv])
    assert "--router_replay" in str(e.value) and words in str(e.value), str(e.value)
    assert parse("grpo", ["--pretrain", "x", "--router_replay", "R3", "--rollout_engine", "hf"]).parallel \
        .router_replay == "R3"


def test_weight_sync_names_are_the_checkpoints_per_expert_tensors(tmp_path):
    """vLLM loads a checkpoint's per-expert names (transformers 5 saves ``experts.{e}.gate_proj.weight``, ...);
    the stacked parameters the trainer sends become exactly those tensors (names and values)."""
    from safetensors import safe_open

    m = tiny_moe(layers=3)
    m.save_pretrained(str(tmp_path))
    f = safe_open(str(tmp_path / "model.safetensors"), "pt")
    sent = dict(moe.checkpoint_layout((n, p.detach()) for n, p in m.named_parameters()))
    assert set(sent) == set(f.keys()), sorted(set(sent) ^ set(f.keys()))[:6]
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in sent
    for k in f.keys():
        assert torch.equal(sent[k], f.get_tensor(k)), k
