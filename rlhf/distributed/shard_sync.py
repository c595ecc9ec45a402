"""Weight sync from every shard: each actor rank sends the blocks of the parameters it holds, no rank gathers the
whole model (issue 45 item 5).

A parameter's block on a rank is read from the DTensor itself: its device mesh and placements give the local
shape and the global offset (torch ``compute_local_shape_and_global_offset``, torch/distributed/tensor/_utils.py),
whatever the mesh: FSDP2's (dp_shard), a TP mesh (Shard on the out or in dimension), HSDP / EP meshes with
replicated dimensions.  A block held by several ranks (a Replicate dimension) is sent once, by the replica whose
coordinate on every replicated dimension is 0; a plain tensor (not sharded) by actor rank 0 only.  So the bytes a
rank sends per receiver are its own shard's: sum over parameters of local numel x element size (replicas: 0).

The receiving rank (an engine in the trainer's process on a rollout rank of its own) learns every sender's blocks
once (``Layout``: int64 rows, sent point to point), then per bucket receives one flat tensor from each sender that
holds part of it and assembles full tensors block by block (``assemble``: every element must be covered exactly
once, or the sync stops naming the parameter).  Each bucket holds one dtype, so a sender's part is one flat tensor.

Where this does not apply, the gather path of ``rlhf.distributed.weight_sync`` stays: vLLM's own processes receive
from actor rank 0 over the weight-transfer group; a LoRA model's merged weights need W and B A whole; DeepSpeed
ZeRO-3's flat partitions are no blocks; ``_StridedShard`` placements (FSDP2 over a TP dimension of the same tensor
dimension) are gathered by ``full_tensor``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from rlhf.distributed import comm

WIDTH = 1 + 2 * 4  # a layout row: parameter index, offset[4], shape[4] (tensors of up to 4 dims)


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def block(p, actor_rank: int) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...], torch.Tensor]]:
    """(global offset, local shape, local tensor) of the block of ``p`` this rank sends, None where another rank
    sends it (a replica) or this rank holds none of it."""
    t = p.data if isinstance(p, torch.nn.Parameter) else p
    if not is_dtensor(t):
        return ((0,) * t.dim(), tuple(t.shape), t) if actor_rank == 0 else None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, places = t.device_mesh, t.placements
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    if any(type(pl).__name__ == "_StridedShard" for pl in places):
        raise NotImplementedError(f"_StridedShard placement {places}: gather this parameter (full_tensor)")
    if any(not pl.is_shard() and c != 0 for pl, c in zip(places, coord)):
        return None  # a replica: the one at coordinate 0 of the replicated dimensions sends
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, places)
    local = t.to_local()
    if local.numel() == 0:
        return None
    return tuple(offset), tuple(shape), local


def encode(rows: Sequence[Tuple[int, Tuple[int, ...], Tuple[int, ...]]]) -> torch.Tensor:
    """Layout rows (parameter index, offset, shape) -> an int64 [n, WIDTH] tensor."""
    out = torch.zeros((len(rows), WIDTH), dtype=torch.long)
    for i, (idx, off, shape) in enumerate(rows):
        if len(shape) > 4:
            raise NotImplementedError(f"a {len(shape)}-dim parameter: the shard sync carries up to 4 dims")
        out[i, 0] = idx
        out[i, 1:1 + len(off)] = torch.tensor(off, dtype=torch.long)
        out[i, 5:5 + len(shape)] = torch.tensor(shape, dtype=torch.long)
    return out


def decode(t: torch.Tensor, ndims: Sequence[int]) -> List[Tuple[int, Tuple[int, ...], Tuple[int, ...]]]:
    rows = []
    for r in t.tolist():
        n = ndims[r[0]]
        rows.append((r[0], tuple(r[1:1 + n]), tuple(r[5:5 + n])))
    return rows


def numel(shape) -> int:
    return int(torch.Size(shape).numel())


def dtype_buckets(meta: Sequence[tuple], bucket_bytes: int, dtype: Optional[torch.dtype]) -> List[List[int]]:
    """Parameter indices in buckets of at most ``bucket_bytes``, one dtype per bucket (each dtype's parameters in
    their order; a larger tensor gets its own bucket)."""
    by: Dict[torch.dtype, List[int]] = {}
    for i, (_, _, dt) in enumerate(meta):
        by.setdefault(dtype or dt, []).append(i)
    buckets = []
    for dt, idx in by.items():
        size, cur = 0, []
        for i in idx:
            n = numel(meta[i][1]) * torch.empty((), dtype=dt).element_size()
            if cur and size + n > bucket_bytes:
                buckets.append(cur)
                size, cur = 0, []
            cur.append(i)
            size += n
        if cur:
            buckets.append(cur)
    return buckets


def assemble(meta: Sequence[tuple], bucket: Sequence[int], parts: Dict[int, Tuple[torch.Tensor, list]],
             dtype: torch.dtype, device) -> List[Tuple[str, torch.Tensor]]:
    """Full tensors of ``bucket`` from each sender's flat part (``parts``: sender -> (flat, its layout rows in
    this bucket, in order)); every element covered exactly once."""
    full = {i: torch.empty(meta[i][1], dtype=dtype, device=device) for i in bucket}
    covered = dict.fromkeys(bucket, 0)
    for flat, rows in parts.values():
        pos = 0
        for idx, off, shape in rows:
            n = numel(shape)
            full[idx][tuple(slice(o, o + s) for o, s in zip(off, shape))] = flat[pos:pos + n].view(shape)
            covered[idx] += n
            pos += n
    bad = [meta[i][0] for i in bucket if covered[i] != numel(meta[i][1])]
    if bad:
        raise RuntimeError(f"shard sync: the senders' blocks do not cover {bad[:3]} exactly once (layouts differ "
                           f"between the actor and the rollout ranks)")
    return [(meta[i][0], full[i]) for i in bucket]


class ShardSync:
    """One side of the shard sync.  Senders: the actor ranks (``params``: (engine name, parameter) in one order
    on every actor rank); receivers: the rollout ranks whose engine loads in this process.  ``meta``: (engine name,
    full shape, dtype) per parameter, known on every side (broadcast by the caller)."""

    def __init__(self, meta: Sequence[tuple], senders: Sequence[int], receivers: Sequence[int], rank: int,
                 bucket_bytes: int, dtype: Optional[torch.dtype], device, timeout_s: float):
        self.meta, self.senders, self.receivers, self.rank = list(meta), list(senders), list(receivers), rank
        self.dtype, self.device, self.timeout_s = dtype, device, timeout_s
        self.buckets = dtype_buckets(self.meta, bucket_bytes, dtype)
        self.layouts: Optional[Dict[int, list]] = None  # receiver: sender -> its rows

    def _bucket_dtype(self, bucket) -> torch.dtype:
        return self.dtype or self.meta[bucket[0]][2]

    def send(self, params: Sequence[Tuple[str, torch.Tensor]]) -> int:
        """Sender: this rank's blocks, bucket by bucket, to every receiver; returns the bytes sent (all receivers)."""
        actor_rank = self.senders.index(self.rank)
        mine = {i: b for i, (_, p) in enumerate(params) if (b := block(p, actor_rank)) is not None}
        if self.layouts is None:  # once: how many rows, then the rows
            rows = encode([(i, off, shape) for i, (off, shape, _) in sorted(mine.items())])
            comm.exchange([(torch.tensor([rows.size(0)]), r) for r in self.receivers], [], self.timeout_s)
            if rows.size(0):
                comm.exchange([(rows, r) for r in self.receivers], [], self.timeout_s)
            self.layouts = {}
        total = 0
        for bucket in self.buckets:
            parts = [mine[i][2].reshape(-1).to(self._bucket_dtype(bucket)) for i in bucket if i in mine]
            if not parts:
                continue
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            comm.exchange([(flat, r) for r in self.receivers], [], self.timeout_s)
            total += flat.numel() * flat.element_size() * len(self.receivers)
        return total

    def receive(self, load) -> int:
        """Receiver: every bucket's blocks from their senders, assembled and handed to ``load`` (a list of
        (engine name, full tensor)); returns the bytes received."""
        if self.layouts is None:
            ns = {s: torch.zeros(1, dtype=torch.long) for s in self.senders}
            comm.exchange([], [(t, s) for s, t in ns.items()], self.timeout_s)
            rows = {s: torch.zeros((int(ns[s]), WIDTH), dtype=torch.long) for s in self.senders if int(ns[s])}
            comm.exchange([], [(t, s) for s, t in rows.items()], self.timeout_s)
            ndims = [len(m[1]) for m in self.meta]
            self.layouts = {s: decode(t, ndims) for s, t in rows.items()}
        total = 0
        for bucket in self.buckets:
            dt, inb = self._bucket_dtype(bucket), set(bucket)
            parts = {}
            for s, rows in self.layouts.items():
                mine = [r for r in rows if r[0] in inb]
                if mine:
                    flat = torch.empty(sum(numel(r[2]) for r in mine), dtype=dt, device=self.device)
                    parts[s] = (flat, sorted(mine, key=lambda r: bucket.index(r[0])))
            comm.exchange([], [(flat, s) for s, (flat, _) in parts.items()], self.timeout_s)
            total += sum(f.numel() * f.element_size() for f, _ in parts.values())
            load(assemble(self.meta, bucket, parts, dt, self.device))
        return total


def shard_params(model, lora: str = "merge") -> List[Tuple[str, torch.Tensor]]:
    """(engine name, parameter) in ``weight_sync.param_meta``'s order (no aliases); ``lora="base"``: a LoRA
    layer's base under the engine's name, its A and B left out (they travel as the adapter)."""
    from rlhf.distributed.lora_sync import LORA_PARTS, _engine_name, lora_scalings

    scal = lora_scalings(model) if lora == "base" else {}
    out = []
    for name, p in model.named_parameters():
        if any(name.endswith(k) and name[: -len(k)] in scal for k in LORA_PARTS):
            continue
        out.append((_engine_name(name), p))
    return out


def shard_route(model, lora: str, engines_apart: bool) -> str:
    """``shards`` where every actor rank can send its blocks to engines in the trainer's process: not to vLLM's
    own processes or tied aliases (``engines_apart``), not a merged LoRA model (W + s B A needs W, A and B whole),
    not ZeRO-3 partitions or ``_StridedShard`` placements; else ``gather``."""
    from rlhf.distributed.gather import zero3_param
    from rlhf.distributed.lora_sync import lora_scalings

    if engines_apart or (lora == "merge" and lora_scalings(model)):
        return "gather"
    for _, p in model.named_parameters():
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        if zero3_param(p) or t.dim() > 4 or (is_dtensor(t) and any(type(pl).__name__ == "_StridedShard"
                                                                     for pl in t.placements)):
            return "gather"
    return "shards"
