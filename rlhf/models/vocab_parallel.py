"""Token log-probs and entropy from a vocabulary-sharded LM head (--tp_size): no rank holds a full row of logits.

TP rank r holds rows [o_r, o_r + V_r) of the head's weight (``ColwiseParallel`` on the head, a DTensor
``Shard(0)`` over the TP mesh, rlhf.distributed.tensor_parallel) and computes z_r = h W_r^T / T, its slice of the
logits.  Three all-reduces per chunk of rows combine the slices (Megatron's ``vocab_parallel_cross_entropy``,
megatron/core/tensor_parallel/cross_entropy.py; torch's ``loss_parallel``):

    m      = max_r max_v z_r                               (all-reduce max; a constant, no gradient)
    S      = sum_r sum_v exp(z_r - m)                      (all-reduce sum)
    lse    = m + log S
    z[y]   = sum_r z_r[y - o_r] [o_r <= y < o_r + V_r]     (all-reduce sum)
    logp   = z[y] - lse
    E_p[z] = m + sum_r sum_v exp(z_r - m) (z_r - m) / S    (all-reduce sum, with S in one call)
    H      = lse - E_p[z]

Backward recomputes each chunk's local logits: dL/dz_r = g_logp (onehot_r(y) - p_r) - g_H p_r (z_r - E_p[z]),
dL/dW_r = dz_r^T h (local), dL/dh = sum_r dz_r W_r (all-reduce sum: the hidden states are replicated).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from rlhf.distributed import comm

Tensor = torch.Tensor


def shard_offset(vocab: int, tp_rank: int, tp_size: int) -> int:
    """Row offset of TP rank ``tp_rank``'s shard: DTensor's ``Shard(0)`` splits as torch.chunk (ceil(V / tp) rows
    per rank, the last ones shorter)."""
    return min(vocab, tp_rank * -(-vocab // tp_size))


def _logits(h: Tensor, w: Tensor, b: Optional[Tensor], temperature: float) -> Tensor:
    z = torch.nn.functional.linear(h if h.dtype == w.dtype else h.to(w.dtype), w, b).float()
    return z / temperature if temperature != 1.0 else z


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, labels, temperature, chunk, with_entropy, group, offset):
        n, V = h.size(0), w.size(0)
        f32 = dict(dtype=torch.float32, device=h.device)
        logp, lse, ez = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
        for s in range(0, n, chunk):
            z = _logits(h[s:s + chunk], w, b, temperature)
            m = z.amax(-1) if V else torch.full((z.size(0),), -float("inf"), **f32)
            comm.all_reduce(m, op="max", group=group)
            y = z - m[:, None]
            e = y.exp()
            loc = labels[s:s + chunk] - offset
            mine = (loc >= 0) & (loc < V)
            zl = torch.where(mine, z.gather(-1, loc.clamp(0, max(V - 1, 0))[:, None]).squeeze(-1), 0.0) if V else \
                torch.zeros_like(m)
            sums = torch.stack([e.sum(-1), zl, (e * y).sum(-1)])  # one all-reduce: S, z[y], sum e (z - m)
            comm.all_reduce(sums, group=group)
            lse[s:s + chunk] = m + sums[0].log()
            logp[s:s + chunk] = sums[1] - lse[s:s + chunk]
            ez[s:s + chunk] = m + sums[2] / sums[0]
        ctx.save_for_backward(h, w, b, labels, lse, ez)
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.chunk, ctx.group, ctx.offset = temperature, chunk, group, offset
        return logp, (lse - ez if with_entropy else torch.zeros(0, device=h.device))

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, b, labels, lse, ez = ctx.saved_tensors
        T, chunk, V = ctx.temperature, ctx.chunk, w.size(0)
        use_ent = g_ent is not None and g_ent.numel() > 0
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
        gh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        gb = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if b is not None else None
        for s in range(0, h.size(0), chunk):
            hc = h[s:s + chunk]
            z = _logits(hc, w, b, T)
            gl = g_logp[s:s + chunk, None]
            coef = gl if not use_ent else (z - ez[s:s + chunk, None]) * g_ent[s:s + chunk, None] + gl
            gz = (z - lse[s:s + chunk, None]).exp() * coef
            gz = gz.neg()
            loc = labels[s:s + chunk] - ctx.offset
            mine = (loc >= 0) & (loc < V)
            if V and bool(mine.any()):
                rows = mine.nonzero().squeeze(1)
                gz[rows, loc[rows]] += g_logp[s:s + chunk][rows]
            if T != 1.0:
                gz = gz / T
            gh[s:s + chunk] = gz @ w.float()
            gw += gz.t() @ hc.float()
            if gb is not None:
                gb += gz.sum(0)
        comm.all_reduce(gh, group=ctx.group)  # h is replicated over TP: its gradient is the sum of the shards'
        return (gh.to(h.dtype), gw.to(w.dtype), None if gb is None else gb.to(b.dtype),
                None, None, None, None, None, None)


def vocab_parallel_logprobs(hidden: Tensor, weight, bias, labels: Tensor, temperature: float = 1.0,
                            chunk_size: int = 1024, with_entropy: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """lm_head.head_logprobs for a head whose ``weight`` (and ``bias``) is a DTensor sharded on the vocabulary over
    a 1-D TP mesh: the same (N,) float32 log-probs and entropy on every TP rank; gradients flow to the local
    shards (``to_local``) and to ``hidden``."""
    mesh = weight.device_mesh
    group = mesh.get_group()
    offset = shard_offset(weight.size(0), mesh.get_local_rank(), mesh.size())
    w = weight.to_local()
    b = bias.to_local() if bias is not None else None
    lp, ent = _VocabParallelLogprobs.apply(hidden, w, b, labels, float(temperature), max(1, int(chunk_size)),
                                           bool(with_entropy), group, offset)
    return lp, (ent if with_entropy else None)


def is_vocab_sharded(weight) -> bool:
    """A DTensor head weight on a 1-D mesh sharded along its rows (the vocabulary): TP's LM head after FSDP2's
    all-gather of its data-parallel shards."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(weight, DTensor) and weight.device_mesh.ndim == 1 and weight.placements == (Shard(0),)
