"""Job environment shared by every launcher: master address/port, NCCL + InfiniBand defaults, torchrun command."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from typing import Dict, List, Optional, Sequence

# One value in every process of the job, set before any NCCL communicator exists: the trainer ranks (comm.init
# calls apply_process_env before init_process_group) and every process they start (vLLM's workers inherit it).
# NCCL_CUMEM_ENABLE: vLLM forces 0 in each process that imports it (vllm/env_override.py: cuMem costs 1-2 GiB with
# CUDA graphs + all-reduce, NVIDIA/nccl#1234; newer vLLM keeps a value already set); a communicator between a
# process that started NCCL before importing vLLM (cuMem on, NCCL's default) and vLLM's workers (off) may hang.
# veRL sets 0 for every process of the job for this reason (verl/trainer/constants_ppo.py PPO_RAY_RUNTIME_ENV,
# "to prevent hanging or crash during synchronization of weights between actor and rollout").  Multi-node NVLink
# (GB200 NVL72) needs 1: export NCCL_CUMEM_ENABLE=1 there; as everywhere here, the user's export wins.
PROCESS_ENV = {"NCCL_CUMEM_ENABLE": "0"}

# Why each default (the user's own export wins over every one of them; see job_env / shell_exports):
NCCL_DEFAULTS = {
    **PROCESS_ENV,
    # InfiniBand between nodes: NCCL docs, "Environment Variables" (NCCL_IB_*, NCCL_SOCKET_IFNAME, NCCL_CROSS_NIC).
    "NCCL_IB_DISABLE": "0",              # use InfiniBand (NCCL falls back to TCP sockets when set to 1)
    "NCCL_IB_HCA": "mlx5",               # all mlx5 HCAs; narrow with e.g. mlx5_0,mlx5_1
    "NCCL_SOCKET_IFNAME": "^lo,docker",  # bootstrap over any non-loopback, non-container interface
    "NCCL_IB_TIMEOUT": "22",             # IB verbs timeout 4.096us * 2^22 ~ 17 s: rides out a switch hiccup
    "NCCL_IB_RETRY_CNT": "10",           # retries before a transient IB error becomes a failed collective
    "NCCL_CROSS_NIC": "1",               # rings may cross NICs: rail-optimised and non-rail fabrics both work
    # NVLink SHARP (NVLS, in-switch reductions on NVSwitch systems, Hopper+) is on by default where supported; it
    # reserves extra device memory per communicator and its buffers are not released by vLLM's / our sleep, which
    # hurts colocated rollout + training; NCCL docs: "NCCL_NVLS_ENABLE ... Enable the use of NVLink SHARP".  Off.
    "NCCL_NVLS_ENABLE": "0",
    # PyTorch's NCCL watchdog (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp): 3 = SkipCleanUp, tear the process
    # down on a collective error/timeout without aborting the communicators first -- the mode the flight recorder
    # needs to finish its dump (1 = TearDown aborts the work it would record; torchtitan's
    # torchtitan/distributed/utils.py init_distributed sets 3 for this reason, pytorch/pytorch#121055).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_BLOCKING_WAIT": "0",     # wait() does not block the CPU; the watchdog thread enforces timeouts
    # Flight recorder: a ring buffer of the last collectives of every group, dumped per rank when a collective times
    # out (TORCH_NCCL_DUMP_ON_TIMEOUT=1, ProcessGroupNCCL.hpp) -- and by our own watchdog (watchdog.py) when a phase
    # deadline ends a stuck job first.  Read the dumps with `python -m torch.distributed.flight_recorder.fr_trace`.
    # Buffer size: TORCH_FR_BUFFER_SIZE (torch >= 2.9, FlightRecorder.hpp), TORCH_NCCL_TRACE_BUFFER_SIZE before it
    # (still read as an alias); 2000 entries is torch's own default, set so it does not depend on the version.
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    # Where the dumps go: <prefix><rank>, under the job's output (torch's default /tmp is node-local and lost with
    # the node); the new name and the pre-2.9 one.  slurm/common.sh creates the folder.
    "TORCH_FR_DUMP_TEMP_FILE": "output/flight_recorder/rank_",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "output/flight_recorder/rank_",
    "OMP_NUM_THREADS": "8",              # torch's default is every core per rank: 8 ranks x 64 threads thrash
    "TOKENIZERS_PARALLELISM": "false",   # the Rust tokenizer's threads deadlock after fork (data workers)
}


def apply_process_env(environ=None) -> Dict[str, str]:
    """Set, in this process, what every process of the job must agree on (PROCESS_ENV), and on a multi-node job
    ``GLOO_SOCKET_IFNAME`` beside ``NCCL_SOCKET_IFNAME``; values already set win.  Returns what it set.

    Every group carries gloo (comm.init: ``cuda:nccl,cpu:gloo``), and gloo binds to the address its host name
    resolves to unless ``GLOO_SOCKET_IFNAME`` names interfaces (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp);
    on clusters that is often a loopback or management address the other nodes cannot reach.  Gloo takes only
    interface names (not NCCL's ``^lo,docker`` exclusions), so: NCCL's list when it is one, else the interface
    that routes to MASTER_ADDR."""
    environ = os.environ if environ is None else environ
    done = {}
    for k, v in PROCESS_ENV.items():
        if k not in environ:
            environ[k] = done[k] = v
    if "GLOO_SOCKET_IFNAME" not in environ and multi_node(environ):
        ifname = gloo_ifname(environ.get("NCCL_SOCKET_IFNAME", ""), environ.get("MASTER_ADDR", ""))
        if ifname:
            environ["GLOO_SOCKET_IFNAME"] = done["GLOO_SOCKET_IFNAME"] = ifname
    return done


def multi_node(environ) -> bool:
    world = int(environ.get("WORLD_SIZE", "1"))
    return world > int(environ.get("LOCAL_WORLD_SIZE", world)) or int(environ.get("SLURM_NNODES", "1")) > 1


def gloo_ifname(nccl_ifname: str, master_addr: str) -> Optional[str]:
    """Interfaces for gloo: NCCL_SOCKET_IFNAME when it lists names (its ``=`` exact-match prefix dropped; NCCL
    matches the others as prefixes, gloo needs the full name), else, for a ``^`` exclusion list or nothing, the
    interface whose address routes to ``master_addr``; None when neither is known."""
    if nccl_ifname.startswith("="):
        return nccl_ifname[1:] or None
    if nccl_ifname and not nccl_ifname.startswith("^"):
        return ",".join(expand_prefixes(nccl_ifname.split(","))) or None
    return route_ifname(master_addr) if master_addr else None


def expand_prefixes(names: List[str], present: Optional[List[str]] = None) -> List[str]:
    """NCCL reads ``eth`` as every interface starting with it; gloo wants names: each entry that is not an interface
    of this node becomes the interfaces it prefixes (left as given where none does)."""
    import socket

    present = present if present is not None else [n for _, n in socket.if_nameindex()]
    out: List[str] = []
    for name in names:
        match = [name] if name in present else [p for p in present if p.startswith(name)] or [name]
        out += [m for m in match if m not in out]
    return out


def route_ifname(host: str) -> Optional[str]:
    """The local interface the kernel routes ``host`` through (a UDP connect sends nothing), or None."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    return ifname_of(local)


def ifname_of(address: str) -> Optional[str]:
    """The interface holding IPv4 ``address`` (SIOCGIFADDR per interface; Linux), or None."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def expand_nodelist(nodelist: str) -> List[str]:
    """'gpu[01-03,07],login1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1'] (scontrol's expansion, in Python)."""
    out: List[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.match(r"^(.*)\[(.*)\]$", part)
        if not m:
            out.append(part)
            continue
        prefix, ranges = m.groups()
        for r in ranges.split(","):
            if "-" in r:
                a, b = r.split("-")
                out += [f"{prefix}{i:0{len(a)}d}" for i in range(int(a), int(b) + 1)]
            else:
                out.append(prefix + r)
    return out


def hostnames(nodelist: Optional[str] = None) -> List[str]:
    nodelist = nodelist or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not nodelist:
        return ["127.0.0.1"]
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return expand_nodelist(nodelist)


def master_port(job_id: Optional[str] = None) -> int:
    """A port derived from the job id, so every node computes the same one without talking."""
    job_id = job_id or os.environ.get("SLURM_JOB_ID", "0")
    return 20000 + int(re.sub(r"\D", "", str(job_id)) or 0) % 20000


def job_env(base: Optional[Dict[str, str]] = None, overrides: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """NCCL/IB defaults under whatever the user already exported (theirs win), plus explicit overrides."""
    env = dict(NCCL_DEFAULTS)
    env.update(base if base is not None else os.environ)
    env.update(overrides or {})
    return env


def torchrun_cmd(module: str, args: Sequence[str], nnodes: int, nproc_per_node: int, master_addr: str, port: int,
                 node_rank: Optional[int] = None, python: str = "python") -> List[str]:
    cmd = [python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}"]
    if nnodes == 1 and master_addr in ("127.0.0.1", "localhost"):
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv_backend=c10d", f"--rdzv_endpoint={master_addr}:{port}", f"--rdzv_id={port}"]
        if node_rank is not None:
            cmd.append(f"--node_rank={node_rank}")
    return cmd + ["-m", module, *args]


def with_resume(args: Sequence[str]) -> List[str]:
    """Add --load_checkpoint (restarts after preemption resume from the newest checkpoint) and
    --start_fresh_if_no_checkpoint (the first start has none yet)."""
    args = list(args)
    for flag in ("--load_checkpoint", "--start_fresh_if_no_checkpoint"):
        if flag not in args:
            args.append(flag)
    return args


def shell_join(cmd: Sequence[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def shell_exports(defaults: Optional[Dict[str, str]] = None) -> str:
    """``export K="${K:-V}"`` lines for the defaults: sourced by slurm/common.sh, so the sbatch scripts and the
    Python launchers share one table (whatever the user exported wins in both)."""
    return "\n".join(f'export {k}="${{{k}:-{v}}}"' for k, v in (defaults or NCCL_DEFAULTS).items())


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--exports"]:
        print(shell_exports())
    else:
        sys.exit("usage: python -m launch.env --exports")
