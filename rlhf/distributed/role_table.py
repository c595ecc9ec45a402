"""The role table: one declaration per role, the one list of roles.  Read by the placement (which roles a job needs:
``role_needs``; which ranks hold them: ``make_placement``; which split sequences), the process groups (their
creation order is the table's), ``rlhf.roles.base.Roles`` (its names), ``rlhf.roles.build.build_roles`` (a declared
builder) and the stage list (a declared forward stage, ``rlhf.rl.role_stages``).

After veRL's ``Role`` enum with ``role_worker_mapping`` and ``ResourcePoolManager``
(verl/trainer/ppo/ray_trainer.py: each role names its worker class and its resource pool, and ``init_workers`` loops
over the mapping instead of naming roles) and torchtitan's ``ParallelDims`` (torchtitan/distributed/parallel_dims.py:
one object the rest reads): here a role's rank rule replaces the resource pool and a dotted builder path the worker
class (no role code is imported until built, as ``rlhf.engines.rollout_registry``).

A new role is one ``register_role`` call here, its flag in ``rlhf/config/schema.py`` and, if a stage writes one, its
``Batch`` field; a role with code of its own adds its file under ``rlhf/roles/`` (the ``builder``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

from rlhf.errors import TopologyError


@dataclass(frozen=True)
class Block:
    """A block of ranks of its own: ``--<flag>_num_nodes`` x ``--<flag>_num_gpus_per_node``."""
    flag: str
    nodes: int
    per_node: int

    def size(self, gpus_per_node: int) -> int:
        """Its rank count, checked against the node size (a block spanning nodes fills them)."""
        return _block(self.flag, self.nodes, self.per_node, gpus_per_node)


@dataclass(frozen=True)
class Share:
    """The ranks of another role, declared earlier in the table."""
    role: str


Rule = Union[Block, Share]


@dataclass(frozen=True)
class RoleDecl:
    """One role.  ``need(algorithm, model) -> bool`` (None: every RL job has it), keyword ``need_kw`` of
    ``make_placement`` / ``required_world_size`` (default ``need_default``); ``ranks(topo, needs) -> Block | Share``
    its ranks when roles are separate (with --colocate_all_models every role a job needs is on every rank);
    ``reserves(topo)`` whether its block is subtracted before the actor takes "the rest" (default: every block);
    ``splits_sequences`` whether its forwards split a sequence over --ring_attn_size ranks; ``builder``
    ``"module:function"`` of ``(decl, model, optim, topology, groups, device, total_steps) -> Role`` ("": ``build_roles`` builds it
    itself); ``pretrain`` the model flag the builder loads (``rlhf.roles.registry.build_frozen_lm``); ``forward`` the
    ``Batch`` field a no-grad log-prob stage of this role writes each step, after the reference's ("": none);
    ``flags`` the config group (a field of the config: ``model``, ``teacher``) its ``need`` and ``pretrain`` read."""
    name: str
    ranks: Callable[[Any, Dict[str, bool]], Rule]
    need: Optional[Callable[[Any, Any], bool]] = None
    need_kw: str = ""
    need_default: bool = False
    reserves: Optional[Callable[[Any], bool]] = None
    splits_sequences: bool = True
    builder: str = ""
    pretrain: str = ""
    forward: str = ""
    flags: str = "model"


ROLE_TABLE: Dict[str, RoleDecl] = {}


def register_role(decl: RoleDecl) -> RoleDecl:
    """Add ``decl`` to the table (its place in the table is its place in the rank blocks and the group order)."""
    if decl.name in ROLE_TABLE:
        raise ValueError(f"role {decl.name!r} is declared twice in the role table")
    ROLE_TABLE[decl.name] = decl
    return decl


def role_names() -> Tuple[str, ...]:
    return tuple(ROLE_TABLE)


def sp_role_names() -> Tuple[str, ...]:
    return tuple(d.name for d in ROLE_TABLE.values() if d.splits_sequences)


def needs_from_kwargs(kw: Dict[str, bool]) -> Dict[str, bool]:
    """role -> the job needs it, from ``make_placement``'s ``need_*`` keywords (the others take their default).
    Raises TypeError naming a keyword no role declares."""
    known = {d.need_kw: d for d in ROLE_TABLE.values() if d.need_kw}
    unknown = sorted(set(kw) - set(known))
    if unknown:
        raise TypeError(f"unknown role keyword(s) {unknown}; the role table declares {sorted(known)}")
    return {d.name: (bool(kw.get(d.need_kw, d.need_default)) if d.need_kw else True) for d in ROLE_TABLE.values()}


def _block(name: str, nodes: int, per_node: int, gpus_per_node: int) -> int:
    if nodes < 1:
        raise TopologyError(f"--{name}_num_nodes must be >= 1, got {nodes}")
    if nodes > 1 and per_node != gpus_per_node:
        raise TopologyError(f"--{name}_num_nodes {nodes} spans nodes, so --{name}_num_gpus_per_node must equal the "
                            f"ranks per node ({gpus_per_node}), got {per_node}")
    return nodes * per_node


def _own_or(flag: str, fallback: str, when: Callable[[Any], bool] = lambda t: True):
    """The rank rule "a block of its own when ``--<flag>_num_gpus_per_node`` > 0 (and ``when``), else ``fallback``'s
    ranks"."""
    def rule(t, needs):
        if getattr(t, f"{flag}_num_gpus_per_node") and when(t):
            return Block(flag, getattr(t, f"{flag}_num_nodes"), getattr(t, f"{flag}_num_gpus_per_node"))
        return Share(fallback)
    return rule


def _reward_ranks(t, needs) -> Rule:
    if t.colocate_critic_reward and needs["critic"]:
        return Share("critic")
    return _own_or("reward", "actor")(t, needs)


def _rollout_ranks(t, needs) -> Rule:
    if t.vllm_num_engines > 0:  # separate rollout ranks: the engines' block, after every other role's
        return Block("rollout", 1, t.vllm_num_engines * t.vllm_tensor_parallel_size)
    return Share("actor")


def _critic_needed(algorithm, model) -> bool:
    from rlhf.algorithms import ADVANTAGE_ESTIMATORS

    return ADVANTAGE_ESTIMATORS[algorithm.advantage_estimator].needs_critic


# The built-in roles, in block order.  The actor's own size is the placement's (--actor_* or "the rest").
register_role(RoleDecl("actor", ranks=lambda t, needs: Share("actor")))
register_role(RoleDecl("ref", _own_or("ref", "actor", lambda t: not t.colocate_actor_ref),
                       need=lambda a, m: a.init_kl_coef > 0 or a.use_kl_loss, need_kw="need_ref", need_default=True))
register_role(RoleDecl("critic", _own_or("critic", "actor"), need=_critic_needed, need_kw="need_critic"))
register_role(RoleDecl("reward", _reward_ranks, need=lambda a, m: m.reward_pretrain is not None,
                       need_kw="need_reward_model", reserves=lambda t: not t.colocate_critic_reward))
register_role(RoleDecl("rollout", _rollout_ranks, splits_sequences=False))
register_role(RoleDecl("teacher", _own_or("teacher", "actor"), need=lambda a, t: bool(t.teacher_pretrain) and not t.teacher_url,
                       need_kw="need_teacher", builder="rlhf.roles.teacher:build_teacher", pretrain="teacher_pretrain",
                       forward="teacher_logprobs", flags="teacher"))  # a frozen teacher (on-policy distillation)
