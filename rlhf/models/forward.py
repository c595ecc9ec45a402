"""Forward passes that return log-probs of the action (response) tokens only.

Layout of a rollout batch: ``sequences = [prompt (left-padded) | response (right-padded)]``,
so the R response tokens are the last R positions and their logits come from the
R positions before them.  ``logits_to_keep=R+1`` asks the model for exactly those,
and the log-softmax runs in chunks (see rlhf.algorithms.logprob).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from rlhf.algorithms.logprob import entropy_chunked, logprobs_from_logits


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def action_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int,
                    temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                    entropy_grad: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(a_t | s_<t) for the last num_actions tokens: (B, num_actions) float32, and entropy if asked
    (without a graph when entropy_grad is False: a metric only)."""
    out = model(input_ids=sequences, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), logits_to_keep=num_actions + 1, use_cache=False)
    logits = out.logits[:, :-1]
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    labels = sequences[:, -num_actions:]
    logp = logprobs_from_logits(logits, labels, chunk_size)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy_chunked(logits.detach() if not entropy_grad else logits, chunk_size)
    return logp, ent


def pack(sequences: torch.Tensor, attention_mask: torch.Tensor):
    """Remove padding: one row of all real tokens with per-sample position ids. Returns (ids, pos, lengths)."""
    keep = attention_mask.bool()
    lengths = keep.sum(1)
    ids = sequences[keep].unsqueeze(0)
    pos = torch.cat([torch.arange(int(n), device=sequences.device) for n in lengths]).unsqueeze(0)
    return ids, pos, lengths


def packed_action_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor,
                           temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                           entropy_grad: bool = True):
    """Same contract as action_logprobs, computed on one packed row (no padding FLOPs).
    Returns log-probs, or (log-probs, entropy) with with_entropy.

    Position ids restart at 0 for each sample, which makes transformers build a
    block-diagonal causal mask, so packed and padded log-probs agree.
    """
    ids, pos, lengths = pack(sequences, attention_mask)
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
