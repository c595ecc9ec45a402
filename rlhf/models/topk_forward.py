"""Forwards for the top-k distillation term (--opd_topk, rlhf.algorithms.distill ``topk_forward_kl_at``): the
teacher's k most likely tokens at each response position with their log-probs (``response_topk``), and the
student's log-probs of given token ids there, differentiable, from the same forward as its sampled-token
log-probs (``action_logprobs_at``).

Same layout and contract as rlhf.models.forward (padded rows, or one packed row under --packing_samples; the
response tokens' logits sit one position before them).  With a fusable LM head the (B, R, V) logits never exist
at once: the teacher's top-k is taken chunk by chunk (``head_topk``) and the student's log-probs of the k ids
come out of the fused head's chunk loop (rlhf.models.lm_head ``head_logprobs_at``); otherwise the logits are
computed as the plain path of rlhf.models.forward does.  Text models without a sequence split (parse-time checks:
rlhf.config.teacher_checks).  veRL verl/trainer/distillation/fsdp/utils.py ``compute_topk_logits`` takes the
teacher's top-k of the full logits the same way (``logits.topk(k)``).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Tuple

import torch
from torch import Tensor

from rlhf.models.forward import _response_targets, _temp, pack, position_ids_from_mask
from rlhf.models.lm_head import (
    KEEP_BYTES,
    _chunk_logits,
    fusable_head,
    head_logprobs,
    head_logprobs_at,
    head_params,
    head_removed,
    rows_per_chunk,
)


def _response_rows(model, sequences: Tensor, attention_mask: Tensor, action_mask: Tensor, packing: bool,
                   head) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(states (N, D), labels (N,), row (N,), col (N,)) of every response position's predicting state: the hidden
    states with ``head`` (removed for the forward), else the logits; padded rows: the action mask's positions."""
    R = action_mask.size(1)
    if packing:
        ids, pos, lengths = pack(sequences, attention_mask)
        with head_removed(model, head) if head is not None else nullcontext():
            out = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        row, col, tgt = _response_targets(ids, lengths, attention_mask, R)
        return out[tgt - 1], ids[0, tgt], row, col
    with head_removed(model, head) if head is not None else nullcontext():
        out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from_mask(
            attention_mask), logits_to_keep=R + 1, use_cache=False).logits[:, :-1]
    row, col = action_mask.nonzero(as_tuple=True)
    return out[row, col], sequences[:, -R:][row, col], row, col


def _place(vals: Tensor, row: Tensor, col: Tensor, B: int, R: int) -> Tensor:
    """(N, ...) values at (row, col) of a (B, R, ...) zero tensor."""
    out = torch.zeros((B, R, *vals.shape[1:]), dtype=vals.dtype, device=vals.device)
    return out.index_put((row, col), vals)


@torch.no_grad()
def head_topk(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], k: int, temperature: float = 1.0,
              chunk_size: int = 1024) -> Tuple[Tensor, Tensor]:
    """The k largest log softmax((h W^T + b) / T) of each hidden row (N, H), chunk by chunk: ((N, k) float32
    log-probs, (N, k) long ids), largest first."""
    n, V = hidden.size(0), weight.size(0)
    chunk = rows_per_chunk(chunk_size, V, hidden.device)
    lp = torch.empty((n, k), dtype=torch.float32, device=hidden.device)
    ids = torch.empty((n, k), dtype=torch.long, device=hidden.device)
    for s in range(0, n, chunk):
        z = _chunk_logits(hidden[s:s + chunk], weight, bias, temperature)
        top, idx = z.topk(k, dim=-1)
        lp[s:s + chunk], ids[s:s + chunk] = top - torch.logsumexp(z, -1, keepdim=True), idx
    return lp, ids


@torch.no_grad()
def response_topk(model, sequences: Tensor, attention_mask: Tensor, action_mask: Tensor, k: int,
                  temperature: float = 1.0, chunk_size: int = 1024, packing: bool = False
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    """The model's sampled-token log-probs (B, R) and its top-k log-probs and ids (B, R, k) at every response
    position (zeros on padding), at ``temperature``: one forward."""
    head = fusable_head(model)
    st, labels, row, col = _response_rows(model, sequences, attention_mask, action_mask, packing, head)
    T = _temp(temperature)
    B, R = action_mask.shape
    if head is not None:
        w, b = head_params(head)
        top, ids = head_topk(st, w, b, k, T, chunk_size)
        lab = head_logprobs(st, w, b, labels, T, chunk_size)[0]
    else:
        logp = torch.log_softmax(st.float() / T, -1)
        top, ids = logp.topk(k, dim=-1)
        lab = logp.gather(-1, labels[:, None]).squeeze(-1)
    return _place(lab, row, col, B, R), _place(top, row, col, B, R), _place(ids, row, col, B, R)


def action_logprobs_at(model, sequences: Tensor, attention_mask: Tensor, action_mask: Tensor, extra_ids: Tensor,
                       temperature: float = 1.0, chunk_size: int = 1024, packing: bool = False,
                       with_entropy: bool = False, entropy_grad: bool = True,
                       keep_bytes: int = KEEP_BYTES) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """(log-probs (B, R), entropy (B, R) or None, log-probs of ``extra_ids`` (B, R, k)) of the response
    positions, differentiable: rlhf.models.forward's action log-probs plus the k given ids' from the same forward
    (the fused head's chunk loop, rlhf.models.lm_head ``head_logprobs_at``)."""
    head = fusable_head(model)
    st, labels, row, col = _response_rows(model, sequences, attention_mask, action_mask, packing, head)
    T = _temp(temperature)
    B, R = action_mask.shape
    x_ids = extra_ids.to(st.device)[row, col]
    if head is not None:
        lp, ent, xl = head_logprobs_at(st, *head_params(head), labels, x_ids, T, chunk_size, with_entropy,
                                       keep_bytes)
    else:
        logp = torch.log_softmax(st.float() / T, -1)
        lp, xl = logp.gather(-1, labels[:, None]).squeeze(-1), logp.gather(-1, x_ids)
        ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    if ent is not None:
        ent = _place(ent if entropy_grad else ent.detach(), row, col, B, R)
    return _place(lp, row, col, B, R), ent, _place(xl, row, col, B, R)
