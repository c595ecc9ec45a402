"""Forward passes that return log-probs of the action (response) tokens only.

Layout of a rollout batch: ``sequences = [prompt (left-padded) | response (right-padded)]``,
so the R response tokens are the last R positions and their logits come from the
R positions before them.  ``logits_to_keep=R+1`` asks the model for exactly those.

When the model's LM head is a plain Linear (rlhf.models.lm_head.fusable_head) the model
returns hidden states and the head, log-softmax and entropy run fused, chunk by chunk
(head_logprobs): the (B, R, V) logits never exist at once.  Otherwise the logits are
computed and the log-softmax runs in chunks (rlhf.algorithms.logprob).  ``fused=False``
forces the plain path (the two agree to float32 rounding; tested).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from rlhf.algorithms.logprob import entropy_chunked, logprobs_from_logits

from .lm_head import KEEP_BYTES, fusable_head, head_logprobs, head_params, head_removed


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def action_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int,
                    temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                    entropy_grad: bool = True, fused: bool = True,
                    keep_bytes: int = KEEP_BYTES) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(a_t | s_<t) for the last num_actions tokens: (B, num_actions) float32, and entropy if asked
    (without a graph when entropy_grad is False: a metric only).  keep_bytes: lm_head.head_logprobs."""
    head = fusable_head(model) if fused else None
    labels = sequences[:, -num_actions:]
    if head is not None:
        with head_removed(model, head):
            hs = model(input_ids=sequences, attention_mask=attention_mask,
                       position_ids=position_ids_from_mask(attention_mask), logits_to_keep=num_actions + 1,
                       use_cache=False).logits[:, :-1]
        lp, ent = head_logprobs(hs.reshape(-1, hs.size(-1)), *head_params(head), labels.reshape(-1),
                                _temp(temperature), chunk_size, with_entropy, keep_bytes)
        if ent is not None:
            ent = (ent if entropy_grad else ent.detach()).view(labels.shape)
        return lp.view(labels.shape), ent
    out = model(input_ids=sequences, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), logits_to_keep=num_actions + 1, use_cache=False)
    logits = out.logits[:, :-1]
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp = logprobs_from_logits(logits, labels, chunk_size)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy_chunked(logits.detach() if not entropy_grad else logits, chunk_size)
    return logp, ent


def _temp(temperature: float) -> float:
    return 1.0 if temperature in (0.0, 1.0) else float(temperature)


def pack(sequences: torch.Tensor, attention_mask: torch.Tensor):
    """Remove padding: one row of all real tokens with per-sample position ids. Returns (ids, pos, lengths)."""
    keep = attention_mask.bool()
    lengths = keep.sum(1)
    ids = sequences[keep].unsqueeze(0)
    pos = torch.cat([torch.arange(int(n), device=sequences.device) for n in lengths]).unsqueeze(0)
    return ids, pos, lengths


def packed_action_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor,
                           temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                           entropy_grad: bool = True, fused: bool = True, keep_bytes: int = KEEP_BYTES):
    """Same contract as action_logprobs, computed on one packed row (no padding FLOPs).
    Returns log-probs, or (log-probs, entropy) with with_entropy.

    Position ids restart at 0 for each sample, which makes transformers build a
    block-diagonal causal mask, so packed and padded log-probs agree.
    """
    ids, pos, lengths = pack(sequences, attention_mask)
    head = fusable_head(model) if fused else None
    if head is not None:
        return _packed_fused(model, head, ids, pos, lengths, attention_mask, action_mask.size(1), temperature,
                             chunk_size, with_entropy, entropy_grad, keep_bytes)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    num_actions = action_mask.size(1)
    rows, ent_rows = [], []
    start = 0
    resp_full = attention_mask[:, -num_actions:].sum(1)  # real tokens in the response slot
    for i, n in enumerate(lengths.tolist()):
        r = int(resp_full[i])
        seg_logits = logits[start + n - r - 1: start + n - 1]
        pad = (0, num_actions - r)
        rows.append(torch.nn.functional.pad(logprobs_from_logits(seg_logits, ids[0, start + n - r: start + n],
                                                                 chunk_size), pad))
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                src = seg_logits if entropy_grad else seg_logits.detach()
                ent_rows.append(torch.nn.functional.pad(entropy_chunked(src, chunk_size), pad))
        start += n
    out = torch.stack(rows)
    return (out, torch.stack(ent_rows)) if with_entropy else out


def _packed_fused(model, head, ids, pos, lengths, attention_mask, num_actions, temperature, chunk_size, with_entropy,
                  entropy_grad, keep_bytes):
    """packed_action_logprobs over the hidden states: one head_logprobs call over every sample's response rows."""
    with head_removed(model, head):
        hs = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    resp = attention_mask[:, -num_actions:].sum(1)  # real tokens in each sample's response slot
    ends = lengths.cumsum(0)
    row = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), resp)
    col = torch.cat([torch.arange(int(r), device=ids.device) for r in resp.tolist()])
    tgt = (ends - resp)[row] + col  # packed position of each response token; its logits sit one before
    lp, ent = head_logprobs(hs[tgt - 1], *head_params(head), ids[0, tgt], _temp(temperature), chunk_size,
                            with_entropy, keep_bytes)
    B = lengths.numel()
    out = torch.zeros((B, num_actions), dtype=lp.dtype, device=lp.device).index_put((row, col), lp)
    if not with_entropy:
        return out
    ent = ent if entropy_grad else ent.detach()
    return out, torch.zeros((B, num_actions), dtype=ent.dtype, device=ent.device).index_put((row, col), ent)
