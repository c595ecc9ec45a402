"""How a weight sync reaches the rollout engines (``connect``): engines in the trainer's process, or vLLM's workers
in processes of their own over a weight-transfer group with actor rank 0 (``rlhf.distributed.transport``).  Used by
``rlhf.distributed.weight_sync.WeightSync`` once, at its first sync."""
from __future__ import annotations

from rlhf.distributed import comm
from rlhf.distributed import transport as transfer


def wants_tied_aliases(engine) -> bool:
    """Does this rank's engine (None: none here) need a tied weight under each of its names?  An engine says so
    with ``tied_weights_apart`` (vLLM: see ``weight_sync._export``); the HF engine shares the tensor and takes one
    name."""
    return engine is not None and engine.tied_weights_apart


def connect(groups, eng, src: int, timeout_s: float, device) -> dict:
    """Once, on every rank of the sync group: do the engines receive directly, and if so build the
    weight-transfer group.  Every sync rank says (direct, workers) (workers: its engine's TP size on an
    engine's first rank, else 0); actor rank 0 opens a TCPStore and sends its address; each engine's first
    rank makes its workers join at ``rank_offset`` = 1 + the workers before it, while actor rank 0 joins as
    rank 0.  Both joins block until the group is complete, at most ``timeout_s``."""
    direct = eng is not None and eng.direct_weights
    workers = eng.weight_workers() if direct else 0
    info = comm.all_gather_object((direct, workers, wants_tied_aliases(eng)), group=groups.group("sync"))
    aliases = any(a for _, _, a in info)  # tied weights under every name if any engine needs them
    info = [(d, w) for d, w, _ in info]
    if not any(d for d, _ in info):
        return {"direct": False, "aliases": aliases}
    world = 1 + sum(w for _, w in info)
    is_src = groups.rank == src
    store = addr = None
    if is_src:
        backend = transfer.transfer_backend(device)
        store, port = transfer.open_store(transfer.sender_address(), timeout_s)
        addr = (transfer.sender_address(), port, backend)
    host, port, backend = comm.broadcast_object(addr, src, groups.group("sync"))
    if is_src:
        group = transfer.TransferGroup(store, 0, world, backend, timeout_s, device)
        print(f"[weights] direct to {world - 1} vLLM worker(s) of {sum(1 for _, w in info if w)} engine(s) "
              f"over {backend} (weight-transfer group at {host}:{port})", flush=True)
        return {"direct": True, "group": group, "aliases": aliases}
    if workers:
        me = comm.rank(groups.group("sync"))
        offset = 1 + sum(w for _, w in info[:me])
        eng.join_weight_group(host, port, offset, world, backend, timeout_s)
    return {"direct": True, "joined": bool(workers), "aliases": aliases}
