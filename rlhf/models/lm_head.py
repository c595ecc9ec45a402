"""Token log-probs and entropy straight from hidden states: the (N, V) logits never exist for all rows at once.

With a 32k-150k vocabulary the LM head dominates a small or medium model's step: the plain path materialises
(B, T, V) float logits, a log-softmax of the same size, and in backward a (B, T, V) gradient plus one zero-filled
(B, T, V) buffer per chunk (the backward of slicing).  Here the head runs chunk by chunk inside one autograd
Function: forward keeps each row's logsumexp and, within a memory budget (``keep_bytes``, the config's
``--lm_head_keep_mb``), each chunk's exp(z - max); backward turns those into the gradient of the hidden states and
of the head's weight at once, recomputing a chunk's logits only where the budget ran out (one head matmul of four:
forward, recompute, dL/dh, dL/dW).  Peak extra memory: the kept chunks plus one chunk x V buffer.

Only the rows asked for are computed (response tokens, not prompt or padding), which is where most of the
padding waste of a batch goes.

    z      = (h W^T + b) / T                                   per row, float32
    logp   = z[y] - logsumexp(z)
    H      = logsumexp(z) - sum_v softmax(z)_v z_v
    dL/dz  = g_logp (onehot(y) - p) - g_H p (z - E_p[z])        (p = softmax(z))
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Optional, Tuple

import torch

from rlhf.models.vocab_parallel import is_vocab_sharded, vocab_parallel_logprobs

Tensor = torch.Tensor


def _chunk_logits(h: Tensor, w: Tensor, b: Optional[Tensor], temperature: float) -> Tensor:
    """The logits of hidden rows in the weight's dtype (an fp32 head, ``head_params``: fp32 from bf16 hidden
    states), then float32."""
    z = torch.nn.functional.linear(h if h.dtype == w.dtype else h.to(w.dtype), w, b).float()
    return z / temperature if temperature != 1.0 else z


CHUNK_BYTES = 16 << 20  # a float32 chunk of logits stays under glibc's mmap threshold (32 MiB at most): its memory is
                       # reused, not mapped and page-faulted afresh for every chunk (measured: 8-32 MiB best)


KEEP_BYTES = 1 << 30  # default budget of exp(z - max) chunks kept from forward for backward (--lm_head_keep_mb 1024)


def rows_per_chunk(chunk_size: int, vocab: int, device: Optional[torch.device] = None) -> int:
    """Rows of logits computed at once: ``chunk_size`` (--logprob_chunk_size) on a GPU, where a chunk is one
    large matmul (1024 rows x 152k vocabulary = 0.6 GB of fp32 logits); on the CPU also at most CHUNK_BYTES."""
    if device is not None and device.type != "cpu":
        return max(1, int(chunk_size))
    return max(1, min(int(chunk_size), CHUNK_BYTES // (4 * vocab)))


class _KeepArena:
    """CPU memory for the chunks forward keeps, reused from step to step by one graph at a time.

    A fresh 16 MiB buffer per kept chunk is memory glibc maps anew and the kernel page-faults and zeroes at first
    touch, every step: measured 33 ms for the exp that writes it against 8 ms into memory already mapped (the
    4096-row head of the 512-token GRPO bench: 1.1 s against 0.26 s).  On CUDA the caching allocator already
    reuses blocks, so the arena is CPU only.  It grows to the most any call kept (at most --lm_head_keep_mb) and
    stays allocated; a second graph built while the first still holds it gets fresh buffers."""

    def __init__(self):
        self.buf: Optional[Tensor] = None
        self.busy = False

    def lease(self, numel: int, device: torch.device) -> Optional[_Lease]:
        if device.type != "cpu" or self.busy or numel <= 0:
            return None
        if self.buf is None or self.buf.numel() < numel:
            self.buf = None  # free the smaller buffer before allocating the larger one (peak: one of them)
            self.buf = torch.empty(numel, dtype=torch.float32)
        self.busy = True
        return _Lease(self)


class _Lease:
    """Holds the arena until backward is done with it, or until the graph is freed without a backward."""

    def __init__(self, arena: _KeepArena):
        self.arena: Optional[_KeepArena] = arena

    def chunk(self, start_row: int, rows: int, vocab: int) -> Tensor:
        return self.arena.buf[start_row * vocab:(start_row + rows) * vocab].view(rows, vocab)

    def release(self) -> None:
        if self.arena is not None:
            self.arena.busy = False
            self.arena = None

    __del__ = release


_ARENA = _KeepArena()


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, labels, temperature, chunk, with_entropy, keep_bytes, extra=None):
        n = h.size(0)
        chunk = rows_per_chunk(chunk, w.size(0), h.device)
        V = w.size(0)
        grad = any(ctx.needs_input_grad[:3])
        keep_rows = min(n, (keep_bytes if grad else 0) // (4 * V))  # chunks wholly inside these rows are kept
        keep_rows = keep_rows if keep_rows == n else keep_rows // chunk * chunk
        lease = _ARENA.lease(keep_rows * V, h.device) if keep_rows else None
        kept = []  # per chunk: (exp(z - max), 1 / sum) or None (recompute in backward)
        f32 = dict(dtype=torch.float32, device=h.device)
        logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
        ent = torch.empty(n, **f32) if with_entropy else None
        ez = torch.empty(n, **f32) if with_entropy else None
        xl = torch.empty(extra.shape, **f32) if extra is not None else torch.zeros(0, **f32)  # (n, k): extra ids
        for s in range(0, n, chunk):
            z = _chunk_logits(h[s:s + chunk], w, b, temperature)
            zl = z.gather(-1, labels[s:s + chunk, None]).squeeze(-1)
            zx = z.gather(-1, extra[s:s + chunk]) if extra is not None else None
            m = z.amax(-1, keepdim=True)
            y = z.sub_(m)  # in place: z - max
            keep = s + y.size(0) <= keep_rows
            e = torch.exp(y, out=lease.chunk(s, y.size(0), V)) if keep and lease is not None else y.exp()
            tot = e.sum(-1)
            lse_c = m.squeeze(-1) + tot.log()
            kept.append((e, tot.reciprocal()) if keep else None)
            lse[s:s + chunk] = lse_c
            logp[s:s + chunk] = zl - lse_c
            if zx is not None:
                xl[s:s + chunk] = zx - lse_c.unsqueeze(-1)
            if with_entropy:  # E_p[z] = max + sum(e * y) / sum(e), without an (n, V) product buffer
                ey = torch.bmm(e.unsqueeze(1), y.unsqueeze(2)).view(-1) / tot
                ez[s:s + chunk] = m.squeeze(-1) + ey
                ent[s:s + chunk] = lse_c - ez[s:s + chunk]
        ctx.save_for_backward(h, w, b, labels, lse, ez, extra)
        ctx.set_materialize_grads(False)  # an unused output (the entropy as a metric) gets None, not zeros
        ctx.temperature, ctx.chunk, ctx.kept, ctx.lease = temperature, chunk, kept, lease
        return logp, (ent if with_entropy else torch.zeros(0, device=h.device)), xl

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_x=None):
        h, w, b, labels, lse, ez, extra = ctx.saved_tensors
        use_x = extra is not None and g_x is not None and g_x.numel() > 0  # d logp_j / dz = onehot_j - p
        T, chunk = ctx.temperature, ctx.chunk
        use_ent = ez is not None and g_ent is not None and g_ent.numel() > 0
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = b is not None and ctx.needs_input_grad[2]
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        gb = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if need_b else None
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        kept, ctx.kept = ctx.kept, [None] * len(ctx.kept)  # used once, in place (a second backward recomputes)
        for i, s in enumerate(range(0, h.size(0), chunk)):
            hc = h[s:s + chunk]
            gl = g_logp[s:s + chunk, None]
            gp = gl + g_x[s:s + chunk].sum(-1, keepdim=True) if use_x else gl  # what multiplies -p
            if kept[i] is not None and not use_ent:  # p = exp(z - max) / sum, kept from forward
                e, inv = kept[i]
                kept[i] = None
                gz = e.mul_(inv.unsqueeze(1).mul(gp).neg_())  # -p g_logp, in place
            else:
                z = _chunk_logits(hc, w, b, T)
                if use_ent:  # coef = g_logp + g_H (z - E_p[z])
                    coef = (z - ez[s:s + chunk, None]).mul_(g_ent[s:s + chunk, None]).add_(gp)
                    gz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(coef).neg_()
                else:
                    gz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(gp).neg_()  # -p g_logp, in place
            gz.scatter_add_(-1, labels[s:s + chunk, None], gl)
            if use_x:
                gz.scatter_add_(-1, extra[s:s + chunk], g_x[s:s + chunk])
            if T != 1.0:
                gz.div_(T)
            if need_h:
                gh[s:s + chunk] = gz.to(w.dtype) @ w
            if need_w:
                if w.dtype == torch.float32:
                    gw.addmm_(gz.t(), hc.float())
                else:  # bf16 weights (FSDP2 compute dtype): a bf16 matmul (fp32 accumulation), summed in fp32
                    gw += (gz.t().to(w.dtype) @ hc.to(w.dtype)).float()
            if need_b:
                gb += gz.sum(0)
        kept = gz = None  # drop the arena views before handing the arena back
        if ctx.lease is not None:
            ctx.lease.release()
        return (gh, None if gw is None else gw.to(w.dtype), None if gb is None else gb.to(b.dtype),
                None, None, None, None, None, None)


def head_logprobs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, temperature: float = 1.0,
                  chunk_size: int = 1024, with_entropy: bool = False,
                  keep_bytes: int = KEEP_BYTES) -> Tuple[Tensor, Optional[Tensor]]:
    """log softmax((h W^T + b) / T)[label] and the entropy of that distribution, for hidden rows (N, H).

    Returns ((N,) float32 log-probs, (N,) float32 entropy or None).  Differentiable in hidden, weight, bias
    (the entropy too); equal to log_softmax over the full logits up to float32 rounding.  ``keep_bytes``: memory
    the forward may keep for backward (when a gradient is needed) so that backward skips recomputing the logits
    of those chunks; 0 = recompute every chunk.
    """
    if is_vocab_sharded(weight):  # --tp_size: a vocabulary shard per TP rank (rlhf.models.vocab_parallel)
        return vocab_parallel_logprobs(hidden, weight, bias, labels, temperature, chunk_size, with_entropy)
    keep = max(0, int(keep_bytes)) if torch.is_grad_enabled() else 0  # no graph (no_grad): nothing to keep for
    lp, ent, _ = _HeadLogprobs.apply(hidden, weight, bias, labels, float(temperature), max(1, int(chunk_size)),
                                     bool(with_entropy), keep)       # backward (needs_input_grad says True there)
    return lp, (ent if with_entropy else None)


def head_logprobs_at(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, extra_ids: Tensor,
                     temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                     keep_bytes: int = KEEP_BYTES) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """head_logprobs, and the log-probs of ``extra_ids`` (N, k) (e.g. a teacher's top-k tokens) from the same
    chunks: log softmax(z / T)[extra_ids], (N, k) float32, differentiable (d/dz = onehot - p).  Not over a
    vocabulary-sharded head (--tp_size: refused at parse time with --opd_topk)."""
    if is_vocab_sharded(weight):
        raise ValueError("head_logprobs_at: a vocabulary-sharded head (--tp_size > 1) is not supported")
    keep = max(0, int(keep_bytes)) if torch.is_grad_enabled() else 0
    lp, ent, xl = _HeadLogprobs.apply(hidden, weight, bias, labels, float(temperature), max(1, int(chunk_size)),
                                      bool(with_entropy), keep, extra_ids)
    return lp, (ent if with_entropy else None), xl


def fusable_head(model) -> Optional[torch.nn.Linear]:
    """The model's LM head when head_logprobs can stand in for it, else None (then use the plain logits path).

    FSDP2: the head's weight is a DTensor shard until the forward; the root FSDP unit (which holds the embedding,
    the final norm and the head; the head is never a unit of its own here) is not resharded after forward
    (FSDP2Engine passes ``reshard_after_forward=False`` for the root, torch's own default for it:
    torch/distributed/fsdp/_fully_shard/_fsdp_state.py ``_lazy_init``, "For the root, do not reshard after
    forward"), so after ``model(...)`` ``head.weight`` is the unsharded (compute-dtype) tensor and its gradient
    is reduce-scattered by the root's post-backward.  Read the weight with ``head_params`` after the forward.

    Not fusable: heads that are not a plain Linear (LoRA on the head), ZeRO-3 partitioned weights, a head that
    is sharded by an FSDP unit other than the root, models whose forward post-processes the logits
    (soft-capping, logit scale).
    """
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if type(head) is not torch.nn.Linear:
        return None
    w = head.weight
    if hasattr(w, "ds_id") or w.dim() != 2 or w.numel() == 0:
        return None
    if type(w.data) is not torch.Tensor and not _unsharded_by_root_forward(model, head):
        return None
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(cfg, attr, None) not in (None, 1, 1.0):
            return None
    return head


def _unsharded_by_root_forward(model, head) -> bool:
    """``head`` belongs to the FSDP2 root unit ``model`` (no other FSDP unit between them)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return False
    return not any(isinstance(m, FSDPModule) and m is not model and any(c is head for c in m.modules())
                   for m in model.modules())


def head_params(head: torch.nn.Linear) -> Tuple[Tensor, Optional[Tensor]]:
    """(weight, bias) of a fusable head, read after the model's forward (FSDP2: the unsharded tensors); float32
    copies for a head marked by ``use_fp32_head`` (--lm_head_fp32), so its logits are computed in fp32."""
    w, b = head.weight, head.bias
    if is_vocab_sharded(w):  # --tp_size: FSDP2 gathered the data-parallel shards; TP's vocabulary shard stays
        return (w.float(), None if b is None else b.float()) if is_fp32_head(head) else (w, b)
    if type(w.data) is not torch.Tensor:
        raise RuntimeError("the LM head's weight is still sharded after the forward (an FSDP unit of its own?); "
                           "fusable_head should have returned None for this model")
    if is_fp32_head(head):  # differentiable casts: the gradient flows back to the compute-dtype weight
        return w.float(), (None if b is None else b.float())
    return w, b


FP32_MARK = "rlhf_fp32_logits"  # attribute on the LM head module: compute its logits in float32


def is_fp32_head(head: torch.nn.Module) -> bool:
    return bool(getattr(head, FP32_MARK, False))


def use_fp32_head(model) -> torch.nn.Linear:
    """--lm_head_fp32: the LM head computes its logits in float32 from the (bf16) hidden states, on the fused path
    (``head_params`` hands the kernel fp32 copies of the weight and bias) and on the model's own forward (the
    head's forward casts its input, weight and bias to fp32).  Without it a bf16 head rounds each logit to bf16
    (8 significant bits: +-0.03 at a logit of 10) before the float32 softmax, so log-probs carry 5e-3..2e-2 of
    rounding that the ratio, the KL and ``rollout_logprob_gap`` see.

    TRL's ``cast_lm_head_to_fp32`` (trl/trainer/grpo_trainer.py: ``lm_head.float()`` and a forward of
    ``F.linear(hidden_states.to(float32), weight.to(float32), bias)``; trl/trainer/grpo_config.py, after ScaleRL)
    does the same; here the stored weight keeps its dtype (FSDP2's fp32 masters, or a frozen model's bf16) and the
    cast happens per call, so a tied embedding is untouched.  Cost: a float32 copy of the head weight
    (4 x vocab x hidden bytes, 2.2 GB at 152k x 3584) while a micro-batch's graph lives, and fp32 head matmuls.
    A LoRA adapter on the head is refused, as TRL does (the fp32 forward would bypass it)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        raise ValueError("--lm_head_fp32: the model has no LM head (get_output_embeddings() is None); drop the flag")
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"--lm_head_fp32 needs a plain Linear LM head, got {type(head).__name__} (a LoRA adapter "
                         f"on lm_head?): remove lm_head from --target_modules, or drop --lm_head_fp32")
    setattr(head, FP32_MARK, True)
    head.forward = _fp32_forward.__get__(head)
    return head


def _fp32_forward(self: torch.nn.Linear, hidden_states: Tensor) -> Tensor:
    return torch.nn.functional.linear(hidden_states.float(), self.weight.float(),
                                      None if self.bias is None else self.bias.float())


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
        with warnings.catch_warnings():  # the identity returns a view of the hidden states, which FSDP2 warns about
            warnings.filterwarnings("ignore", r"FSDP2-wrapped module .* returned a view tensor")  # (no in-place use)
            yield
    finally:
        setattr(owner, name, head)
