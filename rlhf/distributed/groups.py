"""Process groups for a Placement.  Every rank creates every group in the same order (SPMD)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from rlhf.distributed import comm
from rlhf.distributed.expert_parallel import build_ep_groups, ep_of
from rlhf.distributed.mesh import RoleMesh
from rlhf.distributed.placement import Placement
from rlhf.distributed.role_table import role_names
from rlhf.distributed.sequence_parallel import SP
from rlhf.distributed.tensor_parallel import build_dim_groups


def nnodes_from_env() -> int:
    """Nodes in the job, from torchrun / SLURM env (1 if unknown)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if "SLURM_NNODES" in os.environ:
        return int(os.environ["SLURM_NNODES"])
    return max(1, world // max(local, 1))


@dataclass
class RankGroup:
    """A named group across roles (``Placement.named_ranks``): its ``ranks`` and process ``group`` (None on the
    ranks outside it)."""
    ranks: List[int]
    group: Optional[Any] = None


@dataclass
class Groups:
    """This rank's view of every process group of the placement: one mesh per role that exists
    (``rlhf.distributed.mesh.RoleMesh``, on every rank) and the named groups across roles (``sync``, ``trainers``,
    ``rollout_reward``; ``Placement.named_ranks``)."""
    plan: Placement
    rank: int
    meshes: Dict[str, RoleMesh] = field(default_factory=dict)
    named: Dict[str, RankGroup] = field(default_factory=dict)

    def mesh(self, role: str) -> Optional[RoleMesh]:
        """``role``'s mesh (None: the placement has no such role)."""
        return self.meshes.get(role)

    def group(self, name: str):
        """The process group of a role or of a named group on its ranks; None elsewhere, or where it does not
        exist."""
        if name in self.meshes:
            return self.meshes[name].group
        return self.named[name].group if name in self.named else None

    def ranks(self, name: str) -> List[int]:
        """The ranks of a role or of a named group (empty where it does not exist)."""
        if name in self.meshes:
            return list(self.meshes[name].ranks)
        return list(self.named[name].ranks) if name in self.named else []

    @property
    def rollout_only(self) -> bool:
        """This rank holds the rollout role and no model role (only where the model roles' ranks are not the
        world: ``trainers``)."""
        return "trainers" in self.named and self.rank not in self.named["trainers"].ranks


def build_groups(plan: Placement, rank: int) -> Groups:
    """Every process group of the placement, created identically on every rank in one order (group creation is
    collective, ``comm.new_group``): each role's group, each engine's TP group, the named groups (``sync``,
    ``trainers``, ``rollout_reward``), each role's SP groups.  A group over the same ranks is created once."""
    g = Groups(plan, rank)
    world = list(range(plan.world_size))
    cache: Dict[tuple, Any] = {}

    def make(ranks: List[int]):
        key = tuple(ranks)
        if key not in cache:
            cache[key] = comm.world_group() if list(ranks) == world else comm.new_group(ranks)
        return cache[key]

    for role in role_names():
        ranks = plan.ranks.get(role) or []
        if ranks:
            grp = make(ranks)
            g.meshes[role] = RoleMesh(role, ranks, rank, plan.dims(role), group=grp if rank in ranks else None,
                                      shard_size=plan.fsdp_shard_size, ep_size=ep_of(plan, role))
            build_dim_groups(g.meshes[role], make)  # --tp_size / --fsdp_shard_size: the DeviceMesh's groups
            build_ep_groups(g.meshes[role], make)  # --ep_size: the ep and dp_mod_ep groups
    rollout = g.meshes.get("rollout")
    for e in (rollout.ranks_along("tp") if rollout is not None else []):  # each engine's TP ranks
        grp = make(e)
        if rank in e:
            rollout.dim_groups["tp"] = grp
    for name, ranks in plan.named_ranks().items():
        grp = make(ranks)
        g.named[name] = RankGroup(ranks, grp if rank in ranks else None)
    for role in plan.sp_groups:  # one SP object per role (each wraps its model's attention)
        mesh = g.meshes[role]
        for ranks in mesh.ranks_along("sp"):
            grp = make(ranks)
            if rank in ranks:
                mesh.dim_groups["sp"] = grp
                mesh.sp = SP(len(ranks), ranks.index(rank), grp)
    comm.check_groups_agree()
    return g


def supervised_mesh(world_size: int, gpus_per_node: int, sp: int, rank: int) -> RoleMesh:
    """The mesh of a supervised job's one model (every rank; ``dp x sp``), built by ``build_groups`` over
    ``placement.supervised_placement``: the same groups on every rank, in order."""
    from rlhf.distributed.placement import supervised_placement

    return build_groups(supervised_placement(world_size, gpus_per_node, sp), rank).mesh("actor")
