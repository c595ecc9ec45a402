"""rlhf.distributed.comm: the one caller of torch.distributed collectives, and the rules it enforces."""
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "barrier",
               "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter",
               "reduce", "new_group", "init_process_group", "destroy_process_group")
# the weight-transfer group is a process world of its own (vLLM's workers + the sending rank, not the trainer's)
ALLOWED = {"rlhf/distributed/comm.py", "rlhf/distributed/transport.py"}


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


def test_every_process_starts_nccl_with_one_cumem_value(monkeypatch):
    """NCCL_CUMEM_ENABLE has one value in every process before its first communicator: vLLM sets 0 in each process
    that imports it (vllm/env_override.py; NVIDIA/nccl#1234), so a rank that started NCCL before importing vLLM
    would run with NCCL's default (on) beside vLLM's workers (off), and a communicator between them may hang.  veRL
    exports 0 for every process (verl/trainer/constants_ppo.py).  comm.init sets it before init_process_group; the
    processes a rank starts inherit it; a value the user exported wins (newer vLLM keeps it too)."""
    import subprocess
    import sys

    from launch.env import NCCL_DEFAULTS, PROCESS_ENV, shell_exports
    from rlhf.distributed import comm

    seen = {}

    def fake_init(backend, timeout=None, **kw):
        seen["at_init"] = os.environ.get("NCCL_CUMEM_ENABLE")

    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    monkeypatch.delenv(comm.BACKEND_ENV, raising=False)
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(comm.dist, "init_process_group", fake_init)
    monkeypatch.setattr(comm.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(comm.dist, "get_world_size", lambda group=None: 1)
    comm.init(60)
    assert seen["at_init"] == "0", f"init_process_group ran with NCCL_CUMEM_ENABLE={seen['at_init']!r}, vLLM uses 0"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('NCCL_CUMEM_ENABLE'))"],
                           capture_output=True, text=True, timeout=30)
    assert child.stdout.strip() == "0", "a process the rank starts (vLLM's workers) must inherit the value"
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # multi-node NVLink: the user's export wins
    comm.init(60)
    assert seen["at_init"] == "1"
    # the launchers' table (slurm/common.sh evals shell_exports) carries the same value
    assert NCCL_DEFAULTS["NCCL_CUMEM_ENABLE"] == PROCESS_ENV["NCCL_CUMEM_ENABLE"] == "0"
    assert 'export NCCL_CUMEM_ENABLE="${NCCL_CUMEM_ENABLE:-0}"' in shell_exports()


def test_gloo_socket_ifname_beside_nccl_on_several_nodes():
    """Every group carries gloo (cuda:nccl,cpu:gloo), which binds to its host name's address unless
    GLOO_SOCKET_IFNAME names interfaces (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp); gloo takes names only,
    not NCCL's ^exclusions: NCCL's list when it is one, else the interface that routes to MASTER_ADDR."""
    from launch.env import apply_process_env, expand_prefixes

    two_nodes = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1"}
    env = dict(two_nodes, NCCL_SOCKET_IFNAME="ib0,eth1")
    apply_process_env(env)
    assert env["GLOO_SOCKET_IFNAME"] == "ib0,eth1" and env["NCCL_CUMEM_ENABLE"] == "0", env
    assert expand_prefixes(["ib", "eth1"], ["lo", "ib0", "ib1", "eth0", "eth1"]) == ["ib0", "ib1", "eth1"]
    env = dict(two_nodes, NCCL_SOCKET_IFNAME="=ib0")  # NCCL's exact-match prefix: gloo takes the bare name
    apply_process_env(env)
    assert env["GLOO_SOCKET_IFNAME"] == "ib0", env
    env = dict(two_nodes, NCCL_SOCKET_IFNAME="^lo,docker")
    apply_process_env(env)
    assert env["GLOO_SOCKET_IFNAME"] == "lo", env  # the route to 127.0.0.1 (on a cluster: the node's fabric NIC)
    env = dict(two_nodes, NCCL_SOCKET_IFNAME="^lo,docker", GLOO_SOCKET_IFNAME="eth7")
    assert "GLOO_SOCKET_IFNAME" not in apply_process_env(env) and env["GLOO_SOCKET_IFNAME"] == "eth7"
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "NCCL_SOCKET_IFNAME": "ib0"}
    apply_process_env(env)
    assert "GLOO_SOCKET_IFNAME" not in env, "one node: gloo's default (loopback reachable) is right"


def _groups_created(plan, world, monkeypatch, build):
    """The ranks of every new_group each rank of ``world`` creates in ``build(plan, rank)``, without processes."""
    from rlhf.distributed import comm

    made = {}
    for rank in range(world):
        log = made.setdefault(rank, [])
        monkeypatch.setattr(comm, "new_group", lambda ranks, log=log: log.append(list(ranks)) or tuple(ranks))
        monkeypatch.setattr(comm, "world_group", lambda: "WORLD")
        monkeypatch.setattr(comm, "check_groups_agree", lambda: None)
        build(plan, rank)
    return made


def test_every_rank_creates_every_group_in_one_order(monkeypatch):
    """With device_id (eager NCCL init) each new_group is a split of the world communicator, a collective of every
    rank (pytorch/pytorch#129284): a group created by its members only hangs the job on GPU (on CPU gloo it passes).
    Every placement's groups are created by every rank, members or not, in the same order."""
    from rlhf.config import TopologyConfig
    from rlhf.distributed import build_groups, make_placement
    from rlhf.distributed.groups import supervised_mesh

    def topo(**kw):
        t = TopologyConfig()
        for k, v in kw.items():
            setattr(t, k, v)
        return t

    cases = [(topo(actor_num_gpus_per_node=2, ref_num_gpus_per_node=1, vllm_num_engines=1), 4, {}),
             (topo(colocate_all_models=True, vllm_num_engines=2, vllm_tensor_parallel_size=2), 4, {}),
             (topo(actor_num_gpus_per_node=2, critic_num_gpus_per_node=2, reward_num_gpus_per_node=1,
                   ref_num_gpus_per_node=1, vllm_num_engines=2), 8, {"need_critic": True,
                                                                     "need_reward_model": True})]
    for t, world, need in cases:
        plan = make_placement(t, world, **need)
        made = _groups_created(plan, world, monkeypatch, build_groups)
        assert made[0], f"no sub-group in {plan.ranks}: the case tests nothing"
        assert all(made[r] == made[0] for r in made), f"ranks create different groups: {made}"
    made = _groups_created(None, 4, monkeypatch, lambda plan, rank: supervised_mesh(4, 4, 2, rank))
    assert made[0] == [[0, 1], [2, 3]] and all(made[r] == made[0] for r in made), made


def test_check_groups_agree_names_the_rank_that_differs(monkeypatch):
    """The creation logs of every rank are compared once after the groups are built; a rank that skipped a group
    is named, with the group, before any collective on it hangs."""
    from rlhf.distributed import comm

    monkeypatch.setattr(comm, "distributed", lambda group=None: True)
    monkeypatch.setattr(comm, "all_gather_object", lambda obj, group=None: [[(0, 1), (2, 3)], [(0, 1), (2, 3)],
                                                                          [(2, 3)], [(0, 1), (2, 3)]])
    with pytest.raises(RuntimeError, match=r"rank 2 created process group #0 over ranks \[2, 3\] where rank 0 "
                                           r"created \[0, 1\]"):
        comm.check_groups_agree()
    monkeypatch.setattr(comm, "all_gather_object", lambda obj, group=None: [[(0, 1)]] * 4)
    comm.check_groups_agree()


def test_no_partial_membership_or_split_groups():
    """No gloo-only group (new_group(backend=...)), no use_local_synchronization, no split_group anywhere in the
    package: after a split, a partial-membership gloo group hangs (pytorch/pytorch#145376)."""
    pat = re.compile(r"split_group\s*\(|use_local_synchronization\s*=|new_group\([^)]*backend\s*=")
    bad = []
    for top in ("rlhf", "launch"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(d, f)) as fh:
                        bad += [f"{f}:{i}: {ln.strip()}" for i, ln in enumerate(fh, 1) if pat.search(ln)]
    assert not bad, "\n".join(bad)
