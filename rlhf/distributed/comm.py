"""The one module that calls ``torch.distributed``: the default group, sub-groups, and every collective.

Why one module: a collective under NCCL only takes CUDA tensors (PyTorch dispatches a collective by the
tensor's device type and raises "No backend type associated with device type cpu" on an NCCL-only group),
while on CPU/gloo every mistake of that kind passes silently.  So the rules are made here, by construction:

* the default group is created with ``"cuda:nccl,cpu:gloo"`` on CUDA (as torchtitan does,
  torchtitan/distributed/utils.py ``init_distributed``), so a stray CPU tensor (a metric, a flag) still has a
  backend, and ``gloo`` on CPU; ``RLHF_DIST_BACKEND`` overrides it (tests: ``cuda:gloo`` runs 2 ranks on one
  GPU and, like NCCL alone, has no backend for CPU tensors);
* every tensor collective moves its tensor to the collective device (``device()``) and the result back to
  where the caller's tensor lives, so a caller cannot hand the wrong device to the backend;
* every group gets the job's ``--dist_timeout_s`` (``new_group`` defaults to NCCL's 10 minutes otherwise).

Everything else in the package asks this module (``tests/unit/test_comm.py`` greps for any other caller).  Library
internals (FSDP2, DCP, DeepSpeed, vLLM) make their own calls on the groups handed to them.
"""
from __future__ import annotations

import datetime
import os
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

BACKEND_ENV = "RLHF_DIST_BACKEND"
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class _State:
    device: torch.device = torch.device("cpu")
    timeout: datetime.timedelta = datetime.timedelta(seconds=1800)
    backend: str = "gloo"

    def __init__(self):
        self.groups_made: List[tuple] = []  # the ranks of every new_group this process created, in order


_S = _State()


def backend_string(cuda: Optional[bool] = None) -> str:
    """The default group's backend: ``cuda:nccl,cpu:gloo`` where CUDA and NCCL are usable, else ``gloo``;
    the environment variable ``RLHF_DIST_BACKEND`` (e.g. ``cuda:gloo``) overrides it."""
    if os.environ.get(BACKEND_ENV):
        return os.environ[BACKEND_ENV]
    if cuda is None:
        cuda = torch.cuda.is_available()
    return "cuda:nccl,cpu:gloo" if cuda and dist.is_nccl_available() else "gloo"


def uses_cuda(backend: str) -> bool:
    return "cuda" in backend or backend == "nccl"


def init(timeout_s: int = 1800) -> tuple:
    """Init the default group from torchrun's env, or a 1-rank group (in-memory store) when run as plain python.

    Returns (rank, world_size, local_rank, device); ``device`` is the model device and the collective device.
    Before any communicator exists it sets what every process of the job must agree on and the user has not set
    (launch/env.py ``apply_process_env``: NCCL_CUMEM_ENABLE, GLOO_SOCKET_IFNAME on several nodes); the processes
    this rank starts later (vLLM's workers) inherit it."""
    from launch.env import apply_process_env

    apply_process_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = backend_string()
    if uses_cuda(backend):
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    _S.device, _S.backend = device, backend
    _S.timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
            from rlhf.distributed.failfast import check_agent

            check_agent()  # torchrun's agent already gone: stop now, not after the store's timeout
            kw = {"device_id": device} if device.type == "cuda" and "nccl" in backend else {}
            store = agent_store(_S.timeout)
            if store is not None:
                kw.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
            dist.init_process_group(backend, timeout=_S.timeout, **kw)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=_S.timeout)
    return dist.get_rank(), dist.get_world_size(), local_rank, device


STORE_CONNECT_S = 60.0  # torchrun's agent store is up before its workers start: connecting takes milliseconds


def agent_store(timeout: datetime.timedelta):
    """Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``): a client of the agent's store, as torch's own env://
    rendezvous makes it (torch/distributed/rendezvous.py ``_create_c10d_store``), but connected within
    ``STORE_CONNECT_S`` rather than the job's ``--dist_timeout_s`` (a dead agent's store would otherwise be
    retried for that long); the job's timeout applies to every wait after it.  None elsewhere (rank 0 hosts the
    store and may start late: the env:// rendezvous keeps the job's timeout)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    connect = min(STORE_CONNECT_S, timeout.total_seconds())
    try:
        store = dist.TCPStore(addr, port, int(os.environ["WORLD_SIZE"]), is_master=False,
                              timeout=datetime.timedelta(seconds=connect))
    except (RuntimeError, OSError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        raise RuntimeError(f"no connection to torchrun's store at {addr}:{port} within {connect:.0f}s: the torchrun "
                           f"agent is gone or its node unreachable ({str(e).splitlines()[0][:200]})") from None
    store.set_timeout(timeout)
    return store


def device() -> torch.device:
    """Where collectives run (and models live): ``cuda:<local>`` on GPU jobs, ``cpu`` otherwise."""
    return _S.device


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group=None) -> int:
    return dist.get_rank(group) if initialized() else 0


def world_size(group=None) -> int:
    return dist.get_world_size(group) if initialized() else 1


def distributed(group=None) -> bool:
    """More than one rank in ``group`` (default: the world): collectives are worth issuing."""
    return initialized() and dist.get_world_size(group) > 1


def global_rank(group, group_rank: int) -> int:
    """The global rank of ``group``'s member ``group_rank``."""
    if not initialized() or is_world(group):
        return group_rank
    return dist.get_global_rank(group, group_rank)


def world_group():
    return dist.group.WORLD


def is_world(group) -> bool:
    return group is None or group is dist.group.WORLD


def new_group(ranks: Sequence[int]):
    """A sub-group with the job's timeout, created by every rank of the world in the same order, members or not.

    With ``device_id`` (eager NCCL init, comm.init on CUDA) torch makes every ``new_group`` a split of the world
    communicator (``ncclCommSplit``, a collective over every rank: pytorch/pytorch#129284), so a group created by
    some ranks only hangs the others; and a gloo group of partial membership after a split hangs as well
    (pytorch/pytorch#145376).  Hence: the default backend only (no ``backend=``: no gloo-only group), never
    ``use_local_synchronization`` or ``split_group``; every creation is logged here and ``check_groups_agree``
    compares the logs of every rank (tests/unit/test_comm.py keeps both rules)."""
    ranks = [int(r) for r in ranks]
    world = world_size() if initialized() else None
    if len(set(ranks)) != len(ranks) or any(r < 0 or (world is not None and r >= world) for r in ranks):
        raise ValueError(f"new_group({ranks}): ranks must be distinct ranks of the world"
                         + (f" 0..{world - 1}" if world else ""))
    _S.groups_made.append(tuple(ranks))
    return dist.new_group(ranks, timeout=_S.timeout)


def groups_made() -> List[tuple]:
    """The ranks of every group this process created with ``new_group``, in creation order."""
    return list(_S.groups_made)


def check_groups_agree() -> None:
    """Collective over the world: every rank created the same groups in the same order (``new_group``).  Raises
    naming the first rank and group that differ from rank 0's; on CPU (gloo, lazy) such a job often runs on,
    while on GPU with eager NCCL init it hangs in the first group some rank skipped."""
    if not distributed():
        return
    logs = all_gather_object(groups_made())
    for r, log in enumerate(logs):
        if log != logs[0]:
            i = next((k for k, (a, b) in enumerate(zip(log, logs[0])) if a != b), min(len(log), len(logs[0])))
            mine = list(log[i]) if i < len(log) else "nothing"
            theirs = list(logs[0][i]) if i < len(logs[0]) else "nothing"
            raise RuntimeError(f"rank {r} created process group #{i} over ranks {mine} where rank 0 created {theirs}"
                               f": every rank must create every group, in the same order, members or not (with "
                               f"eager NCCL init each new_group is a collective split of the world)")


def _on_device(t: torch.Tensor) -> torch.Tensor:
    return t if t.device == _S.device else t.to(_S.device)


def all_reduce(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """The reduction of ``t`` over ``group``, returned on ``t``'s device (``t`` itself is updated in place too)."""
    if not distributed(group):
        return t
    x = _on_device(t)
    dist.all_reduce(x, op=_OPS[op], group=group)
    if x is not t:
        t.copy_(x)
    return t


class _AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` over dim 0 with a gradient: the backward of an all-to-all is the same
    all-to-all of the output's gradient (chunk j went to rank j, so its gradient comes back from rank j)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _a2a(x, group)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g.contiguous(), ctx.group), None


def _a2a(x: torch.Tensor, group) -> torch.Tensor:
    y = _on_device(x.contiguous())
    out = torch.empty_like(y)
    dist.all_to_all_single(out, y, group=group)
    return out if out.device == x.device else out.to(x.device)


def all_to_all_single(x: torch.Tensor, group=None) -> torch.Tensor:
    """Rank r's chunk j of ``x`` (dim 0 split into ``world_size(group)`` equal chunks) becomes rank j's chunk r of
    the result; differentiable (torch.distributed.nn.functional.all_to_all_single has the same contract).  Runs
    on the collective device; the result lives where ``x`` lives."""
    if not distributed(group):
        return x
    n = world_size(group)
    if x.size(0) % n:
        raise ValueError(f"all_to_all_single: dim 0 ({x.size(0)}) must split into {n} equal chunks")
    return _AllToAll.apply(x, group)


class _AllToAllV(torch.autograd.Function):
    """Uneven all-to-all: ``send[j]`` rows of x go to rank j, ``recv[j]`` rows come from it; the gradient goes
    back the same way with the counts swapped (torch.distributed.nn.functional.all_to_all_single)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _a2av(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        return _a2av(g.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _a2av(x: torch.Tensor, send: List[int], recv: List[int], group) -> torch.Tensor:
    y = _on_device(x.contiguous())
    out = y.new_empty((sum(recv),) + tuple(y.shape[1:]))
    dist.all_to_all_single(out, y, output_split_sizes=recv, input_split_sizes=send, group=group)
    return out if out.device == x.device else out.to(x.device)


def all_to_all_v(x: torch.Tensor, send: Sequence[int], group=None):
    """Rows ``[sum(send[:j]), sum(send[:j+1]))`` of ``x`` go to rank j of ``group``; returns (the rows every rank
    sent here, in rank order; the row count from each rank).  One all-to-all of the counts, one of the rows;
    differentiable in ``x`` (expert-parallel token dispatch, rlhf.distributed.expert_parallel)."""
    if not distributed(group):
        return x, list(send)
    counts = torch.tensor(list(send), dtype=torch.long)
    recv = [int(c) for c in _a2a(counts, group).tolist()]
    return _AllToAllV.apply(x, [int(c) for c in send], recv, group), recv


class _SumOver(torch.autograd.Function):
    """y = sum_r x_r over the group; dL/dx_r = sum_s dL_s/dy (every rank's loss sees y), one all-reduce each way
    (torch.distributed.nn.functional.all_reduce's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x.clone(), "sum", group)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.clone(), "sum", ctx.group), None


def sum_over(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of every rank's ``x`` over ``group``, differentiable (out of place; ``x`` is left as it is)."""
    if not distributed(group):
        return x
    return _SumOver.apply(x, group)


def all_gather_tensor(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``x`` (same shape everywhere) concatenated along dim 0 in rank order; no gradient."""
    if not distributed(group):
        return x
    y = _on_device(x.contiguous())
    out = torch.empty((world_size(group) * y.size(0),) + tuple(y.shape[1:]), dtype=y.dtype, device=y.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name in torch 2.13
    gather(out, y, group=group)
    return out if out.device == x.device else out.to(x.device)


def broadcast(t: torch.Tensor, src: int, group=None, timeout_s: Optional[float] = None) -> torch.Tensor:
    """``t`` from global rank ``src`` to every rank of ``group`` (in place, on ``t``'s device).  With
    ``timeout_s`` the wait is bounded: a rank of the group that never joins raises ``TimeoutError``."""
    if not distributed(group):
        return t
    x = _on_device(t)
    work = dist.broadcast(x, src=src, group=group, async_op=timeout_s is not None)
    if timeout_s is not None:
        wait(work, timeout_s, f"broadcast from rank {src}")
    if x is not t:
        t.copy_(x)
    return t


def exchange(sends: Sequence[tuple], recvs: Sequence[tuple], timeout_s: float = 600) -> None:
    """Point-to-point: every ``(tensor, dst)`` sent and every ``(tensor, src)`` received (global ranks, in place),
    posted at once (``batch_isend_irecv``) and waited for, each wait at most ``timeout_s``.  Between one pair of
    ranks the messages of one call pair up in posting order."""
    ops = [dist.P2POp(dist.isend, _on_device(t), dst) for t, dst in sends]
    ops += [dist.P2POp(dist.irecv, t, src) for t, src in recvs]
    for work in dist.batch_isend_irecv(ops) if ops else ():
        wait(work, timeout_s, f"point-to-point exchange ({len(sends)} sends, {len(recvs)} receives)")


def wait(work, timeout_s: float, what: str) -> None:
    """Wait for an async collective at most ``timeout_s``; ``TimeoutError`` naming ``what`` past it (gloo raises
    on timeout, NCCL's ``wait`` returns False)."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TimeoutError(f"{what} not finished after {timeout_s}s: {e}") from None
    if ok is False:
        raise TimeoutError(f"{what} not finished after {timeout_s}s")


def broadcast_object(obj: Any, src: int, group=None) -> Any:
    """A picklable object from global rank ``src`` to every rank of ``group``."""
    if not distributed(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=_S.device)
    return box[0]


def all_gather_object(obj: Any, group=None) -> List[Any]:
    """Every rank's ``obj`` (pickled), in rank order."""
    if not distributed(group):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group=None) -> None:
    if distributed(group):
        dist.barrier(group=group, **({"device_ids": [_S.device.index]} if _S.device.type == "cuda"
                                     and "nccl" in _S.backend else {}))


def destroy() -> None:
    if initialized():
        dist.destroy_process_group()
