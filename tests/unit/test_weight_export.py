"""Weights leaving the trainer, in process: a transfer group with a missing peer fails within its timeout, a tied
head exported under its own name only on request and saved once, no log-prob gap metric when it is not measured
(the 3-process direct transfer: tests/multiprocess/test_weight_transfer.py)."""
import time

import pytest
import torch

from rlhf.distributed import transport


def test_transfer_group_missing_peer_fails_within_timeout():
    """A worker that never joins: the sending rank stops after --dist_timeout_s with the flag in the message."""
    store, port = transport.open_store("127.0.0.1", 2)
    t0 = time.perf_counter()
    with pytest.raises(transport.WeightTransferError, match=r"could not form.*--dist_timeout_s"):
        transport.TransferGroup(store, 0, 2, "gloo", 2, torch.device("cpu"))
    assert time.perf_counter() - t0 < 20
    with pytest.raises(transport.WeightTransferError, match="RLHF_WEIGHT_SYNC_BACKEND=gloo"):
        transport.TransferGroup(store, 0, 2, "nccl", 2, torch.device("cpu"))


def _tied_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhf.models.tiny_kit import make_tiny

    kit = make_tiny(str(tmp_path / "tied"), tie=True)
    return AutoModelForCausalLM.from_pretrained(kit)


def test_tied_head_is_exported_under_its_own_name_only_on_request(tmp_path):
    """vLLM needs lm_head.weight sent (its CPU head re-packs only when fed); the HF engine shares the tensor."""
    from rlhf.distributed.weight_sync import param_meta, tied_aliases

    m = _tied_model(tmp_path)
    assert tied_aliases(m) == {"model.embed_tokens.weight": ["lm_head.weight"]}
    plain = [n for n, _, _ in param_meta(m)]
    both = [n for n, _, _ in param_meta(m, aliases=True)]
    assert "lm_head.weight" not in plain
    assert both[:2] == ["model.embed_tokens.weight", "lm_head.weight"], both[:3]
    assert both[2:] == plain[1:]


def test_save_hf_stores_a_tied_matrix_once_and_reloads_identical(tmp_path):
    """A full state dict (FSDP2 / a gather) holds the head and the embedding as two tensors: saved once, re-tied."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rlhf.checkpoint import save_hf

    m = _tied_model(tmp_path)
    full = {k: v.detach().clone() for k, v in m.state_dict().items()}  # distinct tensors, as gathered
    assert "lm_head.weight" in full
    save_hf(full, m, None, str(tmp_path / "out"))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys, f"tied matrix stored twice: {keys}"
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert back.lm_head.weight is back.model.embed_tokens.weight
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits), "reloaded tied model gives other logits"


def test_rollout_logprob_gap_is_absent_when_not_measured():
    """The sync-health metric: a plain on-policy step computes no trainer log-probs, so no gap is logged (it used
    to log 0.0, which hid a stale vLLM head: issue 26 item 4); measured, it is the masked mean |old - rollout|."""
    from rlhf.rl.advantage_stage import _gap_metric

    rollout = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert _gap_metric(None, rollout, mask) == {}
    got = _gap_metric(torch.tensor([[-1.5, -2.0, -9.0]]), rollout, mask)
    assert got == {"rollout_logprob_gap": pytest.approx(0.25)}, got
