"""One RL step as a list of declared stages: rollout -> reward -> (produce) -> ref -> values -> old log-probs ->
advantages -> critic update -> actor update -> (reward ahead) -> weight sync.

A stage declares its ``role`` (what the phase scheduler wakes; with ``share`` / ``tags`` what stays resident), the
``Batch`` fields it ``reads`` and ``writes``, whether rollout ranks of their own skip it under --async_train
(``trainers_only``) and its watchdog deadline (``deadline_s``; None: the default), and runs as
``run(batch, roles)``: it never sees the trainer.  What it needs besides (forwards, scorer, scheduler, ...) it is
given when ``build_stages`` builds the list, which also decides once which stages apply, from the config and the
placement (shared by every rank, never a rank's own data).  The trainer's loop and the watchdog's deadlines
(``stage_deadlines``) read this one list; each class's role, share, tags and memory kind come from its row of
rlhf.stage_table, the declaration the memory planner plans from.  Inside a stage the
role's members compute their shard and the rows are gathered to every rank (``Role`` methods), so after each
stage every rank holds the same batch.  The loop's shape follows torchtitan
torchtitan/experiments/rl/controller.py (each phase says what it consumes and what it waits for); the build, the
components' own ``from_config``, torchtitan torchtitan/config/configurable.py (a Config that ``build()``s its part).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from rlhf.batch import Batch, cat, row_fields
from rlhf.console import print0
from rlhf.data.images import row_images
from rlhf.distributed.role_table import ROLE_TABLE
from rlhf.rl.advantage_stage import _gap_metric, advantage_stage, needs_old_logprobs
from rlhf.rl.components import Forwards, Rollouts, Sampler, Scorer, gap_due, measures_gap_only, on_policy_single_update, refills
from rlhf.rl.stage import Stage
from rlhf.roles.routing import route_metrics

ROLLOUT = tuple(row_fields("rollout"))
REWARD = tuple(row_fields("reward"))


class RolloutStage(Stage):
    name, writes = "rollout", ROLLOUT

    def __init__(self, rollouts: Rollouts, sampler: Sampler, scheduler, queue=None, deadline_s=None):
        self.rollouts, self.sampler, self.scheduler, self.queue = rollouts, sampler, scheduler, queue
        self.deadline_s = deadline_s

    def run(self, batch: Batch, roles) -> None:
        if self.queue is not None:  # generated ahead (rlhf.rl.async_queue): gathered now
            self.queue.take(batch)
            batch.pixel_values, batch.image_grid_thw = row_images(batch.prompts, batch.n_samples)
            return
        roles.rollout.take_agent_metrics()  # an eval's episodes are not this step's
        batch.fill(self.rollouts.generate(roles, batch.prompts, self.sampler.params(batch.step)))
        batch.metrics.update(roles.rollout.take_agent_metrics())  # turns, latency, occupancy (agent/*), tools (tool/*)
        if batch.pixel_values is None:  # VLM prompts' images (agent rows bring their episodes' own)
            batch.pixel_values, batch.image_grid_thw = row_images(batch.prompts, batch.n_samples)
        self.scheduler.sync_follows("rollout")  # the step's weight sync comes before the next generate: vLLM
        # sleeps level 2


class RewardStage(Stage):
    # async: streamed as the groups completed, or scored ahead (``reward_ahead``): then this stage does not apply
    name, reads, writes, trainers_only = "reward", ("sequences", "prompts"), REWARD, True

    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    def run(self, batch: Batch, roles) -> None:
        batch.fill(self.scorer.score(batch, roles, batch.labels), REWARD)


@dataclass
class Refill:
    """Dynamic filtering with refill (--dynamic_filtering_reward_range, --dynamic_filtering_max_rounds), a draw
    of ``k`` more prompts (``draw(step, round, k)``), each round's deadline ``round_s``."""
    reward_range: Tuple[float, float]
    max_rounds: int
    draw: Callable
    round_s: float


class RefillRolloutStage(Stage):
    """Dynamic sampling with refill (DAPO / OpenRLHF): generate and score; keep the prompt groups whose mean score
    lies inside --dynamic_filtering_reward_range; while fewer than --rollout_batch_size groups passed, generate for
    more prompts (as many as the observed pass rate says are needed), up to --dynamic_filtering_max_rounds extra
    rounds.  The batch then holds the first rollout_batch_size kept groups; if it still is not full, filtered
    groups fill it and stay masked out of the loss (counted in ``filtered_frac``).

    Every decision reads gathered scores, the same on every rank, so every rank runs the same rounds."""
    name, writes = "rollout_refill", ROLLOUT + REWARD + ("prompts",)

    def __init__(self, rollouts: Rollouts, scorer: Scorer, sampler: Sampler, scheduler, watchdog, refill: Refill,
                 deadline_s: float):
        self.rollouts, self.scorer, self.sampler = rollouts, scorer, sampler
        self.scheduler, self.watchdog, self.refill, self.deadline_s = scheduler, watchdog, refill, deadline_s

    def _round(self, roles, prompts: list, n: int, step: int, rounds: int) -> Batch:
        """One round's rows with their rewards: generation + scoring under the round's own deadline."""
        with self.watchdog.phase(f"rollout_refill round {rounds + 1}", deadline_s=self.refill.round_s):
            with self.scheduler.phase("rollout", role="rollout"):
                batch = self.rollouts.generate(roles, prompts, self.sampler.params(step, salt=rounds))
            # a reward function holds no device memory: the engine stays awake while it scores, so another round
            # generates with nothing moved, and only the last round's sleep comes, at level 2 (a sync follows it);
            # a reward model on this rank needs the device: the engine sleeps, at level 2 in the last allowed round
            rm_here = "reward" in self.scheduler.roles
            if rm_here and rounds + 1 > self.refill.max_rounds:
                self.scheduler.sync_follows("rollout")
            with self.scheduler.phase("reward", role="reward", share=None if rm_here else "rollout"):
                labels = [p.label for p in prompts for _ in range(n)]
                return batch.fill(self.scorer.score(batch, roles, labels), REWARD)

    def run(self, st: Batch, roles) -> None:
        from rlhf.algorithms import dynamic_filter_mask, dynamic_filter_refill

        f, n, target = self.refill, st.n_samples, len(st.prompts)
        prompts, kept, spare = st.prompts, [], []   # (prompt, its rows with their rewards) pieces, one group each
        rounds = seen = passed = 0
        while True:  # each round its own deadline; the stage's deadline is the sum over the rounds
            batch = self._round(roles, prompts, n, st.step, rounds)
            keep = dynamic_filter_mask(batch.scores, n, f.reward_range, batch.valid).view(-1, n)[:, 0]
            for g, ok in enumerate(keep.tolist()):
                (kept if ok else spare).append((prompts[g], batch.select(torch.arange(g * n, (g + 1) * n))))
            seen, passed, rounds = seen + len(prompts), passed + int(keep.sum()), rounds + 1
            if len(kept) >= target or rounds > f.max_rounds:
                self.scheduler.sync_follows("rollout")  # the step's weight sync comes before the next generate
                break
            prompts = f.draw(st.step, rounds, dynamic_filter_refill(len(kept), target, passed / seen,
                                                                    max_extra=4 * target))
        if len(kept) < target:
            print0(f"[dynamic filtering] step {st.step + 1}: {len(kept)} of {target} prompt groups passed "
                 f"--dynamic_filtering_reward_range {tuple(f.reward_range)} after {rounds} rounds ({seen} prompts); "
                 f"the other {target - len(kept)} train nothing (masked). If this repeats, widen the range or raise "
                 f"--dynamic_filtering_max_rounds")
        chosen = (kept + spare)[:target]
        st.prompts = [c[0] for c in chosen]
        st.fill(cat([c[1] for c in chosen], self.rollouts.pad_id))
        if st.pixel_values is None:  # the chosen prompts' images (VLM; agent rows bring their episodes' own)
            st.pixel_values, st.image_grid_thw = row_images(st.prompts, n)
        st.metrics.update({"dynamic_filter_rounds": float(rounds), "dynamic_filter_pass_rate": passed / seen,
                           "dynamic_filter_generated_prompts": float(seen)})
        st.metrics.update(roles.rollout.take_agent_metrics())  # every round's episodes (agent/*, tool/*)


class ProduceStage(Stage):
    """Async: the rollout ranks generate the batch of step t + K now, with this step's weights, while the actor
    ranks train on this one (no collective: the batch is gathered when its step comes)."""
    name = "produce"

    def __init__(self, queue, k: int, total_steps: int, deadline_s: float):
        self.queue, self.k, self.total, self.deadline_s = queue, k, total_steps, deadline_s

    def run(self, batch: Batch, roles) -> None:
        if batch.step + self.k < self.total:
            self.queue.produce(batch.step, batch.step + self.k)


class RewardAheadStage(ProduceStage):
    """Async with a reward model: the batch ``produce`` just made goes to the reward model's ranks and is scored
    there (``AsyncRollout.score_ahead``), after the updates: a reward model on ranks of its own (or the critic's)
    scores while the actor trains, one on the actor's ranks scores while the actor would wait for the engines at
    the weight sync anyway.  The rollout and reward ranks take part; the others pass."""
    name = "reward_ahead"

    def run(self, batch: Batch, roles) -> None:
        if batch.step + self.k < self.total:  # the produce stage made a batch this step
            self.queue.score_ahead(1)


class ForwardStage(Stage):
    """``role``'s no-grad forward over the batch, gathered to every rank, into the field it ``writes``."""
    trainers_only = True
    reads = ("sequences", "attention_mask", "action_mask")

    def __init__(self, forwards: Forwards):
        self.forwards = forwards

    def run(self, batch: Batch, roles) -> None:
        role = getattr(roles, self.role)
        setattr(batch, self.writes[0], self.forward(role, batch))
        batch.metrics.update(route_metrics(role))  # MoE: router/<ref|old>_mismatch (rlhf.roles.routing)

    def forward(self, role, batch: Batch):
        return self.forwards.logprobs(role, batch)


class RefStage(ForwardStage):
    name, writes = "ref", ("ref_logprobs",)


class DeclaredForwardStage(ForwardStage):
    """A role's log-probs of the sampled tokens into the field its declaration names (rlhf.distributed.role_table
    ``RoleDecl.forward``): stage ``name`` = its role's."""

    def __init__(self, forwards: Optional[Forwards], decl):
        super().__init__(forwards)
        # declared by its role (not a row of rlhf.stage_table): planned as a forward, after the reference's
        self.name, self.role, self.writes, self.memory = decl.name, decl.name, (decl.forward,), "forward"


def declared_forwards(forwards: Optional[Forwards], has: Dict[str, bool]) -> List[Stage]:
    """The declared forward stages of the roles the job has (every declared one where ``has`` is None)."""
    return [DeclaredForwardStage(forwards, d) for d in ROLE_TABLE.values()
            if d.forward and (has is None or has.get(d.name))]


class ValuesStage(ForwardStage):
    name, writes = "values", ("values",)

    def forward(self, role, batch: Batch):
        return self.forwards.run(role, batch, role.values)


class OldLogprobsStage(ForwardStage):
    name, writes = "old_logprobs", ("old_logprobs",)

    def run(self, batch: Batch, roles) -> None:
        super().run(batch, roles)
        if roles.actor.records_routing:  # --router_replay R2: the update replays this forward's routing
            batch.routed_experts = roles.actor.recorded


class LogprobGapStage(Stage):
    """issue 26 item 4: on-policy single-update steps skip the trainer's own log-prob forward, so nothing compares
    the rollout engine's log-probs with the trainer's (a stale vLLM LM head went unseen).  On the steps ``gap_due``
    names, the actor group runs that forward on the rollout batch (every member, SPMD; the other ranks take the
    gather) and logs ``rollout_logprob_gap`` (advantage_stage._gap_metric, the same definition as on the steps that
    compute old log-probs).  The log-probs serve the metric only: ``old_logprobs`` stays None, so the update is
    the same with the measurement as without it.  No stage role: it opens its own scheduler phase when due."""
    name, trainers_only, reads = "logprob_gap", True, ("sequences", "rollout_logprobs", "action_mask")

    def __init__(self, forwards: Forwards, scheduler, interval: int):
        self.forwards, self.scheduler, self.interval = forwards, scheduler, interval

    def run(self, batch: Batch, roles) -> None:
        if not gap_due(self.interval, batch.step):
            return
        with self.scheduler.phase("logprob_gap", role="actor"):
            lp = self.forwards.logprobs(roles.actor, batch)
        batch.metrics.update(_gap_metric(lp, batch.rollout_logprobs, batch.action_mask.float()))


class AdvantagesStage(Stage):
    """rlhf.rl.advantage_stage on the gathered batch (no collective)."""
    name, trainers_only = "advantages", True
    reads = REWARD + ("action_mask", "truncated", "rollout_logprobs", "old_logprobs", "ref_logprobs", "values")
    writes = ("action_mask", "advantages", "returns")

    def __init__(self, algorithm, generate_max_len: int, group_size: int, reward_norm, guard):
        self.algorithm, self.generate_max_len, self.group_size = algorithm, generate_max_len, group_size
        self.reward_norm, self.guard = reward_norm, guard

    def run(self, batch: Batch, roles) -> None:
        out = advantage_stage(self.algorithm, batch, batch.kl_coef, self.generate_max_len, self.group_size,
                              self.reward_norm, self.guard)
        batch.fill(out, self.writes)
        batch.metrics.update(out.metrics)


class UpdateStage(Stage):
    """The critic's or the actor's optimizer steps on the batch (its members; the others pass).  The actor's
    waits --freezing_actor_steps (the step counter is shared: every rank skips alike)."""
    trainers_only = True
    reads = ("sequences", "attention_mask", "action_mask", "advantages", "returns", "old_logprobs", "ref_logprobs",
             "rollout_logprobs", "values")

    def __init__(self, role: str, frozen_steps: int = 0):
        self._declare(self, f"{role}_update")
        self.frozen = frozen_steps

    def run(self, batch: Batch, roles) -> None:
        r = getattr(roles, self.role)
        if batch.step < self.frozen or not r.is_member:
            return
        batch.metrics.update(r.update(batch, batch.kl_coef, batch.step))


def sync_weights(weight_sync, roles) -> None:
    """Actor -> rollout engines.  Colocated: every rank; separate: the actor and rollout ranks."""
    actor, rollout = roles.actor, roles.rollout
    if actor.is_member or rollout.is_member:
        weight_sync.sync(actor.engine.model if actor.is_member else None)


class WeightSyncStage(Stage):
    name = "weight_sync"

    def __init__(self, weight_sync, deadline_s: Optional[float]):
        self.weight_sync, self.deadline_s = weight_sync, deadline_s

    def run(self, batch: Batch, roles) -> None:
        sync_weights(self.weight_sync, roles)
        batch.metrics.update(self.weight_sync.last)  # sync_bytes, sync_s, sync_GBps on the ranks that synced


@dataclass
class StageParts:
    """What the stages are built from besides the config: the placement's roles (``has``: role -> exists), the
    components, and the watchdog's timeouts (default, slow, one refill round and a whole refill)."""
    has: Dict[str, bool]
    agent_mode: bool
    reward_source: Optional[Callable]
    forwards: Forwards
    rollouts: Rollouts
    scorer: Scorer
    sampler: Sampler
    scheduler: object
    watchdog: object
    weight_sync: object
    reward_norm: object
    guard: object
    queue: object
    refill_draw: Callable
    total_steps: int
    timeouts: Tuple[float, float, float, float]
    # distillation (rlhf.rl.opd ``distill_stages``): a remote teacher's forward, after the declared ones; the OPD
    # term, after the advantages
    distill: Tuple[Sequence[Stage], Sequence[Stage]] = ((), ())


def rewards_ahead(async_train: bool, agent_mode: bool, reward_model: bool, reward_source: bool) -> bool:
    """--async_train takes the rewards with the batch (streamed by the rollout ranks, or scored ahead by a reward
    model): no reward stage.  From config and placement: the same on every rank."""
    from rlhf.rl.async_queue import scores_ahead, streams_rewards

    return async_train and (streams_rewards(agent_mode, reward_model, reward_source)
                            or scores_ahead(agent_mode, reward_model))


def build_stages(r, a, o, logging, data, p: StageParts) -> List[Stage]:
    """The stages of one RL step that apply here, in order: decided once, from the flags of the rollout (``r``),
    algorithm (``a``), optim (``o``), logging and data groups (rlhf.config.schema) and the placement (``p.has``)."""
    default_s, slow_s, round_s, refill_s = p.timeouts
    wait_s = slow_s + default_s if r.async_train else None  # async: waits for the rollout ranks' produce
    refill = refills(a, r.async_train)
    old_logprobs = needs_old_logprobs(a, on_policy_single_update(r, o, a))
    out: List[Optional[Stage]] = [
        None if refill else RolloutStage(p.rollouts, p.sampler, p.scheduler, p.queue, slow_s),
        None if refill or rewards_ahead(r.async_train, p.agent_mode, p.has["reward"], p.reward_source is not None)
        else RewardStage(p.scorer),
        RefillRolloutStage(p.rollouts, p.scorer, p.sampler, p.scheduler, p.watchdog,
                           Refill(tuple(a.dynamic_filtering_reward_range), a.dynamic_filtering_max_rounds,
                                  p.refill_draw, round_s), refill_s) if refill else None,
        ProduceStage(p.queue, r.async_queue_size, p.total_steps, slow_s) if r.async_train else None,
        RefStage(p.forwards) if p.has["ref"] else None,
        *[s for s in declared_forwards(p.forwards, p.has) if s.name not in {d.name for d in p.distill[0]}],
        *p.distill[0],  # a distillation stage named for a role stands in for its declared forward (--opd_topk)
        ValuesStage(p.forwards) if p.has["critic"] else None,
        OldLogprobsStage(p.forwards) if old_logprobs else None,
        LogprobGapStage(p.forwards, p.scheduler, logging.logprob_gap_interval)
        if measures_gap_only(logging.logprob_gap_interval, old_logprobs) else None,
        AdvantagesStage(a, data.generate_max_len, r.n_samples_per_prompt, p.reward_norm, p.guard), *p.distill[1],
        UpdateStage("critic") if p.has["critic"] else None,
        UpdateStage("actor", o.freezing_actor_steps),
        RewardAheadStage(p.queue, r.async_queue_size, p.total_steps, wait_s)
        if r.async_train and p.has["reward"] else None,
        WeightSyncStage(p.weight_sync, wait_s),
    ]
    return [s for s in out if s is not None]


def stage_deadlines(stages: Sequence[Stage]) -> Dict[str, float]:
    """The watchdog's deadline per stage name, from the stages that declare one."""
    return {s.name: s.deadline_s for s in stages if s.deadline_s is not None}


def memory_stages() -> Dict[str, List[Tuple[str, str]]]:
    """(stage name, role) of the stage classes the memory planner plans, by memory kind ("rollout", "forward",
    "update", "sync"), in the loop's order: every one that may apply (the planner keeps those whose role the job
    has).  The classes take these from rlhf.stage_table, the list the planner reads."""
    every = [RolloutStage, RewardStage, RefStage, *declared_forwards(None, None), ValuesStage, OldLogprobsStage, UpdateStage("critic"),
             UpdateStage("actor"), WeightSyncStage]
    out: Dict[str, List[Tuple[str, str]]] = {"rollout": [], "forward": [], "update": [], "sync": []}
    for s in every:
        out[s.memory].append((s.name, s.role))
    return out
