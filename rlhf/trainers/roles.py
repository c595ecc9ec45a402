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

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from rlhf.backends.base import EngineSpec, TrainEngine, reads_weights, spec_from_config
from rlhf.backends.factory import make_engine
from rlhf.checkpoint import save_hf
from rlhf.distributed import Groups, RoleMesh
from rlhf.distributed.sequence_parallel import SP, attach
from rlhf.distributed.sharding import gather_rows, micro_plan, run_micro, shard_rows
from rlhf.models.forward import action_logprobs, packed_action_logprobs
from rlhf.models.lm_head import use_fp32_head
from rlhf.models.load import load_causal_lm, load_reward_model, load_tokenizer, resolve_pretrain
from rlhf.rewards.reward_model import score_sequences
from rlhf.rollout.base import SamplingParams
from rlhf.rollout.registry import EngineArgs, EnginePlace, auto_engine, build_engine

from .batch import Batch, gather_batch, row_fields


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
        budget = getattr(micro, "plan", None)  # --use_dynamic_batch: rlhf.trainers.experience.InferencePlan
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
            if packing:
                return packed_action_logprobs(model, ids, att, batch.action_mask[p].to(dev), temperature, chunk)
            return action_logprobs(model, ids, att, batch.num_actions, temperature, chunk)[0]

        return self.rows_forward(batch.sequences.size(0), micro, fn, batch.num_actions) * batch.action_mask

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


class RolloutRole(Role):
    """The rollout engines: ``engine_ranks`` lists each engine's TP ranks; prompts are split over engines, every
    TP rank of an engine gets the same prompts, and the engine's first rank reports its rows."""

    def __init__(self, name: str, mesh: RoleMesh):
        super().__init__(name, mesh)
        self.engine_ranks = mesh.ranks_along("tp")
        self.agent = None  # AgentExecutor driving the engine (--agent_func_path)

    @property
    def engine_index(self) -> Optional[int]:
        for i, e in enumerate(self.engine_ranks):
            if self.rank in e:
                return i
        return None

    def sync_follows(self) -> None:
        """A weight sync comes before the next generate: the engine's next sleep may discard its weights."""
        if self.engine is not None:
            self.engine.sync_follows()

    def prompt_rows(self, n_prompts: int, engine: int) -> slice:
        return shard_rows(n_prompts, engine, len(self.engine_ranks))

    def generate(self, prompts, params: SamplingParams) -> Optional[Batch]:
        """This rank's engine generates for its engine's prompts (no world collective: the rollout ranks may
        run this while other roles train).  Returns the rows on the engine's first rank, else None."""
        e = self.engine_index
        if e is None:
            return None
        mine = prompts[self.prompt_rows(len(prompts), e)]
        if not mine:  # fewer prompts than engines: this engine idles (all its TP ranks alike)
            return None
        first = self.engine_ranks[e][0] == self.rank
        if self.agent is not None:
            return self.run_agent(mine, params, first)
        batch = self.engine.generate([p.ids for p in mine], params)
        return batch if first else None

    def run_agent(self, mine, params: SamplingParams, first: bool) -> Optional[Batch]:
        """The agent runs on the engine's first rank only (its environment steps once per episode); the engine's
        other TP ranks take part in each of its generate calls (colocated: vLLM's TP ranks run in lock-step) or,
        with vLLM in its own processes, have nothing to do."""
        if not first:
            self.engine.serve()
            return None
        try:
            return self.agent.run([p.ids for p in mine], [p.prompt for p in mine], [p.label for p in mine], params)
        finally:
            self.engine.end_requests()

    def gather(self, local: Optional[Batch], n_prompts: int, n_samples: int, pad_id: int,
               with_rewards: bool = False) -> Batch:
        """The full batch on every rank, re-padded to a common prompt and response width (``gather_batch``: one
        max of the widths, one gather of the int fields, one of the float fields; every rank, whatever it holds).
        ``with_rewards``: the rows carry the environment's rewards and scores (agents)."""
        owned: Optional[slice] = None
        e = self.engine_index
        if local is not None:
            pr = self.prompt_rows(n_prompts, e)
            owned = slice(pr.start * n_samples, pr.stop * n_samples)
            assert local.sequences.size(0) == owned.stop - owned.start, \
                f"engine {e} returned {local.sequences.size(0)} rows for {owned.stop - owned.start}"
        names = row_fields("rollout") + (["rewards", "scores"] if with_rewards else [])
        return gather_batch(local, owned, n_prompts * n_samples, names, pad_id)


@dataclass
class Roles:
    """The roles of this job, as objects on every rank (None: the placement has no such role)."""
    actor: ModelRole
    rollout: Optional[RolloutRole] = None      # none in the supervised trainers
    ref: Optional[ModelRole] = None
    critic: Optional[ModelRole] = None
    reward: Optional[ModelRole] = None          # sequence-classification reward model
    reward_stats: tuple = (0.0, 1.0)

    def all(self) -> Dict[str, Role]:
        return {k: v for k, v in (("actor", self.actor), ("ref", self.ref), ("critic", self.critic),
                                  ("reward", self.reward), ("rollout", self.rollout)) if v is not None}

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


def frozen_spec(cfg, total_steps: int) -> Callable[[ModelRole], EngineSpec]:
    """A frozen role's engine spec (inference micro-batches only: RL's reference and reward model, DPO's
    reference)."""
    return lambda role: spec_from_config(cfg.model, cfg.optim, cfg.topology, 0.0, total_steps, trainable=False,
                                         group_size=role.size)


def build_roles(cfg, groups: Groups, device, total_steps: int) -> Roles:
    """Role objects on every rank from the plan; engines built on the members only."""
    from .actor import Actor
    from .critic_role import Critic, load_critic
    from .ppo_update import update_settings
    from .reference import build_reference

    m, o, t = cfg.model, cfg.optim, cfg.topology
    path = resolve_pretrain(m.pretrain)
    settings = update_settings(cfg)

    def trainable(lr):
        return lambda role: spec_from_config(cfg.model, cfg.optim, cfg.topology, lr, total_steps)

    actor = model_role(Actor, "actor", groups, t.backend, device, trainable(o.actor_learning_rate),
                       lambda on_meta: load_causal_lm(path, m.bf16, m.flash_attn, m.gradient_checkpointing, m.lora_rank,
                                                      m.lora_alpha, m.target_modules, on_meta=on_meta),
                       algo=cfg.algorithm, settings=settings)
    ref = build_reference(cfg, groups, path, device, total_steps)
    if m.lm_head_fp32:  # the actor's and the reference's log-probs from float32 logits
        for r in (actor, ref):
            if r is not None and r.engine is not None:
                use_fp32_head(r.engine.model)
    critic = model_role(Critic, "critic", groups, t.backend, device, trainable(o.critic_learning_rate),
                        lambda on_meta: load_critic(cfg, path, on_meta), algo=cfg.algorithm, settings=settings)
    stats = {}

    def load_rm(on_meta):
        rm, stats["v"] = load_reward_model(m.reward_pretrain, m.bf16, m.flash_attn, on_meta=on_meta,
                                            value_head_prefix=m.value_head_prefix)
        return rm

    reward = model_role(ModelRole, "reward", groups, t.backend, device, frozen_spec(cfg, total_steps), load_rm)
    if cfg.rollout.async_train:  # the rollout ranks of their own generate meanwhile (rlhf.trainers.async_rollout)
        for r in (actor, ref, critic, reward):
            if r is not None:
                r.gather_group = groups.group("trainers")
    rollout = RolloutRole("rollout", groups.mesh("rollout"))
    if rollout.is_member:
        rollout.engine = build_rollout_engine(cfg.rollout, cfg.topology, path, groups, device, bf16=m.bf16,
                                              seed=cfg.optim.seed, max_model_len=rl_max_len(cfg))
        if cfg.rollout.agent_func_path:
            from rlhf.agents.load import load_agent

            inst, exe = load_agent(cfg.rollout.agent_func_path)
            rollout.agent = exe(inst, cfg.rollout.max_steps, cfg.data.generate_max_len * cfg.rollout.max_steps,
                                rollout.engine, load_tokenizer(path))
    from .advantage_stage import reward_model_stats

    return Roles(actor=actor, rollout=rollout, ref=ref, critic=critic, reward=reward,
                 reward_stats=reward_model_stats(cfg, stats.get("v")))


def rl_max_len(cfg) -> int:
    """Prompt + response tokens of one sample: --prompt_max_len + --generate_max_len, within RL's --max_len (OpenRLHF's
    prompt + response budget, its vLLM max_model_len; rlhf.config.openrlhf_meaning)."""
    d = cfg.data
    return min(d.prompt_max_len + d.generate_max_len, d.max_len)


def build_rollout_engine(r, t, path: str, groups: Groups, device, *, bf16: bool, seed: int, max_model_len: int):
    """The rollout engine of this rank, from the registry (rlhf.rollout.registry): --rollout_engine, or what
    ``auto`` picks (said once, by rank 0), built from the engine's flags (``r`` the rollout config, ``t`` the
    topology; ``seed`` --seed: engine i gets seed + i) and its place in the placement."""
    kind = r.rollout_engine
    if kind == "auto":
        kind, why = auto_engine(path, torch.cuda.is_available())
        if groups.rank == 0:
            print(f"[rollout] --rollout_engine auto -> {kind} ({why})", flush=True)
    plan = groups.plan
    index = plan.engine_of(groups.rank)
    place = EnginePlace(groups.rank, plan.engine_ranks[index], tp_group=groups.mesh("rollout").group_of("tp"),
                        # in-process vLLM takes the whole default group as its world: only when every rank holds one
                        separate=plan.ranks["rollout"] != list(range(plan.world_size)),
                        gpus_per_node=plan.gpus_per_node)
    args = EngineArgs(path, device, max_model_len, seed=seed + index, bf16=bf16,
                      micro_batch_size=r.micro_rollout_batch_size, tp_size=t.vllm_tensor_parallel_size,
                      gpu_memory_utilization=r.vllm_gpu_memory_utilization, enable_sleep=t.vllm_enable_sleep,
                      sleep_level=r.vllm_sleep_level, enforce_eager=r.enforce_eager, place=place)
    return build_engine(kind, args)
