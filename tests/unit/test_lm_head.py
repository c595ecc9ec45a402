"""The fused, chunked LM-head log-probs / entropy (rlhf.models.lm_head) equal the plain full-logits computation:
values and gradients, with temperature, bias, chunks that do not divide the rows, and through the model-level
entry points (action_logprobs, packed_action_logprobs, token_logprobs)."""
import pytest
import torch

from rlhf.models import lm_head
from rlhf.models.forward import action_logprobs, packed_action_logprobs
from rlhf.models.lm_head import fusable_head, head_logprobs


def _plain(h, w, b, y, T):
    z = torch.nn.functional.linear(h, w, b) / T  # float64 reference
    lp = torch.log_softmax(z, -1)
    return lp.gather(-1, y[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("keep", [lm_head.KEEP_BYTES, 1000, 0], ids=["keep_all", "keep_first_chunk", "recompute"])
@pytest.mark.parametrize("T,bias,chunk", [(1.0, False, 1024), (0.7, True, 5), (2.0, False, 1)])
def test_head_logprobs_values_and_grads_equal_full_logits(T, bias, chunk, keep):
    """keep: what forward may keep for backward (all chunks; 1000 bytes = the first 5-row float32 chunk only,
    the rest recomputed; nothing)."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 23, 8, 40
    h = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    a, c = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    lp, ent = head_logprobs(h, w, b, y, T, chunk, with_entropy=True, keep_bytes=keep)
    rlp, rent = _plain(h, w, b, y, T)
    assert torch.allclose(lp.double(), rlp, atol=1e-5), "log-probs differ from log_softmax of the full logits"
    assert torch.allclose(ent.double(), rent, atol=1e-5), "entropy differs from the full-logits entropy"
    params = [p for p in (h, w, b) if p is not None]
    got = torch.autograd.grad((lp.double() * a).sum() + (ent.double() * c).sum(), params)
    want = torch.autograd.grad((rlp * a).sum() + (rent * c).sum(), params)
    for name, x, r in zip(("hidden", "weight", "bias"), got, want):
        assert torch.allclose(x, r, atol=1e-4), f"gradient of {name} differs"
    # log-probs only, entropy as a metric: its gradient is not needed and not taken
    lp2, none = head_logprobs(h, w, b, y, T, chunk, keep_bytes=keep)
    assert none is None
    want2 = torch.autograd.grad((_plain(h, w, b, y, T)[0] * a).sum(), params)
    for attempt in ("first backward", "second backward (retain_graph: kept chunks are used once, then recomputed)"):
        got2 = torch.autograd.grad((lp2.double() * a).sum(), params, retain_graph=True)
        assert all(torch.allclose(x, r, atol=1e-4) for x, r in zip(got2, want2)), f"gradient differs, {attempt}"


def test_chunk_rows_bounded_by_bytes(monkeypatch):
    """A chunk of float32 logits never exceeds CHUNK_BYTES, whatever chunk_size says (and is at least one row)."""
    monkeypatch.setattr(lm_head, "CHUNK_BYTES", 4 * 40 * 3)
    assert lm_head.rows_per_chunk(1024, 40) == 3
    assert lm_head.rows_per_chunk(2, 40) == 2
    assert lm_head.rows_per_chunk(1024, 10 ** 9) == 1


def _batch(tiny_kit):
    from rlhf.models.load import load_causal_lm
    torch.manual_seed(0)
    m = load_causal_lm(tiny_kit)
    V = m.config.vocab_size
    seqs = torch.randint(3, V, (4, 11))
    att = torch.ones_like(seqs)
    att[0, :3] = 0  # left-padded prompt
    att[1, -2:] = 0  # response shorter than the slot
    att[3, :1] = 0
    seqs[att == 0] = 0
    return m, seqs, att, att[:, -5:].clone()


def test_model_level_fused_equals_plain(tiny_kit):
    m, seqs, att, am = _batch(tiny_kit)
    assert fusable_head(m) is not None, "the tiny kit's head should take the fused path"
    for T in (1.0, 0.7):
        m.zero_grad()
        f, fe = action_logprobs(m, seqs, att, 5, T, chunk_size=3, with_entropy=True)
        ((f * am).sum() + (fe * am).sum()).backward()
        gf = m.model.layers[0].mlp.up_proj.weight.grad.clone()
        gh = m.lm_head.weight.grad.clone()
        m.zero_grad()
        p, pe = action_logprobs(m, seqs, att, 5, T, chunk_size=3, with_entropy=True, fused=False)
        ((p * am).sum() + (pe * am).sum()).backward()
        assert torch.allclose(f * am, p * am, atol=1e-5) and torch.allclose(fe * am, pe * am, atol=1e-5)
        assert torch.allclose(gf, m.model.layers[0].mlp.up_proj.weight.grad, atol=1e-5), "layer gradient differs"
        assert torch.allclose(gh, m.lm_head.weight.grad, atol=1e-5), "LM head gradient differs"
        pk, pke = packed_action_logprobs(m, seqs, att, am, T, chunk_size=2, with_entropy=True)
        pp, ppe = packed_action_logprobs(m, seqs, att, am, T, chunk_size=2, with_entropy=True, fused=False)
        assert torch.allclose(pk, pp, atol=1e-5) and torch.allclose(pke, ppe, atol=1e-5)
        assert torch.allclose(pk * am, p * am, atol=1e-4), "packed and padded differ"
    assert isinstance(m.lm_head, torch.nn.Linear), "the head is put back after the fused forward"


def test_token_logprobs_fused_only_loss_positions(tiny_kit):
    from rlhf.supervised.tasks import token_logprobs

    m, seqs, att, _ = _batch(tiny_kit)
    lm = att.clone()
    lm[:, :6] = 0  # loss on the last tokens only
    b = {"input_ids": seqs, "attention_mask": att, "loss_mask": lm}
    f = token_logprobs(m, b, chunk=4)
    p = token_logprobs(m, b, chunk=4, fused=False)
    keep = lm[:, 1:].bool()
    assert torch.allclose(f[keep], p[keep], atol=1e-5), "fused SFT/DPO token log-probs differ from the plain ones"
    assert (f[~keep] == 0).all(), "positions outside the loss mask are not computed (0)"


def test_fusable_head_refuses_what_it_cannot_stand_in_for():
    """Plain path for: heads that are not a plain Linear, ZeRO-3 partitioned weights, soft-capped logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    m = Qwen2ForCausalLM(cfg)
    assert fusable_head(m) is m.lm_head
    m.config.final_logit_softcapping = 30.0
    assert fusable_head(m) is None, "soft-capped logits are not h W^T"
    m.config.final_logit_softcapping = None
    m.lm_head.weight.ds_id = 7  # what DeepSpeed ZeRO-3 puts on a partitioned parameter
    assert fusable_head(m) is None
    del m.lm_head.weight.ds_id
    m.lm_head = torch.nn.Sequential(torch.nn.Linear(16, 40, bias=False))
    assert fusable_head(m) is None


def test_kept_chunks_arena_two_live_graphs_and_empty_rows():
    """The CPU arena for kept chunks serves one graph at a time: a second forward while the first graph still
    holds it gets fresh buffers, and both backwards give the full-logits gradients; the arena is free again
    after backward (or once a graph is dropped unused).  Zero rows (an empty shard's dummy forward) work too."""
    g = torch.Generator().manual_seed(1)
    N, H, V = 12, 6, 30
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    h1 = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    h2 = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    lp1, _ = head_logprobs(h1, w, None, y, 1.0, 4)
    assert lm_head._ARENA.busy, "the first graph should hold the arena"
    lp2, _ = head_logprobs(h2, w, None, y, 1.0, 4)  # arena busy: its kept chunks are fresh tensors
    for h, lp in ((h2, lp2), (h1, lp1)):
        got = torch.autograd.grad(lp.double().sum(), (h, w))
        want = torch.autograd.grad(_plain(h, w, None, y, 1.0)[0].sum(), (h, w))
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got, want)), "kept-chunk gradient differs"
    assert not lm_head._ARENA.busy, "backward should hand the arena back"
    lp3, _ = head_logprobs(h1, w, None, y, 1.0, 4)
    assert lm_head._ARENA.busy
    del lp3  # graph dropped without a backward
    assert not lm_head._ARENA.busy, "a dropped graph should hand the arena back"
    h0 = torch.zeros(0, H, dtype=torch.float64, requires_grad=True)
    lp0, _ = head_logprobs(h0, w, None, y[:0], 1.0, 4)
    (gh0, gw0) = torch.autograd.grad(lp0.sum(), (h0, w))
    assert gh0.shape == (0, H) and float(gw0.abs().sum()) == 0.0
