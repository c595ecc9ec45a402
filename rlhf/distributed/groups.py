"""Process groups for a Placement.  Every rank creates every group in the same order (SPMD)."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .placement import ROLES, Placement


def default_backend() -> str:
    """nccl when CUDA is usable, else gloo."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(timeout_s: int = 1800) -> tuple:
    """Init the default group from torchrun's env, or a 1-rank group (in-memory store) when run as plain python.

    Returns (rank, world_size, local_rank, device).  Writes no environment variables.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def nnodes_from_env() -> int:
    """Nodes in the job, from torchrun / SLURM env (1 if unknown)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if "SLURM_NNODES" in os.environ:
        return int(os.environ["SLURM_NNODES"])
    return max(1, world // max(local, 1))


@dataclass
class Groups:
    """This rank's process groups: one per role it holds, its rollout engine's TP group, the weight-sync group."""
    plan: Placement
    rank: int
    role_groups: Dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)  # None where not a member
    tp_group: Optional[dist.ProcessGroup] = None    # this rank's rollout engine's TP ranks
    sync: Optional[dist.ProcessGroup] = None        # actor rank 0 + rollout ranks (separate rollout only)

    def group(self, role: str) -> Optional[dist.ProcessGroup]:
        return self.role_groups.get(role)


def build_groups(plan: Placement, rank: int) -> Groups:
    """new_group for each role, each engine and the sync group, called identically on all ranks."""
    g = Groups(plan, rank)
    world = list(range(plan.world_size))
    cache: Dict[tuple, dist.ProcessGroup] = {}

    def make(ranks: List[int]):
        key = tuple(ranks)
        if key not in cache:
            cache[key] = dist.group.WORLD if list(ranks) == world else dist.new_group(list(ranks))
        return cache[key]

    for role in ROLES:
        ranks = plan.ranks.get(role) or []
        grp = make(ranks) if ranks else None
        g.role_groups[role] = grp if rank in ranks else None
    for e in plan.engine_ranks:
        grp = make(e)
        if rank in e:
            g.tp_group = grp
    if plan.sync_ranks:
        grp = make(plan.sync_ranks)
        if rank in plan.sync_ranks:
            g.sync = grp
    return g
