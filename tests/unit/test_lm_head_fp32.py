"""--lm_head_fp32: log-probs from float32 logits, against float32 (float64) references, at bf16 on the CPU.

A bf16 head rounds each logit to bf16 (8 significant bits) before the float32 softmax: at a logit of 10 that is
+-0.03, so log-probs carry 5e-3..2e-2 of rounding where top logits reach 10..20 (measured here at a 151936 vocabulary:
mean 5.5e-3 / max 1.5e-2 at top logits ~10, mean 1.9e-2 / max 5.7e-2 at ~20; fp32 head ~1e-6).  TRL's
``cast_lm_head_to_fp32`` (trl/trainer/grpo_trainer.py: ``lm_head.float()``, forward
``F.linear(hidden_states.to(float32), weight.to(float32), bias)``; trl/trainer/grpo_config.py) computes the head
in float32 from the bf16 hidden states; ``use_fp32_head`` does the same on the fused head and on the model's own.
The reference here is exactly that computation in float64: the log-softmax of (bf16 hidden) x (compute weight).
"""
from __future__ import annotations

import pytest
import torch

from rlhf.models.lm_head import head_logprobs, head_params, is_fp32_head, use_fp32_head


class _Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.lm_head = torch.nn.Linear(weight.size(1), weight.size(0), bias=False, dtype=weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)

    def get_output_embeddings(self):
        return self.lm_head


def _problem(V=32000, H=256, N=64, seed=0):
    """bf16 hidden rows and a bf16 head whose logits spread like a trained model's (std ~4, top logits 15-20);
    half the labels are each row's most likely token (where sampled tokens sit, and where the rounding is widest)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) * 4.0 / H ** 0.5).bfloat16()
    z = h.double() @ w.double().T
    labels = torch.where(torch.arange(N) % 2 == 0, z.argmax(-1), torch.randint(0, V, (N,), generator=g))
    return h, w, labels


def _reference(h, w, labels):
    """float64 log-softmax of the head over the bf16 values: what an fp32 head computes, without its rounding."""
    logp = torch.log_softmax(h.double() @ w.double().T, -1)
    return logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def test_fp32_head_closes_the_bf16_logit_gap():
    h, w, labels = _problem()
    want, want_ent = _reference(h, w, labels)
    bf16_lp, bf16_ent = head_logprobs(h, w, None, labels, with_entropy=True)
    model = _Head(w)
    use_fp32_head(model)
    fw, fb = head_params(model.lm_head)
    assert fw.dtype == torch.float32 and fb is None
    fp32_lp, fp32_ent = head_logprobs(h, fw, fb, labels, with_entropy=True)
    gap16 = (bf16_lp.double() - want).abs().max().item()
    gap32 = (fp32_lp.double() - want).abs().max().item()
    print(f"log-prob gap vs float64 at V=32000: bf16 head {gap16:.2e}, fp32 head {gap32:.2e}")
    assert gap16 > 1e-3, f"the bf16 head's gap {gap16:.2e} is under 1e-3: the test shows nothing"
    assert gap32 < 2e-5, f"the fp32 head's log-probs are {gap32:.2e} from the float64 reference (want < 2e-5)"
    assert gap16 > 50 * gap32
    ent16 = (bf16_ent.double() - want_ent).abs().max().item()
    ent32 = (fp32_ent.double() - want_ent).abs().max().item()  # float32 sums over 32000 terms: ~1e-4 of ~5 nats
    assert ent32 < 3e-4 and ent16 > 100 * ent32, (ent16, ent32)


def test_fp32_head_gradients_are_those_of_the_fp32_linear():
    """The fused kernel with the fp32 copies: gradients of hidden and weight (flowing back through the casts to the
    bf16 tensors) equal torch autograd through TRL's fp32 linear + log-softmax, to bf16 rounding of the result."""
    h, w, labels = _problem(V=4096, H=128, N=32)
    g = torch.randn(32, generator=torch.Generator().manual_seed(1))
    hk, model = h.clone().requires_grad_(), _Head(w)
    use_fp32_head(model)
    lp, _ = head_logprobs(hk, *head_params(model.lm_head), labels)
    (lp * g).sum().backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.log_softmax(torch.nn.functional.linear(hr.float(), wr.float()), -1).gather(-1, labels[:, None])[:, 0]
    (ref * g).sum().backward()
    assert hk.grad.dtype == torch.bfloat16 and model.lm_head.weight.grad.dtype == torch.bfloat16
    for got, want in ((hk.grad, hr.grad), (model.lm_head.weight.grad, wr.grad)):
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err < 1e-2, f"fp32-head gradient off by {err:.2e} (relative to its largest entry)"


@pytest.mark.parametrize("path", ["fused", "plain", "packed"])
def test_model_logprobs_with_fp32_head_match_the_fp32_reference(tiny_kit, path):
    """A frozen bf16 model (the reference under --bf16) through action_logprobs / packed_action_logprobs: with
    use_fp32_head the log-probs are the float32 head's (the hidden states are the model's bf16 ones), on the fused
    head, on the model's own head (fused=False: its patched forward) and packed."""
    from rlhf.models.forward import action_logprobs, packed_action_logprobs
    from rlhf.models.load import load_causal_lm

    model = load_causal_lm(tiny_kit, bf16=True, trainable=False)
    with torch.no_grad():  # logits of a trained model's size (the random kit's are ~0.1)
        model.lm_head.weight.mul_(60)
    g = torch.Generator().manual_seed(0)
    B, P, R = 4, 5, 6
    seq = torch.randint(3, model.config.vocab_size, (B, P + R), generator=g)
    att = torch.ones_like(seq)
    att[1, :2] = 0                                 # left padding
    att[2, -2:] = 0                                # right padding
    am = att[:, P:].clone()

    def run():
        with torch.no_grad():
            if path == "packed":
                return packed_action_logprobs(model, seq, att, am, 1.0, 64)
            return action_logprobs(model, seq, att, R, 1.0, 64, fused=path == "fused")[0]

    want = _model_reference(model, seq, att, am, packed=path == "packed")
    before = (run().double() * am - want).abs().max().item()
    use_fp32_head(model)
    assert is_fp32_head(model.get_output_embeddings())
    after = (run().double() * am - want).abs().max().item()
    assert before > 1e-3, f"the bf16 head's gap {before:.2e} is too small for the comparison to mean anything"
    assert after < 1e-5, f"{path}: the fp32 head's log-probs are {after:.2e} from the reference (bf16: {before:.2e})"


def _model_reference(model, seq, att, am, packed: bool):
    """(B, R) float64 log-probs of the response tokens from the model's own bf16 hidden states (padded, or on the
    packed row as packed_action_logprobs runs it: other shapes round the trunk differently) and its head weight."""
    from rlhf.models.forward import _response_targets, pack, position_ids_from_mask
    from rlhf.models.lm_head import head_removed

    B, R = am.shape
    P, w = seq.size(1) - R, model.lm_head.weight
    with torch.no_grad(), head_removed(model, model.lm_head):
        if packed:
            ids, pos, lengths = pack(seq, att)
            hs = model(input_ids=ids, position_ids=pos).logits[0]
            row, col, tgt = _response_targets(ids, lengths, att, R)
            lp = _reference(hs[tgt - 1], w, ids[0, tgt])[0]
            return torch.zeros(B, R, dtype=lp.dtype).index_put((row, col), lp)
        hs = model(input_ids=seq, attention_mask=att, position_ids=position_ids_from_mask(att)).logits
    lp = _reference(hs[:, P - 1:-1].reshape(-1, hs.size(-1)), w, seq[:, P:].reshape(-1))[0]
    return lp.view(B, R) * am


def test_fp32_head_refuses_a_lora_head(tiny_kit):
    from rlhf.models.load import load_causal_lm

    model = load_causal_lm(tiny_kit, lora_rank=4, target_modules="q_proj,lm_head")
    with pytest.raises(ValueError, match="remove lm_head from --target_modules"):
        use_fp32_head(model)


def test_supervised_trainer_marks_the_policy_and_reference_heads(tiny_kit, tmp_path):
    """--lm_head_fp32 reaches the models: SFT's policy, DPO's policy and reference."""
    import os

    from rlhf.config import parse
    from rlhf.distributed import comm
    from rlhf.supervised.tasks import DPOTask
    from rlhf.supervised.trainer import SupervisedTrainer

    argv = ["--pretrain", tiny_kit, "--dataset", os.path.join(tiny_kit, "data", "pref_train.jsonl"), "--bf16",
            "--lm_head_fp32", "--max_global_steps", "1", "--train_batch_size", "2", "--micro_train_batch_size", "2",
            "--max_samples", "4", "--save_path", str(tmp_path / "m"), "--log_dir", str(tmp_path / "logs"),
            "--no_progress_bar"]
    tr = SupervisedTrainer(parse("dpo", argv), DPOTask, "pref")
    try:
        assert is_fp32_head(tr.engine.model.get_output_embeddings())
        assert is_fp32_head(tr.task.ref.model.get_output_embeddings())
        loss, _ = tr.task.loss(tr.engine.model, tr.train_samples[:2])
        assert torch.isfinite(loss)
    finally:
        tr.watchdog.stop()
        comm.destroy()
