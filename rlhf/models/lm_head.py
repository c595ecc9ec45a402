"""Token log-probs and entropy straight from hidden states: the (N, V) logits never exist for all rows at once.

With a 32k-150k vocabulary the LM head dominates a small or medium model's step: the plain path materialises
(B, T, V) float logits, a log-softmax of the same size, and in backward a (B, T, V) gradient plus one zero-filled
(B, T, V) buffer per chunk (the backward of slicing).  Here the head runs chunk by chunk inside one autograd
Function: forward keeps only each row's logsumexp; backward recomputes a chunk's logits and turns them into the
gradient of the hidden states and of the head's weight at once.  Peak extra memory: one chunk x V buffer.

Only the rows asked for are computed (response tokens, not prompt or padding), which is where most of the
padding waste of a batch goes.

    z      = (h W^T + b) / T                                   per row, float32
    logp   = z[y] - logsumexp(z)
    H      = logsumexp(z) - sum_v softmax(z)_v z_v
    dL/dz  = g_logp (onehot(y) - p) - g_H p (z - E_p[z])        (p = softmax(z))
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def _chunk_logits(h: Tensor, w: Tensor, b: Optional[Tensor], temperature: float) -> Tensor:
    z = torch.nn.functional.linear(h, w, b).float()
    return z / temperature if temperature != 1.0 else z


CHUNK_BYTES = 16 << 20  # a float32 chunk of logits stays under glibc's mmap threshold (32 MiB at most): its memory is
                       # reused, not mapped and page-faulted afresh for every chunk (measured: 8-32 MiB best)


def rows_per_chunk(chunk_size: int, vocab: int) -> int:
    return max(1, min(int(chunk_size), CHUNK_BYTES // (4 * vocab)))


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, labels, temperature, chunk, with_entropy):
        n = h.size(0)
        chunk = rows_per_chunk(chunk, w.size(0))
        f32 = dict(dtype=torch.float32, device=h.device)
        logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
        ent = torch.empty(n, **f32) if with_entropy else None
        ez = torch.empty(n, **f32) if with_entropy else None
        for s in range(0, n, chunk):
            z = _chunk_logits(h[s:s + chunk], w, b, temperature)
            zl = z.gather(-1, labels[s:s + chunk, None]).squeeze(-1)
            m = z.amax(-1, keepdim=True)
            y = z.sub_(m)  # in place: z - max
            e = y.exp()
            tot = e.sum(-1)
            lse_c = m.squeeze(-1) + tot.log()
            lse[s:s + chunk] = lse_c
            logp[s:s + chunk] = zl - lse_c
            if with_entropy:  # E_p[z] = max + sum(e * y) / sum(e), without an (n, V) product buffer
                ey = torch.bmm(e.unsqueeze(1), y.unsqueeze(2)).view(-1) / tot
                ez[s:s + chunk] = m.squeeze(-1) + ey
                ent[s:s + chunk] = lse_c - ez[s:s + chunk]
        ctx.save_for_backward(h, w, b, labels, lse, ez)
        ctx.set_materialize_grads(False)  # an unused output (the entropy as a metric) gets None, not zeros
        ctx.temperature, ctx.chunk = temperature, chunk
        if with_entropy:
            return logp, ent
        return logp, torch.zeros(0, device=h.device)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, b, labels, lse, ez = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        use_ent = ez is not None and g_ent is not None and g_ent.numel() > 0
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = b is not None and ctx.needs_input_grad[2]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        gb = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if need_b else None
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        for s in range(0, h.size(0), chunk):
            hc = h[s:s + chunk]
            z = _chunk_logits(hc, w, b, T)
            gl = g_logp[s:s + chunk, None]
            if use_ent:  # coef = g_logp + g_H (z - E_p[z])
                coef = (z - ez[s:s + chunk, None]).mul_(g_ent[s:s + chunk, None]).add_(gl)
                gz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(coef).neg_()
            else:
                gz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(gl).neg_()  # -p g_logp, in place
            gz.scatter_add_(-1, labels[s:s + chunk, None], gl)
            if T != 1.0:
                gz.div_(T)
            if need_h:
                gh[s:s + chunk] = gz.to(w.dtype) @ w
            if need_w:
                gw.addmm_(gz.t(), hc.float())
            if need_b:
                gb += gz.sum(0)
        return (gh, None if gw is None else gw.to(w.dtype), None if gb is None else gb.to(b.dtype),
                None, None, None, None)


def head_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, temperature: float = 1.0,
                  chunk_size: int = 1024, with_entropy: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """log softmax((h W^T + b) / T)[label] and the entropy of that distribution, for hidden rows (N, H).

    Returns ((N,) float32 log-probs, (N,) float32 entropy or None).  Differentiable in hidden, weight, bias
    (the entropy too); equal to log_softmax over the full logits up to float32 rounding.
    """
    lp, ent = _HeadLogprobs.apply(hidden, weight, bias, labels, float(temperature), max(1, int(chunk_size)),
                                  bool(with_entropy))
    return lp, (ent if with_entropy else None)


def fusable_head(model) -> Optional[torch.nn.Linear]:
    """The model's LM head when head_logprobs can stand in for it, else None (then use the plain logits path).

    Not fusable: heads that are not a plain Linear (LoRA on the head), sharded weights (FSDP2 DTensor, ZeRO-3),
    models whose forward post-processes the logits (soft-capping, logit scale).
    """
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if type(head) is not torch.nn.Linear:
        return None
    w = head.weight
    if type(w.data) is not torch.Tensor or hasattr(w, "ds_id") or w.dim() != 2 or w.numel() == 0:
        return None
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(cfg, attr, None) not in (None, 1, 1.0):
            return None
    return head


@contextmanager
def head_removed(model, head: torch.nn.Linear):
    """Within the block ``model(...).logits`` are the final hidden states (the LM head is an identity)."""
    owner, name = None, None
    for mod in model.modules():
        for n, child in mod.named_children():
            if child is head:
                owner, name = mod, n
                break
        if owner is not None:
            break
    if owner is None:
        raise RuntimeError("LM head not found among the model's modules")
    setattr(owner, name, torch.nn.Identity())
    try:
        yield
    finally:
        setattr(owner, name, head)
