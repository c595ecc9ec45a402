"""Shard -> compute -> gather: the one way rows of a batch are split over a role's ranks and brought back.

Every rank of the job calls these functions with the same arguments that all ranks
share (row count, member list, micro-batch size), whatever its own data.  So the
sequence of collectives is the same everywhere: an empty shard, an uneven split,
or a rank that holds no member of the role still runs the same collective calls.

* ``shard_rows(n, i, k)``: member i's contiguous slice of n rows over k members
  (possibly empty).
* ``micro_plan(n, i, k, micro)``: member i's micro-batches; the *same count* on every
  member (sharded forwards are collectives), ``None`` where a member has no rows left
  (run a dummy forward and drop its output).
* ``gather_rows(local, rows, n, width)``: the full (n, width) tensor on every rank;
  the owner of each row contributes it, everybody else zeros, one ``all_reduce``.
* ``gather_max(ws)``: the widest of every rank's widths (one ``all_reduce``), for
  outputs whose width is only known after computing (generation).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch

from rlhf.distributed import comm


def shard_rows(n_rows: int, index: int, size: int) -> slice:
    """Contiguous near-equal split of n_rows over size members: member ``index``'s rows."""
    base, extra = divmod(n_rows, size)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


def micro_count(n_rows: int, size: int, micro: int) -> int:
    """Micro-batches every member runs: enough for the largest shard, at least one."""
    return max(1, math.ceil(math.ceil(n_rows / size) / micro))


def micro_plan(n_rows: int, index: int, size: int, micro: int) -> List[Optional[slice]]:
    """Member ``index``'s micro-batches over its shard; ``micro_count`` entries, ``None`` for an empty one."""
    sl = shard_rows(n_rows, index, size)
    k = micro_count(n_rows, size, micro)
    out: List[Optional[slice]] = []
    for j in range(k):
        a, b = sl.start + j * micro, min(sl.start + (j + 1) * micro, sl.stop)
        out.append(slice(a, b) if b > a else None)
    return out


def gather_rows(local: Optional[torch.Tensor], rows: Optional[slice], n_rows: int, width: int,
                dtype=torch.float32, group=None) -> torch.Tensor:
    """(n_rows, width) on every rank, on the CPU: rows ``rows`` from ``local`` (this rank's part, or None),
    zeros elsewhere.

    Each row must be contributed by exactly one rank.  ``local`` may be narrower than
    ``width`` (right-padded with zeros) and live on any device.  One all_reduce over ``group`` (default the
    world; every rank of it calls), on the collective device (``comm.device()``).
    """
    out = torch.zeros((n_rows, width), dtype=dtype, device=comm.device())
    if local is not None and rows is not None and rows.stop > rows.start:
        x = local.to(device=out.device, dtype=dtype)
        if x.dim() == 1:
            x = x.unsqueeze(1)
        out[rows, : x.size(1)] = x
    comm.all_reduce(out, group=group)
    return out.cpu()


def gather_max(values: Sequence[int], group=None) -> List[int]:
    """The element-wise maximum of ``values`` over every rank of ``group`` (default the world; one all_reduce)."""
    t = torch.tensor(list(values), dtype=torch.long, device=comm.device())
    comm.all_reduce(t, op="max", group=group)
    return [int(v) for v in t.tolist()]


def run_micro(fn: Callable[[slice], torch.Tensor], plan: Sequence[Optional[slice]], dummy: slice
              ) -> Optional[torch.Tensor]:
    """Run ``fn`` on each micro-batch of ``plan`` (a dummy slice where a member has none), concatenating
    the real outputs on the CPU; None when this member had no rows."""
    outs = []
    for part in plan:
        y = fn(part if part is not None else dummy)
        if part is not None:
            outs.append(y.detach().cpu())
    return torch.cat(outs) if outs else None


def all_gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` (pickled), in rank order (of ``group``; default the world)."""
    return comm.all_gather_object(obj, group=group)
