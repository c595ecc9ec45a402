"""Process groups for a Placement.  Every rank creates every group in the same order (SPMD)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from . import comm
from .placement import ROLES, Placement
from .sequence_parallel import SP


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
    role_groups: Dict[str, Optional[Any]] = field(default_factory=dict)  # None where not a member
    tp_group: Optional[Any] = None    # this rank's rollout engine's TP ranks
    sync: Optional[Any] = None        # actor rank 0 + rollout ranks (separate rollout only)
    sp: Dict[str, SP] = field(default_factory=dict)  # role -> this rank's sequence-parallel group (--ring_attn_size)
    # the ranks holding a model role (actor, ref, critic, reward), where rollout ranks of their own exist: the
    # inference forwards gather over them under --async_train, so the rollout ranks generate meanwhile
    trainers: Optional[Any] = None
    rollout_only: bool = False        # this rank holds the rollout role and no model role
    # rollout ranks of their own + the reward model's ranks (where both exist): under --async_train the reward
    # model scores each batch over them as soon as the engines produced it (rlhf.trainers.async_rollout)
    rollout_reward: Optional[Any] = None
    rollout_reward_ranks: List[int] = field(default_factory=list)

    def group(self, role: str):
        return self.role_groups.get(role)

    def sp_of(self, role: str) -> SP:
        """This rank's SP group for ``role`` (size 1 where the role splits no sequence)."""
        return self.sp.get(role) or SP()


def build_groups(plan: Placement, rank: int) -> Groups:
    """new_group for each role, each engine and the sync group, called identically on all ranks."""
    g = Groups(plan, rank)
    world = list(range(plan.world_size))
    cache: Dict[tuple, Any] = {}

    def make(ranks: List[int]):
        key = tuple(ranks)
        if key not in cache:
            cache[key] = comm.world_group() if list(ranks) == world else comm.new_group(ranks)
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
    trainers = sorted({r for role in ROLES if role != "rollout" for r in (plan.ranks.get(role) or [])})
    if trainers and trainers != world:
        grp = make(trainers)
        g.trainers = grp if rank in trainers else None
        g.rollout_only = rank not in trainers
    if plan.separate_rollout and plan.ranks.get("reward"):
        g.rollout_reward_ranks = sorted(set(plan.ranks["rollout"]) | set(plan.ranks["reward"]))
        grp = make(g.rollout_reward_ranks)
        g.rollout_reward = grp if rank in g.rollout_reward_ranks else None
    for role, sp_groups in plan.sp_groups.items():  # one SP object per role (each wraps its model's attention)
        for ranks in sp_groups:
            grp = make(ranks)
            if rank in ranks:
                g.sp[role] = SP(len(ranks), ranks.index(rank), grp)
    comm.check_groups_agree()
    return g


def build_sp(ranks: List[int], sp_size: int, gpus_per_node: int, rank: int, what: str = "world") -> SP:
    """The SP group of ``rank`` among ``ranks`` split into consecutive groups of ``sp_size`` (the supervised
    trainers: every rank holds the one model); new_group for every SP group, on every rank, in order."""
    from .placement import sp_groups_for

    out = SP()
    if sp_size <= 1:
        return out
    for grp_ranks in sp_groups_for(list(ranks), sp_size, gpus_per_node, what):
        grp = comm.new_group(grp_ranks)
        if rank in grp_ranks:
            out = SP(sp_size, grp_ranks.index(rank), grp)
    comm.check_groups_agree()
    return out
