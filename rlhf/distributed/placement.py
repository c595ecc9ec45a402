"""The placement: which ranks hold which roles, computed from the topology flags alone.

Pure Python (no torch.distributed): it runs, and fails, before any process group
exists.  Ranks are laid out in blocks in this order when roles are separate:
actor, ref, critic, reward, rollout.  A role with ``*_num_gpus_per_node 0``
shares the actor's ranks (``reward`` shares the critic's with
``--colocate_critic_reward``, ``ref`` the actor's with ``--colocate_actor_ref``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from rlhf.distributed.role_table import ROLE_TABLE, Block, _block, needs_from_kwargs, role_names, sp_role_names
from rlhf.errors import TopologyError

ROLES = role_names()  # the role table's names (rlhf.distributed.role_table) at import, for importers of the name
SP_ROLES = sp_role_names()  # roles whose forwards split a sequence over --ring_attn_size ranks


@dataclass
class Placement:
    world_size: int
    gpus_per_node: int
    ranks: Dict[str, List[int]]            # role -> its ranks (empty list: the role does not exist)
    engine_ranks: List[List[int]]          # each rollout engine's TP ranks
    colocated: bool                        # every role on every rank (hybrid engine)
    separate_rollout: bool                 # rollout ranks hold no actor shard
    sync_ranks: List[int] = field(default_factory=list)  # actor rank 0 + rollout ranks (broadcast weight sync)
    sp_size: int = 1                       # --ring_attn_size: ranks that split one sequence (Ulysses)
    sp_groups: Dict[str, List[List[int]]] = field(default_factory=dict)  # role -> its SP groups (consecutive ranks)
    tp_size: int = 1                       # --tp_size: a model role's tensor-parallel ranks (rlhf.distributed.tensor_parallel)
    fsdp_shard_size: int = 0               # --fsdp_shard_size: HSDP shard group (0: shard over every FSDP rank)
    ep_size: int = 1                       # --ep_size: the actor's and reference's expert-parallel ranks

    def dims(self, role: str) -> Dict[str, int]:
        """``role``'s named mesh dimensions, outer to inner (their product is its rank count; rlhf.distributed.mesh).

        Model roles: ``dp`` (data-parallel ranks) x ``sp`` (``--ring_attn_size``, consecutive ranks).  Tensor
        parallelism of a training role goes here next, as an inner ``tp`` dimension.  The rollout role: ``dp``
        (engines) x ``tp`` (``--vllm_tensor_parallel_size``, each engine's consecutive ranks)."""
        n = len(self.ranks.get(role) or [])
        if role == "rollout":
            tp = len(self.engine_ranks[0]) if self.engine_ranks else 1
            return {"dp": n // tp, "tp": tp}
        sp = self.sp_size if role in self.sp_groups else 1
        tp = self.tp_size if role in sp_role_names() else 1
        if tp > 1:  # --tp_size: between dp and sp (an SP group stays consecutive ranks; rlhf.distributed.tensor_parallel)
            return {"dp": n // (sp * tp), "tp": tp, "sp": sp}
        return {"dp": n // sp, "sp": sp}

    def named_ranks(self) -> Dict[str, List[int]]:
        """The groups across roles, by name (only those this placement has):

        * ``sync``: actor rank 0 + the rollout ranks (separate rollout: the weight broadcast);
        * ``trainers``: the ranks holding a model role, where rollout ranks of their own exist (--async_train
          gathers the inference forwards over them, so the rollout ranks generate meanwhile);
        * ``rollout_reward``: the rollout ranks of their own + the reward model's (--async_train scores each batch
          over them as soon as the engines produced it, rlhf.rl.async_queue)."""
        out: Dict[str, List[int]] = {}
        if self.sync_ranks:
            out["sync"] = list(self.sync_ranks)
        trainers = sorted({r for role in role_names() if role != "rollout" for r in (self.ranks.get(role) or [])})
        if trainers and trainers != list(range(self.world_size)):
            out["trainers"] = trainers
        if self.separate_rollout and self.ranks.get("reward"):
            out["rollout_reward"] = sorted(set(self.ranks["rollout"]) | set(self.ranks["reward"]))
        return out

    def roles_of(self, rank: int) -> List[str]:
        return [r for r in role_names() if rank in self.ranks.get(r, [])]

    def engine_of(self, rank: int) -> Optional[int]:
        for i, e in enumerate(self.engine_ranks):
            if rank in e:
                return i
        return None

    def table(self) -> str:
        rows = [f"world_size={self.world_size}  ranks/node={self.gpus_per_node}  "
                f"mode={'colocated (hybrid engine)' if self.colocated else 'separate roles'}",
                f"{'rank':>4}  {'node':>4}  roles"]
        for rank in range(self.world_size):
            roles = []
            for r in self.roles_of(rank):
                roles.append(f"rollout[engine {self.engine_of(rank)}]" if r == "rollout" else r)
            rows.append(f"{rank:>4}  {rank // self.gpus_per_node:>4}  {', '.join(roles) or '-'}")
        for name in role_names():
            if self.ranks.get(name):
                rows.append(f"{name:>8}: ranks {_ranges(self.ranks[name])}")
        rows.append(f" engines: {len(self.engine_ranks)} x TP {len(self.engine_ranks[0]) if self.engine_ranks else 0}: "
                    + "; ".join(_ranges(e) for e in self.engine_ranks))
        weights = "in-process (colocated)" if not self.separate_rollout else "broadcast over ranks " + _ranges(
            self.sync_ranks)
        rows.append(f"weights:  {weights}")
        if self.sp_size > 1:
            for name, groups in self.sp_groups.items():
                rows.append(f"{'sp ' + name:>8}: {len(groups)} x {self.sp_size} ranks (--ring_attn_size; data-parallel "
                            f"ranks {len(groups)}): " + "; ".join(_ranges(g) for g in groups))
        if self.tp_size > 1 or self.fsdp_shard_size:
            rows.append(f"   model: tp {self.tp_size} (--tp_size), FSDP shard group {self.fsdp_shard_size or 'all'} "
                        f"(--fsdp_shard_size) in each model role")
        return "\n".join(rows)


def _ranges(ranks: List[int]) -> str:
    if not ranks:
        return "-"
    out, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def required_world_size(topo, **need) -> Optional[int]:
    """The world size the role flags imply, or None when they leave it open (a role sized "all the rest").

    Colocated: the actor block (``--actor_num_nodes x --actor_num_gpus_per_node``).  Separate roles: the sum of
    the blocks, when the actor's size is given.  ``need``: ``role_needs``' keywords.
    """
    needs = needs_from_kwargs(need)
    if not topo.actor_num_gpus_per_node:
        return None
    n_actor = topo.actor_num_nodes * topo.actor_num_gpus_per_node
    if topo.colocate_all_models:
        return n_actor
    blocks = [r for r in _rules(topo, needs).values() if isinstance(r, Block)]
    return n_actor + sum(b.nodes * b.per_node for b in blocks)


def role_needs(algorithm, model, **groups) -> Dict[str, bool]:
    """Which optional roles a job needs, from the algorithm and model flags (and the flag ``groups`` a declaration
    reads instead of the model's, ``RoleDecl.flags``: ``teacher=cfg.teacher``; one not given: not needed): each
    role's declared ``need`` rule (rlhf.distributed.role_table, the one place these rules live; e.g. a reference if
    the KL enters the reward or the loss, a critic if the advantage estimator needs one, a reward model if
    ``--reward_pretrain`` is given).  The keyword arguments of ``make_placement`` / ``required_world_size``."""
    groups["model"] = model
    return {d.need_kw: d.flags in groups and bool(d.need(algorithm, groups[d.flags]))
            for d in ROLE_TABLE.values() if d.need_kw}


def flag_groups(cfg) -> Dict[str, object]:
    """name -> flag group of a parsed config, for every group besides ``model`` a role declaration reads
    (``RoleDecl.flags``)."""
    return {d.flags: getattr(cfg, d.flags) for d in ROLE_TABLE.values() if d.flags != "model"}


def job_role_needs(cfg) -> Dict[str, bool]:
    """``role_needs`` of a parsed config (every flag group a declaration reads)."""
    return role_needs(cfg.algorithm, cfg.model, **flag_groups(cfg))


def _rules(topo, needs: Dict[str, bool]) -> Dict[str, object]:
    """role -> its declared rank rule (Block or Share), for the roles besides the actor that the job needs."""
    return {d.name: d.ranks(topo, needs) for d in ROLE_TABLE.values() if d.name != "actor" and needs[d.name]}


def supervised_placement(world_size: int, gpus_per_node: int, sp: int, with_ref: bool = False) -> Placement:
    """The placement of a supervised job (SFT / RM / DPO): the trained model on every rank (the ``actor`` role) and,
    with ``with_ref``, DPO's reference on every rank too (``ref``), each split into the same sequence-parallel groups
    of ``sp`` consecutive ranks; no rollout.  Raises TopologyError as ``sp_groups_for``."""
    ranks = list(range(world_size))
    held = ("actor", "ref") if with_ref else ("actor",)
    plan = Placement(world_size, gpus_per_node, {r: (ranks if r in held else []) for r in role_names()}, [],
                     colocated=True, separate_rollout=False, sp_size=sp)
    if sp > 1:
        groups = sp_groups_for(ranks, sp, gpus_per_node, "world")
        plan.sp_groups = {r: groups for r in held}  # the same ranks: build_groups makes each group once
    return plan


def make_placement(topo, world_size: int, nnodes: int = 1, parallel=None, **need) -> Placement:
    """Compute and validate the placement; ``need``: ``role_needs``' keywords (``need_ref`` defaults to True, the
    others to False); ``parallel``: the ``parallel`` flag group (--tp_size, --fsdp_shard_size; None: neither).
    Raises TopologyError naming the numbers that disagree."""
    plan = _make_placement(topo, world_size, nnodes, needs_from_kwargs(need))
    plan = with_sp_groups(plan, int(getattr(topo, "ring_attn_size", 1) or 1))
    if parallel is not None:
        from rlhf.distributed.tensor_parallel import with_tp

        with_tp(plan, parallel.tp_size, parallel.fsdp_shard_size)
        from rlhf.distributed.expert_parallel import with_ep

        with_ep(plan, parallel.ep_size)
    return plan


def sp_groups_for(ranks: List[int], sp: int, gpus_per_node: int, role: str = "actor") -> List[List[int]]:
    """A role's ranks in consecutive chunks of ``sp`` (one chunk = one sequence-parallel group, one data-parallel
    rank).  Raises TopologyError, with a size that works, when ``sp`` does not divide the ranks or a chunk would
    cross a node boundary (Ulysses' all-to-alls stay inside a node, as OpenRLHF's ring groups and veRL's)."""
    if sp < 1:
        raise TopologyError(f"--ring_attn_size must be >= 1, got {sp}")
    ok = [k for k in range(1, len(ranks) + 1) if len(ranks) % k == 0 and k <= gpus_per_node
          and gpus_per_node % k == 0]
    if len(ranks) % sp:
        raise TopologyError(f"--ring_attn_size {sp} must divide the {role} ranks ({len(ranks)}): each group of {sp} "
                            f"ranks splits one sequence; use --ring_attn_size {max(k for k in ok if k <= sp)}")
    groups = [ranks[i:i + sp] for i in range(0, len(ranks), sp)]
    for g in groups:
        if g[0] // gpus_per_node != g[-1] // gpus_per_node:
            raise TopologyError(f"--ring_attn_size {sp}: the {role}'s sequence-parallel group {_ranges(g)} crosses a "
                                f"node boundary ({gpus_per_node} ranks per node); use --ring_attn_size "
                                f"{max(k for k in ok if k <= sp)}")
    return groups


def with_sp_groups(plan: Placement, sp: int) -> Placement:
    """``plan`` with the sequence-parallel groups of the roles that split sequences (``RoleDecl.splits_sequences``)."""
    plan.sp_size = sp
    plan.sp_groups = {}
    if sp <= 1:
        return plan
    for role in sp_role_names():
        if plan.ranks.get(role):
            plan.sp_groups[role] = sp_groups_for(plan.ranks[role], sp, plan.gpus_per_node, role)
    return plan


def _make_placement(topo, world_size: int, nnodes: int, needs: Dict[str, bool]) -> Placement:
    if world_size < 1:
        raise TopologyError(f"world size must be >= 1, got {world_size}")
    if nnodes < 1 or world_size % nnodes:
        raise TopologyError(f"world size {world_size} is not divisible by {nnodes} nodes")
    gpn = world_size // nnodes
    tp = topo.vllm_tensor_parallel_size
    if tp < 1:
        raise TopologyError(f"--vllm_tensor_parallel_size must be >= 1, got {tp}")
    if tp > gpn or gpn % tp:
        raise TopologyError(f"--vllm_tensor_parallel_size {tp} must divide the ranks per node ({gpn}): "
                            f"a TP group may not cross a node boundary")
    per = topo.actor_num_gpus_per_node or (gpn if topo.actor_num_nodes > 1 else None)
    n_actor = _block("actor", topo.actor_num_nodes, per, gpn) if per else None

    if topo.colocate_all_models:
        n_actor = n_actor or world_size
        if n_actor != world_size:
            raise TopologyError(f"--colocate_all_models puts every role on every rank: actor ranks "
                                f"({topo.actor_num_nodes} x {topo.actor_num_gpus_per_node} = {n_actor}) must equal "
                                f"the world size {world_size}")
        engines = topo.vllm_num_engines or n_actor // tp
        if engines * tp != n_actor:
            raise TopologyError(f"colocated rollout: --vllm_num_engines {engines} x --vllm_tensor_parallel_size {tp} "
                                f"= {engines * tp} must equal the actor ranks {n_actor}; "
                                f"use --vllm_num_engines {n_actor // tp}" if n_actor % tp == 0 else
                                f"colocated rollout: actor ranks {n_actor} are not a multiple of TP {tp}")
        ranks = list(range(world_size))
        roles = {name: ranks if need else [] for name, need in needs.items()}
        return Placement(world_size, gpn, roles, [ranks[i * tp:(i + 1) * tp] for i in range(engines)], True, False)

    blocks: List[Tuple[str, int]] = []
    ranks_of = {}
    cursor = 0

    def take(name, n):
        nonlocal cursor
        ranks_of[name] = list(range(cursor, cursor + n))
        blocks.append((name, n))
        cursor += n

    rules = _rules(topo, needs)
    rollout_n = topo.vllm_num_engines * tp
    others = sum(r.size(gpn) for name, r in rules.items() if isinstance(r, Block) and name != "rollout"
                 and (ROLE_TABLE[name].reserves is None or ROLE_TABLE[name].reserves(topo)))
    if n_actor is None:
        n_actor = world_size - others - rollout_n
        if n_actor < 1:
            raise TopologyError(f"no ranks left for the actor: world {world_size} - other roles {others} - rollout "
                                f"{rollout_n} = {n_actor}")
    take("actor", n_actor)
    for name, rule in rules.items():  # in table order: each role a block of its own or another's ranks
        if isinstance(rule, Block):
            take(name, rule.size(gpn))
        else:
            ranks_of[name] = ranks_of[rule.role]
    separate = topo.vllm_num_engines > 0
    if not separate and n_actor % tp:
        raise TopologyError(f"rollout on the actor ranks: actor ranks {n_actor} are not a multiple of "
                            f"--vllm_tensor_parallel_size {tp}")
    if cursor != world_size:
        detail = " + ".join(f"{n} {name}" for name, n in blocks)
        raise TopologyError(f"the roles need {detail} = {cursor} ranks but the world size is {world_size}; "
                            f"launch with --nproc_per_node x --nnodes = {cursor} or change the *_num_gpus_per_node / "
                            f"--vllm_num_engines flags")
    # node boundaries: a block that does not fill whole nodes must sit inside one node
    for name, n in blocks:
        ranks = ranks_of[name]
        first, last = ranks[0] // gpn, ranks[-1] // gpn
        if first != last and (ranks[0] % gpn or n % gpn):
            raise TopologyError(f"role {name} (ranks {_ranges(ranks)}) straddles a node boundary with {gpn} ranks "
                                f"per node; make its size a multiple of {gpn} or fit it in one node")
    rollout = ranks_of["rollout"]
    engines = [rollout[i * tp:(i + 1) * tp] for i in range(len(rollout) // tp)]
    for e in engines:
        if e[0] // gpn != e[-1] // gpn:
            raise TopologyError(f"rollout engine on ranks {_ranges(e)} crosses a node boundary")
    for r in role_names():
        ranks_of.setdefault(r, [])
    sync = [ranks_of["actor"][0]] + rollout if separate else []
    return Placement(world_size, gpn, ranks_of, engines, False, separate, sync)
