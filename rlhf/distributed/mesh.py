"""A role's ranks as a mesh of named dimensions: who computes and who reports which rows, and its process groups.

A role of ``R`` ranks is laid out row-major over its dimensions, outer to inner (``Placement.dims``): member
``i`` has coordinates ``c`` with ``i = sum_d c[d] * stride[d]``, ``stride[d]`` the product of the sizes inside
``d``.  Model roles are ``dp x sp`` (``--ring_attn_size``: consecutive ranks split one sequence); the rollout role
is ``dp x tp`` (each engine's consecutive TP ranks); a training role's ``tp`` goes inside ``dp`` next.

Row ownership is one rule for every dimension but ``dp``: a batch of ``n`` rows is split over the ``dp``
coordinates (``shard_rows``: contiguous, near-equal); every member with the same ``dp`` coordinate computes the
same rows, and of those the member whose other coordinates are all 0 reports them (``owned_rows``), so each row
has exactly one owner.

Mirrors torchtitan's ``ParallelDims`` (torchtitan/distributed/parallel_dims.py: named sizes whose product is the
ranks, the data-parallel coordinates, the context-parallel dimension flattened into FSDP's ``dp_shard_cp``, which
torchtitan/models/llama3/parallelize.py shards over; FSDP2 here likewise shards over the whole role, ``dp x sp``),
with plain process groups behind this small class instead of a ``DeviceMesh``: a role is a sub-range of the world
and the roles' ranks overlap when colocated (one world-wide ``init_device_mesh`` per role does not fit), group
creation must stay one logged sequence on every rank (``comm.new_group``, ``comm.check_groups_agree``), and
DeepSpeed sets up its own world-wide groups.  ``DeviceMesh.from_group(mesh.group)`` wraps the role's group where
FSDP2 wants one (rlhf.engines.fsdp2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from rlhf.distributed.sequence_parallel import SP
from rlhf.distributed.sharding import shard_rows


@dataclass
class RoleMesh:
    """Role ``name``'s ``ranks`` (global) over the named ``dims`` (outer to inner); ``rank`` is this process's
    global rank (a member or not: every rank holds every role's mesh).  ``group``: the whole role's process group
    (on members; None elsewhere); ``dim_groups``: this member's group along each dimension that has one built
    (``sp``: the SP group, ``tp``: the engine's TP group); ``sp``: this member's sequence-parallel group."""
    name: str
    ranks: List[int]
    rank: int
    dims: Dict[str, int]
    group: Any = None
    dim_groups: Dict[str, Any] = field(default_factory=dict)
    sp: SP = field(default_factory=SP)
    shard_size: int = 0  # --fsdp_shard_size: HSDP shard group inside the FSDP ranks (0: all; tensor_parallel)
    ep_size: int = 1  # --ep_size: experts sharded over consecutive FSDP ranks (rlhf.distributed.expert_parallel)

    def __post_init__(self):
        size = 1
        for n in self.dims.values():
            size *= n
        if size != len(self.ranks):
            raise ValueError(f"role {self.name}: dims {self.dims} (product {size}) do not cover its "
                             f"{len(self.ranks)} ranks")

    @property
    def is_member(self) -> bool:
        return self.rank in self.ranks

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> Optional[int]:
        """This rank's position among the role's ranks (None: not a member)."""
        return self.ranks.index(self.rank) if self.is_member else None

    def _strides(self) -> Dict[str, int]:
        out, inner = {}, 1
        for d in reversed(list(self.dims)):
            out[d] = inner
            inner *= self.dims[d]
        return out

    def coords(self, index: Optional[int] = None) -> Optional[Dict[str, int]]:
        """Member ``index``'s (default: this rank's) coordinate along each dimension (None: not a member)."""
        index = self.index if index is None else index
        if index is None:
            return None
        st = self._strides()
        return {d: (index // st[d]) % n for d, n in self.dims.items()}

    def size_of(self, dim: str) -> int:
        """The size of ``dim`` (1 for a dimension this role does not split)."""
        return self.dims.get(dim, 1)

    def ranks_along(self, dim: str) -> List[List[int]]:
        """Every group of ranks that differ only in their ``dim`` coordinate, in the order of the others' (for
        ``sp`` / ``tp``, the inner dimensions: consecutive chunks, as ``placement.sp_groups_for``)."""
        st, n = self._strides(), self.size_of(dim)
        if dim not in self.dims:
            return [[r] for r in self.ranks]
        starts = [i for i in range(self.size) if (i // st[dim]) % n == 0]
        return [[self.ranks[i + k * st[dim]] for k in range(n)] for i in starts]

    def group_of(self, dim: str):
        """This member's process group along ``dim``; the whole role's for ``dp`` where it is the only dimension
        of size > 1.  Raises where the group was not built (nothing reduces over it yet)."""
        if dim in self.dim_groups:
            return self.dim_groups[dim]
        if self.size_of(dim) == self.size:
            return self.group
        raise KeyError(f"role {self.name}: no process group along {dim!r} (dims {self.dims}); FSDP2 and the loss "
                       f"totals reduce over the whole role (mesh.group)")

    @property
    def dp_rank(self) -> Optional[int]:
        """This member's data-parallel rank (every member of an SP / TP group shares it; None: not a member)."""
        c = self.coords()
        return c["dp"] if c is not None else None

    @property
    def dp_size(self) -> int:
        return self.size_of("dp")

    def dp_rows(self, n_rows: int) -> Optional[slice]:
        """The rows of an ``n_rows`` batch this member computes (its data-parallel shard; None: not a member)."""
        return shard_rows(n_rows, self.dp_rank, self.dp_size) if self.is_member else None

    @property
    def replicas(self) -> int:
        """Members that compute the same rows (one data-parallel rank's SP x TP group): each counted once."""
        return self.size // self.dp_size

    def owns_rows(self) -> bool:
        """Whether this member reports its data-parallel shard: its coordinates other than ``dp`` are all 0."""
        c = self.coords()
        return c is not None and all(v == 0 for d, v in c.items() if d != "dp")

    def owned_rows(self, n_rows: int) -> Optional[slice]:
        """The rows this member reports (one owner per row; None on non-members and on the other members of its
        SP / TP group, which compute the same rows)."""
        return self.dp_rows(n_rows) if self.owns_rows() else None


def mesh_of(name: str, ranks: List[int], rank: int, dims: Dict[str, int]) -> RoleMesh:
    """A mesh without process groups (what the placement implies; ``groups.build_groups`` adds the groups)."""
    return RoleMesh(name, list(ranks), rank, dict(dims))


def world_mesh() -> RoleMesh:
    """Every rank of the job as one data-parallel dimension, over the default group (an engine built without a
    role: tests, tools)."""
    from rlhf.distributed import comm

    world = comm.world_size()
    return RoleMesh("world", list(range(world)), comm.rank(), {"dp": world}, group=comm.world_group())
