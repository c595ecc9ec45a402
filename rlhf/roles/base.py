"""Roles as objects: each owns its member ranks, its process group and (on its members) its engine.

The placement (``rlhf.distributed.placement.Placement``) is the one place that decides which
roles exist and where.  ``build_roles`` turns it into objects on *every* rank: a role
that exists has an object everywhere (``is_member`` says whether this rank holds
it), a role that does not exist is ``None`` everywhere.  So "does this role exist"
is answered from shared state, identically on every rank.

Every operation that produces rows for the whole batch (log-probs, values, scores,
generation) is called by every rank; members compute their shard, and
``rlhf.distributed.sharding`` brings the rows to everybody with the same collective
sequence whatever the shard sizes.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from rlhf.batch import Batch
from rlhf.checkpoint import save_hf
from rlhf.distributed import Groups, RoleMesh
from rlhf.distributed.role_table import ROLE_TABLE
from rlhf.distributed.sequence_parallel import SP, attach
from rlhf.distributed.sharding import gather_rows, micro_plan, run_micro
from rlhf.engines.train import EngineSpec, TrainEngine, reads_weights, spec_from_config
from rlhf.engines.train_registry import make_engine
from rlhf.models.forward import action_logprobs, packed_action_logprobs
from rlhf.models.vision import batch_images
from rlhf.rewards.reward_model import score_sequences
from rlhf.roles.routing import keep_routing, record_width, routed_forward, with_routing


class Role:
    """A role of the placement over its ``mesh`` (rlhf.distributed.mesh.RoleMesh: its ranks, named dimensions,
    process groups and row ownership; on every rank, member or not)."""

    def __init__(self, name: str, mesh: RoleMesh):
        self.name, self.mesh = name, mesh
        self.engine = None
        self.gather_group = None  # the ranks its forwards' rows are gathered to (None: the world)

    @property
    def members(self) -> List[int]:
        return self.mesh.ranks

    @property
    def group(self):
        """The role's process group (on members; None elsewhere)."""
        return self.mesh.group

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def sp(self) -> SP:
        """--ring_attn_size: this member's sequence-parallel group (size 1: none)."""
        return self.mesh.sp

    @property
    def is_member(self) -> bool:
        return self.mesh.is_member

    @property
    def size(self) -> int:
        return self.mesh.size

    @property
    def index(self) -> Optional[int]:
        return self.mesh.index

    @property
    def dp_index(self) -> Optional[int]:
        """This member's data-parallel rank (``RoleMesh.dp_rank``: the members of an SP group share one)."""
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    def rows(self, n_rows: int) -> Optional[slice]:
        """The rows this member reports of an n-row batch (``RoleMesh.owned_rows``: one owner per row)."""
        return self.mesh.owned_rows(n_rows)

    def sleep(self) -> None:
        if self.engine is not None:
            self.engine.sleep()

    def wake(self, tags=None) -> None:
        if self.engine is not None:
            self.engine.wake(tags)

    def memory_state(self) -> str:
        """What this rank holds of the role (the phase scheduler asks, and keeps no copy): its engine's answer,
        ``full`` | ``weights`` (vLLM: weights only) | ``asleep``; ``asleep`` without an engine here."""
        return self.engine.memory_state() if self.engine is not None else "asleep"

    def sync_follows(self) -> None:
        """A weight sync comes before this role's next use.  Only a rollout engine may act on it (discard its
        weights when it sleeps): a model role keeps its weights."""

    def __repr__(self):
        return f"{type(self).__name__}({self.name}, members={self.members})"


class ModelRole(Role):
    """A role holding a train engine (actor, ref, critic, reward model), Stateful as
    torch/distributed/checkpoint/stateful.py's protocol (state_dict / load_state_dict) except that the state
    travels as a directory: the engine writes its own shards there (FSDP2: ``dcp.save`` over the role's group),
    so no rank builds the whole state.  Every rank calls these; the role's members take part (collectives over
    the role's group), the others pass."""

    engine: Optional[TrainEngine]
    trains = False   # whether it holds optimizer state: its state is part of a run's checkpoint
    state_name = ""  # its directory in a run's checkpoint ("": the role's name)
    route = None     # an MoE model's routing in its forwards (rlhf.roles.routing.RouteLog; build_roles sets it)
    records_routing = False  # --router_replay R2 on the actor: logprobs keeps its forward's routing (every rank)

    @property
    def state_dir(self) -> str:
        return self.state_name or self.name

    def state_dict(self, path: str) -> None:
        """The engine's checkpoint (model and optimizer shards, scheduler) under ``path``."""
        if self.is_member:
            self.engine.save_checkpoint(path)

    def load_state_dict(self, path: str) -> None:
        """The inverse of ``state_dict``."""
        if self.is_member:
            self.engine.load_checkpoint(path)

    def export(self, path: str, tokenizer) -> None:
        """The full weights as an HF model at ``path``: gathered over the members, written by the first."""
        if self.is_member:
            sd = self.engine.full_state_dict()
            if self.rank == self.members[0]:
                save_hf(sd, self.engine.model, tokenizer, path)

    def rows_forward(self, n_rows: int, micro: int, fn: Callable[[slice], torch.Tensor], width: int,
                     over: Any = "default") -> torch.Tensor:
        """(n_rows, width) on every rank of ``over`` (default ``gather_group``: the world, or the model roles'
        ranks under --async_train): members run ``fn`` on their micro-batches (the same count on every member:
        sharded forwards are collectives), then one gather over those ranks."""
        local, rows = None, self.rows(n_rows)
        budget = getattr(micro, "plan", None)  # --use_dynamic_batch: rlhf.rl.components.InferencePlan
        if self.is_member and n_rows > 0:
            parts = budget(self.dp_index) if budget else micro_plan(n_rows, self.dp_index, self.dp_size, micro)
            local = run_micro(fn, parts, dummy=slice(0, 1))
        if budget and rows is not None:
            rows = micro.rows(self.dp_index)
        return gather_rows(local, rows, n_rows, width, group=self.gather_group if over == "default" else over)

    @torch.no_grad()
    def logprobs(self, batch: Batch, temperature: float, micro: int, chunk: int, packing: bool) -> torch.Tensor:
        """log pi(a_t | s_<t) of the response tokens, (B, R), masked."""
        def fn(p: slice):
            model, dev = self.engine.model, self.engine.compute_device
            ids, att = batch.sequences[p].to(dev), batch.attention_mask[p].to(dev)
            im = batch_images(batch, p, dev)  # a vision-language model's images of these rows (None: text-only)
            with routed_forward(self.route, "ref" if self.name == "ref" else "old", batch, p, att, packing) as r:
                if packing:
                    lp = packed_action_logprobs(model, ids, att, batch.action_mask[p].to(dev), temperature, chunk,
                                                images=im)
                else:
                    lp = action_logprobs(model, ids, att, batch.num_actions, temperature, chunk, images=im)[0]
            return with_routing(lp, r, att, packing) if self.records_routing else lp

        width = batch.num_actions + record_width(self, batch)  # R2: the routing rides in the same gather
        return keep_routing(self, self.rows_forward(batch.sequences.size(0), micro, fn, width), batch) \
            * batch.action_mask

    @torch.no_grad()
    def values(self, batch: Batch, micro: int) -> torch.Tensor:
        """Critic values of the response positions, (B, R), masked."""
        def fn(p: slice):
            model, dev = self.engine.model, self.engine.compute_device
            return model(batch.sequences[p].to(dev), batch.attention_mask[p].to(dev), batch.num_actions)

        return self.rows_forward(batch.sequences.size(0), micro, fn, batch.num_actions) * batch.action_mask

    @torch.no_grad()
    def scores(self, batch: Batch, micro: int, stats, over: Any = "default") -> torch.Tensor:
        """Reward-model scores, (B,), on every rank of ``over`` (see ``rows_forward``)."""
        fn = lambda p: score_sequences(self.engine.model, batch.sequences[p], batch.attention_mask[p], stats,  # noqa: E731
                                       p.stop - p.start if hasattr(micro, "plan") else micro,
                                       device=self.engine.compute_device).unsqueeze(1)
        return self.rows_forward(batch.sequences.size(0), micro, fn, 1, over).squeeze(1)


class Roles:
    """The roles of this job by name, as objects on every rank (None: the placement has no such role); the names are
    the role table's (rlhf.distributed.role_table), read as attributes (``roles.actor``, ``roles.ref``, ...)."""

    def __init__(self, reward_stats: tuple = (0.0, 1.0), **by_name: Optional[Role]):
        unknown = sorted(set(by_name) - set(ROLE_TABLE))
        if unknown:
            raise TypeError(f"Roles: {unknown} not in the role table (rlhf.distributed.role_table): {list(ROLE_TABLE)}")
        object.__setattr__(self, "_by_name", {name: by_name.get(name) for name in ROLE_TABLE})
        self.reward_stats = reward_stats

    def __getattr__(self, name: str):
        by_name = self.__dict__.get("_by_name", {})
        if name in by_name:
            return by_name[name]
        raise AttributeError(f"Roles has no role {name!r}; the role table's: {list(by_name)}")

    def __setattr__(self, name: str, value) -> None:
        if name in self._by_name:
            self._by_name[name] = value
        else:
            object.__setattr__(self, name, value)

    def __repr__(self):
        return f"Roles({', '.join(f'{k}={v!r}' for k, v in self.all().items())})"

    def all(self) -> Dict[str, Role]:
        """The roles this job has, by name, in the table's order (actor, ref, critic, reward, rollout, ...)."""
        return {k: v for k, v in self._by_name.items() if v is not None}

    def trained(self) -> List[ModelRole]:
        """The roles with optimizer state, in checkpoint order (actor, critic): what a run's checkpoint holds."""
        return [r for r in self.all().values() if isinstance(r, ModelRole) and r.trains]

    def sleepables(self) -> Dict[str, Role]:
        """The roles this rank holds an engine of (what the phase scheduler puts to sleep and wakes)."""
        return {k: v for k, v in self.all().items() if v.engine is not None}


def model_role(cls, name: str, groups: Groups, backend: str, device, spec: Callable[[ModelRole], EngineSpec],
               load: Callable[[bool], torch.nn.Module], **kw) -> Optional[ModelRole]:
    """The ``cls`` object of the placement's role ``name`` on every rank (None where the placement has none); on its
    members the engine over the role's group (``load(on_meta)``: the model, on the meta device where this rank does
    not read the weights) with its sequence-parallel group attached.  ``kw``: ``cls``'s own arguments."""
    mesh = groups.mesh(name)
    if mesh is None:
        return None
    role = cls(name, mesh, **kw)
    if role.is_member:
        role.engine = make_engine(backend, load(not reads_weights(backend, role.group)), spec(role), mesh=mesh,
                                  device=device)
        attach(role.engine.model, role.sp)
    return role


def frozen_spec(model, optim, topology, total_steps: int) -> Callable[[ModelRole], EngineSpec]:
    """A frozen role's engine spec (inference micro-batches only: RL's reference and reward model, DPO's
    reference), from the model, optim and topology groups."""
    return lambda role: spec_from_config(model, optim, topology, 0.0, total_steps, trainable=False,
                                         group_size=role.size)


