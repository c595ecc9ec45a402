"""Job environment shared by every launcher: master address/port, NCCL + InfiniBand defaults, torchrun command."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from typing import Dict, List, Optional, Sequence

NCCL_DEFAULTS = {
    "NCCL_IB_DISABLE": "0",              # use InfiniBand
    "NCCL_IB_HCA": "mlx5",               # all mlx5 HCAs; narrow with e.g. mlx5_0,mlx5_1
    "NCCL_SOCKET_IFNAME": "^lo,docker",  # bootstrap over any non-loopback interface
    "NCCL_IB_TIMEOUT": "22",
    "NCCL_IB_RETRY_CNT": "10",
    "NCCL_CROSS_NIC": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    "NCCL_NVLS_ENABLE": "0",
    "OMP_NUM_THREADS": "8",
    "TOKENIZERS_PARALLELISM": "false",
}


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
