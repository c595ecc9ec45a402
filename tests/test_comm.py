"""rlhf.distributed.comm: the one caller of torch.distributed collectives, and the rules it enforces."""
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "barrier",
               "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter",
               "reduce", "new_group", "init_process_group", "destroy_process_group")
# vLLM's worker process is a process world of its own (its weight-receive group is not the trainer's)
ALLOWED = {"rlhf/distributed/comm.py", "rlhf/rollout/vllm_worker.py"}


def _callers():
    names = "|".join(COLLECTIVES)
    pat = re.compile(rf"\b(?:dist|torch\.distributed|c10d)\.({names})\s*\(")
    bad = []
    for top in ("rlhf", "launch"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)
                if rel in ALLOWED:
                    continue
                with open(path) as fh:
                    for i, line in enumerate(fh, 1):
                        if pat.search(line):
                            bad.append(f"{rel}:{i}: {line.strip()}")
    return bad


def test_only_comm_calls_collectives():
    """Every collective goes through comm (which puts its tensor on the collective device): a direct call anywhere
    else is how a CPU tensor reaches NCCL."""
    bad = _callers()
    assert not bad, "direct torch.distributed collectives outside rlhf/distributed/comm.py:\n" + "\n".join(bad)


def test_backend_string(monkeypatch):
    from rlhf.distributed import comm

    monkeypatch.delenv(comm.BACKEND_ENV, raising=False)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    # CUDA: NCCL for CUDA tensors and gloo for a stray CPU tensor (torchtitan's init_distributed does the same)
    assert comm.backend_string(cuda=True) == "cuda:nccl,cpu:gloo"
    assert comm.backend_string(cuda=False) == "gloo"
    monkeypatch.setenv(comm.BACKEND_ENV, "cuda:gloo")  # the GPU check's 2 ranks on one GPU
    assert comm.backend_string(cuda=True) == "cuda:gloo" and comm.uses_cuda("cuda:gloo")
    assert not comm.uses_cuda("gloo")


def test_collectives_hand_the_backend_the_collective_device(monkeypatch):
    """all_reduce / broadcast give torch.distributed a tensor on comm.device(), whatever device the caller's tensor
    is on, and the result lands in the caller's tensor.  The meta device stands in for the GPU here; the fakes
    record what the backend was handed."""
    from rlhf.distributed import comm

    handed = []

    def fake_all_reduce(x, op=None, group=None):
        handed.append(x.device.type)

    def fake_broadcast(x, src, group=None, async_op=False):
        handed.append(x.device.type)

    monkeypatch.setattr(comm, "distributed", lambda group=None: True)
    monkeypatch.setattr(comm.dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(comm.dist, "broadcast", fake_broadcast)
    monkeypatch.setattr(comm._S, "device", torch.device("meta"))
    copies = []
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: copies.append(
        (self.device.type, src.device.type)) or self)
    t = torch.ones(3)
    assert comm.all_reduce(t, op="max") is t
    comm.broadcast(torch.zeros(2), src=0)
    assert handed == ["meta", "meta"], handed
    assert copies == [("cpu", "meta"), ("cpu", "meta")], copies
    with pytest.raises(KeyError):
        comm.all_reduce(t, op="product")


def test_new_groups_get_the_job_timeout(monkeypatch):
    import datetime

    from rlhf.distributed import comm

    got = {}
    monkeypatch.setattr(comm.dist, "new_group", lambda ranks, timeout=None: got.update(ranks=ranks, timeout=timeout))
    monkeypatch.setattr(comm._S, "timeout", datetime.timedelta(seconds=77))
    comm.new_group((0, 2))
    assert got == {"ranks": [0, 2], "timeout": datetime.timedelta(seconds=77)}
