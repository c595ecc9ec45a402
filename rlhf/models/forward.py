"""Forward passes that return log-probs of the action (response) tokens only.

Layout of a rollout batch: ``sequences = [prompt (left-padded) | response (right-padded)]``,
so the R response tokens are the last R positions and their logits come from the
R positions before them.  ``logits_to_keep=R+1`` asks the model for exactly those.

When the model's LM head is a plain Linear (rlhf.models.lm_head.fusable_head) the model
returns hidden states and the head, log-softmax and entropy run fused, chunk by chunk
(head_logprobs): the (B, R, V) logits never exist at once.  Otherwise the logits are
computed and the log-softmax runs in chunks (rlhf.algorithms.logprob).  ``fused=False``
forces the plain path (the two agree to float32 rounding; tested).

A model attached to a sequence-parallel group (rlhf.distributed.sequence_parallel.attach, ``--ring_attn_size``)
runs the packed forwards on its slice of the row and sums the wanted rows over the group (``sp_*`` below).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from rlhf.algorithms.logprob import entropy_chunked, logprobs_from_logits
from rlhf.distributed.sequence_parallel import SP, collect, local_hidden, positions_in, sp_of
from rlhf.models.lm_head import KEEP_BYTES, fusable_head, head_logprobs, head_params, head_removed
from rlhf.models.vision import check_images, packed_mrope_positions, vision_forward_kwargs


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def action_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int,
                    temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                    entropy_grad: bool = True, fused: bool = True, keep_bytes: int = KEEP_BYTES,
                    images: Optional[dict] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(a_t | s_<t) for the last num_actions tokens: (B, num_actions) float32, and entropy if asked
    (without a graph when entropy_grad is False: a metric only).  keep_bytes: lm_head.head_logprobs.  ``images``:
    the rows' pixel_values / image_grid_thw (a vision-language model; rlhf.models.vision: mrope positions)."""
    if sp_of(model) is not None:  # a padded batch cannot be split along the sequence (parse time refuses this too)
        raise ValueError("--ring_attn_size > 1 splits packed rows only: add --packing_samples")
    head = fusable_head(model) if fused else None
    labels = sequences[:, -num_actions:]
    kw = {"position_ids": position_ids_from_mask(attention_mask),
          **vision_forward_kwargs(model, images, sequences, attention_mask)}
    if head is not None:
        with head_removed(model, head):
            hs = model(input_ids=sequences, attention_mask=attention_mask, logits_to_keep=num_actions + 1,
                       use_cache=False, **kw).logits[:, :-1]
        lp, ent = head_logprobs(hs.reshape(-1, hs.size(-1)), *head_params(head), labels.reshape(-1),
                                _temp(temperature), chunk_size, with_entropy, keep_bytes)
        if ent is not None:
            ent = (ent if entropy_grad else ent.detach()).view(labels.shape)
        return lp.view(labels.shape), ent
    out = model(input_ids=sequences, attention_mask=attention_mask, logits_to_keep=num_actions + 1, use_cache=False,
                **kw)
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
                           entropy_grad: bool = True, fused: bool = True, keep_bytes: int = KEEP_BYTES,
                           images: Optional[dict] = None):
    """Same contract as action_logprobs, computed on one packed row (no padding FLOPs).
    Returns log-probs, or (log-probs, entropy) with with_entropy.  ``images``: as action_logprobs; the packed row
    then carries (4, 1, N) position ids (text positions, then each sample's mrope ids: rlhf.models.vision).

    Position ids restart at 0 for each sample, which makes transformers build a
    block-diagonal causal mask, so packed and padded log-probs agree.
    """
    ids, pos, lengths = pack(sequences, attention_mask)
    head = fusable_head(model) if fused else None
    sp = sp_of(model)
    vis = {}
    check_images(model, ids, images)
    if images:
        if sp is not None:
            raise ValueError("--ring_attn_size > 1 with images: a vision-language model's sequence split is not "
                             "supported; use --ring_attn_size 1")
        pos = packed_mrope_positions(model, [sequences[i][attention_mask[i].bool()] for i in range(len(lengths))],
                                     images["image_grid_thw"])
        vis = {"pixel_values": images["pixel_values"], "image_grid_thw": images["image_grid_thw"]}
    if sp is not None:
        row, col, tgt = _response_targets(ids, lengths, attention_mask, action_mask.size(1))
        lp, ent = sp_rows_logprobs(model, head, ids, pos, tgt, sp, temperature, chunk_size, with_entropy,
                                   entropy_grad, keep_bytes)
        out = _scatter(lp, row, col, lengths.numel(), action_mask.size(1))
        return (out, _scatter(ent, row, col, lengths.numel(), action_mask.size(1))) if with_entropy else out
    if head is not None:
        return _packed_fused(model, head, ids, pos, lengths, attention_mask, action_mask.size(1), temperature,
                             chunk_size, with_entropy, entropy_grad, keep_bytes, vis)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False, **vis).logits[0]
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
                  entropy_grad, keep_bytes, vis=None):
    """packed_action_logprobs over the hidden states: one head_logprobs call over every sample's response rows."""
    with head_removed(model, head):
        hs = model(input_ids=ids, position_ids=pos, use_cache=False, **(vis or {})).logits[0]
    row, col, tgt = _response_targets(ids, lengths, attention_mask, num_actions)
    lp, ent = head_logprobs(hs[tgt - 1], *head_params(head), ids[0, tgt], _temp(temperature), chunk_size,
                            with_entropy, keep_bytes)
    B = lengths.numel()
    out = torch.zeros((B, num_actions), dtype=lp.dtype, device=lp.device).index_put((row, col), lp)
    if not with_entropy:
        return out
    ent = ent if entropy_grad else ent.detach()
    return out, torch.zeros((B, num_actions), dtype=ent.dtype, device=ent.device).index_put((row, col), ent)


def _response_targets(ids, lengths, attention_mask, num_actions):
    """(sample, response column, packed position) of every real response token of a packed row; a token's
    logits (or value state) sit one position before it."""
    resp = attention_mask[:, -num_actions:].sum(1)  # real tokens in each sample's response slot
    ends = lengths.cumsum(0)
    row = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), resp)
    col = torch.cat([torch.arange(int(r), device=ids.device) for r in resp.tolist()])
    return row, col, (ends - resp)[row] + col


def _scatter(vals, row, col, B: int, width: int):
    return torch.zeros((B, width), dtype=vals.dtype, device=vals.device).index_put((row, col), vals)


def sp_rows_logprobs(model, head, ids, pos, tgt, sp: SP, temperature: float = 1.0, chunk_size: int = 1024,
                     with_entropy: bool = False, entropy_grad: bool = True, keep_bytes: int = KEEP_BYTES):
    """log p(ids[t] | ids[<t]) (and the entropy of that distribution) at the packed positions ``tgt``
    (ascending), on every rank of ``sp``: each rank runs the model on its slice of the row and the head on the
    predicting positions ``tgt - 1`` that fall in it (labels are read from the full row, so the next token of a
    slice's last position is never lost), then one differentiable sum over the group gives all K values.

    A rank whose slice holds no wanted position runs the head on one dummy row times 0, so every rank's head
    takes part in backward (its gradient is reduced by FSDP / DeepSpeed like any other)."""
    rows = tgt - 1
    T = _temp(temperature)
    if head is not None:
        with head_removed(model, head):
            hs, a, b = local_hidden(lambda i, p: model(input_ids=i, position_ids=p, use_cache=False).logits,
                                    ids, pos, sp)
        i, j = positions_in(rows, a, b)
        sel, lab = (rows[i:j] - a, ids[0, tgt[i:j]]) if j > i else (rows.new_zeros(1), ids[0, :1])
        lp, ent = head_logprobs(hs[sel], *head_params(head), lab, T, chunk_size, with_entropy, keep_bytes)
    else:
        logits, a, b = local_hidden(lambda i, p: model(input_ids=i, position_ids=p, use_cache=False).logits,
                                    ids, pos, sp)
        i, j = positions_in(rows, a, b)
        sel, lab = (rows[i:j] - a, ids[0, tgt[i:j]]) if j > i else (rows.new_zeros(1), ids[0, :1])
        z = logits[sel] / T if T != 1.0 else logits[sel]
        lp = logprobs_from_logits(z.unsqueeze(0), lab.unsqueeze(0), chunk_size)[0]
        ent = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = entropy_chunked(z if entropy_grad else z.detach(), chunk_size)
    if with_entropy:
        ent = ent if entropy_grad else ent.detach()
        local = torch.stack([lp.float(), ent.float()], 1)
    else:
        local = lp.float().unsqueeze(1)
    if j == i:  # nothing wanted here: keep the graph connected, contribute zeros
        local, dummy = local[:0], local.sum() * 0
    else:
        dummy = None
    out = collect(local, i, j, rows.numel(), sp)
    if dummy is not None:
        out = out + dummy
    return out[:, 0], (out[:, 1] if with_entropy else None)


def sp_token_logprobs(model, batch: dict, chunk_size: int = 1024, keep_bytes: int = KEEP_BYTES) -> torch.Tensor:
    """The SP form of rlhf.supervised.tasks.token_logprobs on a packed batch: (1, T-1) log p(x_{t+1} | x_<=t),
    computed at the loss_mask[:, 1:] positions only (0 elsewhere)."""
    keep = batch["loss_mask"][:, 1:].bool()
    tgt = keep[0].nonzero().squeeze(1) + 1
    head = fusable_head(model)
    lp, _ = sp_rows_logprobs(model, head, batch["input_ids"], batch["position_ids"], tgt, sp_of(model), 1.0,
                             chunk_size, keep_bytes=keep_bytes)
    return torch.zeros(keep.shape, dtype=lp.dtype, device=lp.device).masked_scatter(keep, lp)


def sp_values(critic, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
    """The SP form of CriticModel.forward: V(s_t) before each real response token, (B, num_actions), 0 at the
    padding of the response slot (masked by every consumer).  The backbone runs on this rank's slice of the
    packed row, the value head on the states in it; one differentiable sum over the group."""
    sp = sp_of(critic)
    ids, pos, lengths = pack(sequences, attention_mask)
    row, col, tgt = _response_targets(ids, lengths, attention_mask, num_actions)
    rows = tgt - 1
    h, a, b = local_hidden(lambda i, p: critic.backbone(input_ids=i, position_ids=p, use_cache=False)
                           .last_hidden_state, ids, pos, sp)
    i, j = positions_in(rows, a, b)
    v = critic.value_head(h[rows[i:j] - a] if j > i else h[:1]).squeeze(-1).float()
    if j > i:
        out = collect(v, i, j, rows.numel(), sp)
    else:
        out = collect(v[:0], i, i, rows.numel(), sp) + v.sum() * 0
    return _scatter(out, row, col, lengths.numel(), num_actions)


def sp_scores(model, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The SP form of rlhf.rewards.reward_model.scores_at_positions on a padded batch: the score head's output at
    each sequence's last real token (score_positions' rule: packed, ``cumsum(lengths) - 1``), (B,) float32.  The
    reward model runs on this rank's slice of the packed row; one sum over the group."""
    sp = sp_of(model)
    ids, pos, lengths = pack(sequences, attention_mask)
    rows = lengths.cumsum(0) - 1
    z, a, b = local_hidden(lambda i, p: per_token_scores(model, input_ids=i, position_ids=p), ids, pos, sp)
    i, j = positions_in(rows, a, b)
    v = z[rows[i:j] - a].float() if j > i else z[:0].float()
    return collect(v, i, j, rows.numel(), sp)


def per_token_scores(model, **inputs) -> torch.Tensor:
    """The score head's output at every position, (B, T).

    Read with a forward hook during the model's own (root) forward, so an FSDP-sharded
    reward model gathers its parameters as usual, and the pooling transformers does
    (last non-pad token by pad id) is not relied on.
    """
    head = getattr(model, "score", None) or model.get_submodule("base_model.model.score")
    caught = {}
    handle = head.register_forward_hook(lambda mod, inp, out: caught.__setitem__("z", out))
    try:
        model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return caught["z"][..., 0]
