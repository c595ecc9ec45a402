"""Sequence parallelism (Ulysses): one packed sequence split over ``--ring_attn_size`` ranks.

Each rank of a sequence-parallel (SP) group of N ranks holds a contiguous slice of S/N tokens of the packed row
(padded to a multiple of N) and runs every token-local layer (embedding, norms, MLP, LM/value head) on its slice
only.  Attention needs the whole sequence, so around it two all-to-alls trade the split: before it, each rank
sends head group j of its slice to rank j and receives its head group of every slice (sequence gathered, heads
scattered); after it, the reverse (heads gathered, sequence scattered):

    q, k, v: (B, H, S/N, D) --all-to-all--> (B, H/N, S, D) --attention--> (B, S, H/N, D) --all-to-all--> (B, S/N, H, D)

Attention itself is transformers' own sdpa / flash-attention function on the full sequence, with the full position
ids (gathered from the slices): flash-attention's varlen kernel reads the packed samples from them (a flash
implementation keeps its name, ``register_flash``: transformers loads the kernel by it); sdpa (and eager)
runs causal attention sample by sample (no (T, T) mask, nothing computed between samples), the same attention as
the block-diagonal causal mask transformers builds for a packed row at N=1.
Mirrors veRL's Ulysses (verl/utils/ulysses.py ``gather_seq_scatter_heads`` / ``gather_heads_scatter_seq``,
verl/models/transformers/monkey_patch.py ``_ulysses_flash_attention_forward``, which also all-gathers the
position ids), but hooks transformers' attention registry (``AttentionInterface.register("rlhf_ulysses", ...)``)
instead of patching model classes.  OpenRLHF's ``--ring_attn_size`` flag names the group size; its
openrlhf/models/ring_attn_utils.py splits packed rows the same way (``unpad_and_slice_tensor``: pad to a multiple of
the group, contiguous slice per rank, labels taken from the row rolled by one before slicing;
``gather_and_pad_tensor``: all-gather the per-token log-probs), but runs ring flash-attention (ring_flash_attn,
CUDA only) where this runs Ulysses over any transformers attention.

Every quantity a loss reads is computed on the slice that holds it and summed over the group
(``comm.sum_over``, differentiable), so every SP rank computes the same loss; the backward of that sum hands each
rank N times its slice's gradient, and the engines' average over all R = N x D ranks (with N x the batch per
optimizer step, ``spec_from_config``) leaves exactly the data-parallel gradient.  Labels are shifted before
slicing: the token a slice's last position predicts lives on the next rank, so positions are chosen on the full
row (``positions``) and each rank computes the ones in its range.

Constraints: attention heads and key/value heads divisible by N (checked before any process group,
``check_sp``), packed batches (``--packing_samples``, as OpenRLHF's ring attention), training and log-prob /
value forwards only (generation runs on the rollout engine, unsplit).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from rlhf.distributed import comm

ATTN_NAME = "rlhf_ulysses"


@dataclass
class SP:
    """This rank's sequence-parallel group: ``size`` ranks, this rank's ``rank`` in it, its process ``group``."""
    size: int = 1
    rank: int = 0
    group: Any = None
    inner: str = "sdpa"                       # the attention the all-to-alls wrap (set by ``attach``)
    _mask: Optional[Tuple[torch.Tensor, Any]] = field(default=None, repr=False)  # (positions, their segments)

    @property
    def on(self) -> bool:
        return self.size > 1


def dp_coords(index: int, size: int, sp_size: int) -> Tuple[int, int, int]:
    """(data-parallel rank, data-parallel size, SP rank) of member ``index`` of a role of ``size`` members with SP
    groups of ``sp_size`` consecutive members: every member of an SP group is the same data-parallel rank."""
    if size % sp_size:
        raise ValueError(f"--ring_attn_size {sp_size} must divide the role's {size} ranks")
    return index // sp_size, size // sp_size, index % sp_size


def padded_len(n: int, sp_size: int) -> int:
    """The packed row's length rounded up to a multiple of the SP size."""
    return -(-n // sp_size) * sp_size


def local_range(n_padded: int, sp_size: int, sp_rank: int) -> Tuple[int, int]:
    """[start, stop) of SP rank ``sp_rank``'s contiguous slice of a row of ``n_padded`` tokens."""
    s = n_padded // sp_size
    return sp_rank * s, (sp_rank + 1) * s


def pad_packed(ids: torch.Tensor, pos: torch.Tensor, sp_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(1, T) ids and position ids padded on the right to a multiple of ``sp_size``.  The pad tokens are a sample of
    their own (positions 0, 1, ...) at the end: causal attention keeps every real token from seeing them."""
    extra = padded_len(ids.size(1), sp_size) - ids.size(1)
    if extra == 0:
        return ids, pos
    ids = torch.cat([ids, ids.new_zeros((1, extra))], 1)
    pos = torch.cat([pos, torch.arange(extra, device=pos.device, dtype=pos.dtype).unsqueeze(0)], 1)
    return ids, pos


def segments(position_ids: torch.Tensor) -> List[Tuple[int, int]]:
    """[start, stop) of every sample of a packed (1, T) row: a sample starts where its position id is 0."""
    starts = (position_ids[0] == 0).nonzero().squeeze(1).tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return list(zip(starts, starts[1:] + [position_ids.size(1)]))


def seq_to_heads(x: torch.Tensor, sp: SP) -> torch.Tensor:
    """(B, H, S/N, D) -> (B, H/N, S, D): gather the sequence, scatter the heads (veRL gather_seq_scatter_heads)."""
    n = sp.size
    B, H, s, D = x.shape
    y = x.reshape(B, n, H // n, s, D).permute(1, 0, 2, 3, 4)           # chunk j: head group j, for rank j
    y = comm.all_to_all_single(y, sp.group)                             # chunk j: my head group of rank j's slice
    return y.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * s, D)


def heads_to_seq(x: torch.Tensor, sp: SP) -> torch.Tensor:
    """(B, S, H/N, D) -> (B, S/N, H, D): gather the heads, scatter the sequence (veRL gather_heads_scatter_seq)."""
    n = sp.size
    B, S, h, D = x.shape
    y = x.reshape(B, n, S // n, h, D).permute(1, 0, 2, 3, 4)           # chunk j: rank j's slice, my heads
    y = comm.all_to_all_single(y, sp.group)                             # chunk j: my slice, head group j
    return y.permute(1, 2, 0, 3, 4).reshape(B, S // n, n * h, D)


def _full_positions(local: torch.Tensor, sp: SP) -> torch.Tensor:
    return comm.all_gather_tensor(local[0].contiguous(), sp.group).unsqueeze(0)


def _segments(full_pos: torch.Tensor, sp: SP) -> List[Tuple[int, int]]:
    """``segments`` of the row, computed once per forward (every layer, and a checkpointed layer's recompute, asks
    again with the same positions)."""
    if sp._mask is not None and sp._mask[0].shape == full_pos.shape and torch.equal(sp._mask[0], full_pos):
        return sp._mask[1]
    segs = segments(full_pos)
    sp._mask = (full_pos, segs)
    return segs


def _inner_fn(name: str):
    """transformers' own attention function registered under ``name`` (the original one where ``register_flash``
    wrapped it in place)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    f = ALL_ATTENTION_FUNCTIONS[name]
    return getattr(f, "_rlhf_inner", f)


def is_flash(name: Optional[str]) -> bool:
    """Whether ``name`` is a flash-attention implementation: transformers' ``flash_attention_forward`` (registered
    under flash_attention_2/3/4 and hub kernel names) looks its kernel up by ``config._attn_implementation``."""
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not name or name == ATTN_NAME:
        return False
    return "flash" in name or (name in ALL_ATTENTION_FUNCTIONS and _inner_fn(name) is flash_attention_forward)


_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # the local slice's, if any


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """The Ulysses attention: all-to-all, the wrapped attention on the full sequence, all-to-all back.
    Same contract as transformers' attention functions: (B, H, s, D) in, ((B, s, H, D), None) out."""
    sp: Optional[SP] = getattr(module, "_rlhf_sp", None)
    inner = _inner_fn(sp.inner if sp is not None else "sdpa")
    if sp is None or not sp.on:
        return inner(module, query, key, value, attention_mask, **kwargs)
    pos = kwargs.pop("position_ids", None)
    if pos is None:
        raise ValueError("sequence parallelism needs position_ids (packed rows): pass --packing_samples")
    full = _full_positions(pos, sp)
    q, k, v = (seq_to_heads(t, sp) for t in (query, key, value))
    if is_flash(sp.inner):  # varlen kernels read the packed samples from the full row's position ids
        for name in _VARLEN_KWARGS:
            kwargs.pop(name, None)
        out, _ = inner(module, q, k, v, None, position_ids=full, **kwargs)
    else:  # causal attention sample by sample: no (T, T) mask, no work on pairs of different samples
        out = torch.cat([inner(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, position_ids=full[:, a:b],
                               **kwargs)[0] for a, b in _segments(full, sp)], 1)
    return heads_to_seq(out, sp), None


def _keeping_name(original):
    """``original`` (a flash attention function) wrapped for registration under its own name: modules attached to
    an SP group take the Ulysses path, every other module calls ``original`` unchanged."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        sp: Optional[SP] = getattr(module, "_rlhf_sp", None)
        if sp is None or not sp.on:
            return original(module, query, key, value, attention_mask, **kwargs)
        return ulysses_attention(module, query, key, value, attention_mask, **kwargs)

    attention._rlhf_inner = original
    return attention


def register() -> None:
    """Register ``rlhf_ulysses`` in transformers' attention registry (idempotent).  It has no mask function of
    its own, so transformers builds no mask for it (masking_utils: an implementation outside
    ALL_MASK_ATTENTION_FUNCTIONS gets None) and the wrapper builds the packed mask of the full row."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention)


def register_flash(name: str) -> None:
    """Wrap the flash attention registered under ``name`` in place (idempotent), keeping the name: transformers'
    ``flash_attention_forward`` (transformers/integrations/flash_attention.py) passes
    ``config._attn_implementation`` to ``lazy_import_flash_attention`` (modeling_flash_attention_utils.py), which
    loads the kernel by that name (flash_attention_2 -> the flash_attn package; an unknown name -> a hub kernel), so
    renaming the implementation fails at the first attention call ("Could not find the currently requested flash
    attention implementation").  veRL keeps ``flash_attention_2`` too and patches ``_flash_attention_forward``
    instead (verl/models/transformers/monkey_patch.py ``_ulysses_flash_attention_forward``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    f = ALL_ATTENTION_FUNCTIONS[name]
    if not hasattr(f, "_rlhf_inner"):
        AttentionInterface.register(name, _keeping_name(f))


def _attention_modules(model) -> List[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "config") and hasattr(m, "head_dim")
            and any(hasattr(m, p) for p in ("q_proj", "qkv_proj", "c_attn"))]


def attach(model, sp: Optional[SP]):
    """Make ``model``'s forwards sequence-parallel over ``sp`` (no-op for None or size 1): its attention layers
    switch to ``rlhf_ulysses`` wrapping their own implementation (flash attention keeps its name and is wrapped in
    place, ``register_flash``), and the forwards of rlhf.models.forward split
    packed rows (``sp_of``).  Returns ``model``."""
    if sp is None or not sp.on:
        return model
    register()
    mods = _attention_modules(model)
    if not mods:
        raise ValueError(f"--ring_attn_size {sp.size}: found no attention layers with q_proj in "
                         f"{type(model).__name__}; sequence parallelism supports Llama/Qwen/Mistral-style models")
    for m in mods:
        cfg = m.config
        cur = cfg._attn_implementation
        if is_flash(cur):  # keep the name: the flash forward loads its kernel by it (register_flash)
            sp.inner = cur
            register_flash(cur)
        elif cur != ATTN_NAME:
            sp.inner = "sdpa" if cur in (None, "eager") else cur
            cfg._attn_implementation = ATTN_NAME
        m._rlhf_sp = sp
    model._rlhf_sp = sp
    return model


def sp_of(model) -> Optional[SP]:
    """The SP group ``model`` was attached to (None: plain forwards)."""
    sp = getattr(model, "_rlhf_sp", None)
    if sp is None and hasattr(model, "module"):  # a wrapper (DeepSpeed engine) around the attached model
        sp = getattr(model.module, "_rlhf_sp", None)
    return sp if sp is not None and sp.on else None


def local_hidden(forward, ids: torch.Tensor, pos: torch.Tensor, sp: SP) -> Tuple[torch.Tensor, int, int]:
    """Run ``forward(input_ids, position_ids)`` (returning (1, s, *) per-token outputs) on this rank's slice of the
    packed row: (its outputs (s, *), slice start, slice stop) in full-row coordinates."""
    ids, pos = pad_packed(ids, pos, sp.size)
    a, b = local_range(ids.size(1), sp.size, sp.rank)
    return forward(ids[:, a:b], pos[:, a:b])[0], a, b


def positions_in(rows: torch.Tensor, a: int, b: int) -> Tuple[int, int]:
    """[i, j) such that ``rows[i:j]`` (ascending full-row positions) are the ones in [a, b)."""
    return int(torch.searchsorted(rows, a)), int(torch.searchsorted(rows, b))


def collect(local: torch.Tensor, i: int, j: int, n: int, sp: SP) -> torch.Tensor:
    """(n, *) on every SP rank from each rank's rows [i, j) (``local``, (j - i, *)): zeros elsewhere, then one
    differentiable sum over the group (each row has one owner)."""
    pad = [0, 0] * (local.dim() - 1) + [i, n - j]
    return comm.sum_over(torch.nn.functional.pad(local, pad), sp.group)


def check_sp(sp_size: int, kind: str, packing: bool, world: Optional[int] = None,
             heads: Optional[Tuple[int, int]] = None) -> None:
    """The checks that run before any process group (rlhf.config.preflight): raise ValueError naming the flag and
    a value that works.  ``heads``: (attention heads, key/value heads) of the model, when readable."""
    if sp_size < 1:
        raise ValueError(f"--ring_attn_size must be >= 1, got {sp_size}; e.g. --ring_attn_size 1")
    if sp_size == 1:
        return
    if kind == "rm":
        raise ValueError(f"--ring_attn_size {sp_size}: train_rm does not split sequences; use --ring_attn_size 1")
    if not packing:
        raise ValueError(f"--ring_attn_size {sp_size} splits packed rows: add --packing_samples (as OpenRLHF's "
                         f"ring attention)")
    if heads is not None:
        h, kv = heads
        if h % sp_size or kv % sp_size:
            ok = max(k for k in range(1, sp_size + 1) if h % k == 0 and kv % k == 0
                     and (world is None or world % k == 0))
            raise ValueError(f"--ring_attn_size {sp_size} must divide the model's attention heads ({h}) and key/value "
                             f"heads ({kv}) (Ulysses splits heads over the group); use --ring_attn_size {ok}")
    if world is not None and world % sp_size:
        ok = max(k for k in range(1, sp_size + 1) if world % k == 0)
        raise ValueError(f"--ring_attn_size {sp_size} must divide the world size {world}; use --ring_attn_size {ok}")


def model_heads(path: Optional[str]) -> Optional[Tuple[int, int]]:
    """(num_attention_heads, num_key_value_heads) from a local model folder's config.json, or None."""
    import json
    import os

    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json")) as fh:
        c = json.load(fh)
    c = c.get("text_config", c)
    h = c.get("num_attention_heads")
    return (int(h), int(c.get("num_key_value_heads") or h)) if h else None
