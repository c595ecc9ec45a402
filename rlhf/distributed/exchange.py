"""Experience exchange between role groups: gather variable-length padded batches."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F


def all_gather_padded(x: torch.Tensor, group=None, pad_value=0) -> torch.Tensor:
    """Concatenate (b_i, T_i, ...) tensors of every rank of ``group`` along dim 0, right-padding dim 1 to max T.

    Ranks may hold different b_i (including 0) and T_i.  Works on gloo and nccl.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    n = dist.get_world_size(group)
    shape = torch.tensor(list(x.shape[:2]) if x.dim() >= 2 else [x.shape[0], 1], dtype=torch.long, device=x.device)
    shapes = [torch.zeros_like(shape) for _ in range(n)]
    dist.all_gather(shapes, shape, group=group)
    max_b = int(max(s[0] for s in shapes))
    max_t = int(max(s[1] for s in shapes))
    if x.dim() == 1:
        buf = F.pad(x, (0, max_b - x.shape[0]), value=pad_value)
    else:
        pad = [0, 0] * (x.dim() - 2) + [0, max_t - x.shape[1], 0, max_b - x.shape[0]]
        buf = F.pad(x, pad, value=pad_value)
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf.contiguous(), group=group)
    return torch.cat([b[: int(s[0])] for b, s in zip(bufs, shapes)], 0)


def shard_rows(n_rows: int, rank: int, world: int) -> slice:
    """Contiguous near-equal split of n_rows over world ranks."""
    base, extra = divmod(n_rows, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def broadcast_object(obj, src: int, group=None):
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box: List = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
