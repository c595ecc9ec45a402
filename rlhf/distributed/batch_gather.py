"""The one row gather of the step record (``rlhf.batch.Batch``): the fields a stage names, from the ranks that own
rows to every rank of a group, driven by each field's metadata (kind, block, dtype) as ``Batch``'s operations are.
Its collectives go through ``rlhf.distributed.sharding`` (and so ``comm``)."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from rlhf.batch import IMAGES, NAMED, ROW, SEQ, TOKEN, Batch, spec
from rlhf.distributed.sharding import all_gather_objects, gather_max, gather_rows


def _width(kind: str, P: int, R: int, keys: int) -> int:
    return {SEQ: P + R, TOKEN: R, ROW: 1, NAMED: keys}[kind]


def gather_batch(local: Optional[Batch], owned: Optional[slice], n_rows: int, names: Sequence[str], pad_id: int,
                 group=None, cls=None) -> Batch:
    """Fields ``names`` of every rank's rows on every rank of ``group`` (default the world); ``local`` holds rows
    ``owned`` (None on a rank that reports none).  Every row has one owner.

    Collectives, the same on every rank of the group whatever it holds: one max of the widths (when a field has
    a width: SEQ / TOKEN), one gather of the log names (when ``extra_logs`` is asked for: the names every owner
    has), one gather of the int block and one of the float block (rlhf.distributed.sharding).  ``cls``: the
    record class (default ``Batch``)."""
    cls = cls or Batch
    specs = [(n, spec(n, cls)) for n in names]
    P = R = 0
    deep = {n: 1 for n, m in specs if m.get("only") in ("routing", "topk")}  # (B, T, D): D per column, from owners
    if any(m["kind"] in (SEQ, TOKEN) for _, m in specs):
        P, R, *ds = gather_max([local.prompt_len if local is not None else 0,
                                local.num_actions if local is not None else 0]
                               + [getattr(local, n).size(-1) if local is not None else 0 for n in deep], group)
        deep = dict(zip(deep, ds))
    keys: List[str] = []
    if any(m["kind"] == NAMED for _, m in specs):
        own = sorted(local.extra_logs) if local is not None else None
        every = [k for k in all_gather_objects(own, group) if k is not None]
        keys = sorted(set.intersection(*map(set, every))) if every else []
    if local is not None and P:
        local = local.padded(P, R, pad_id)
    out = {}
    for block, dtype in (("int", torch.long), ("float", torch.float32)):
        mine = [(n, m) for n, m in specs if m["block"] == block]
        if not mine:  # from ``names``, the same on every rank: no collective for an empty block
            continue
        width = sum(_width(m["kind"], P, R, len(keys)) * deep.get(n, 1) for n, m in mine)
        cols = None if local is None else torch.cat([_columns(local, n, m, keys, dtype) for n, m in mine], 1)
        got = gather_rows(cols, owned, n_rows, width, dtype, group)
        o = 0
        for n, m in mine:
            w = _width(m["kind"], P, R, len(keys)) * deep.get(n, 1)
            part = got[:, o:o + w] if n not in deep else got[:, o:o + w].reshape(n_rows, -1, deep[n])
            o += w
            if m["kind"] == NAMED:
                out[n] = {k: part[:, i].to(m["dtype"]) for i, k in enumerate(keys)}
            else:
                out[n] = (part[:, 0] if m["kind"] == ROW else part).to(m["dtype"])
    for n, m in specs:  # per-row lists of any length (images): one object gather, owners' rows in order
        if m["kind"] == IMAGES:
            every = all_gather_objects(None if local is None else (owned.start, getattr(local, n)), group)
            out[n] = [t for _, part in sorted((e for e in every if e is not None), key=lambda e: e[0]) for t in part]
    if "sequences" in out and "attention_mask" in out:  # pad ids wherever the mask is 0
        seq = out["sequences"]
        out["sequences"] = torch.where(out["attention_mask"].bool(), seq, torch.full_like(seq, pad_id))
    return cls(prompt_len=P if P else None, **out)


def _columns(b: Batch, name: str, m: dict, keys: List[str], dtype) -> torch.Tensor:
    v = getattr(b, name)
    if v is None:
        raise ValueError(f"gather: this rank's batch has no {name!r} ({m['doc']}): the field list given to "
                         f"gather_batch must name only fields every owner sets")
    if m["kind"] == NAMED:
        return torch.stack([v[k].to(dtype) for k in keys], 1) if keys else torch.zeros(b.size(), 0, dtype=dtype)
    v = v.to(dtype)
    return v.unsqueeze(1) if m["kind"] == ROW else v.flatten(1)
