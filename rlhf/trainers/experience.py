"""One RL step as a list of stages: rollout -> reward -> (produce) -> ref -> values -> old log-probs -> advantages
-> critic update -> actor update -> (reward ahead) -> weight sync.

Every rank runs every stage that applies, in this order; whether a stage applies is
decided from the config and the placement, which every rank shares, never from a
rank's own data.  Inside a stage, the role's members compute their shard and the
rows are gathered to every rank (``Role`` methods), so after each inference stage
every rank holds the same full tensors.  A new role or stage is added here, in one
place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from rlhf.distributed.sharding import all_gather_objects, gather_rows, shard_rows
from rlhf.rollout.base import RolloutBatch

from .advantage_stage import StageInputs, _gap_metric, advantage_stage, needs_old_logprobs
from .async_rollout import rewards_ahead
from .cadence import log0


@dataclass
class Experience:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: Optional[torch.Tensor]
    ref_logprobs: Optional[torch.Tensor]
    values: Optional[torch.Tensor]
    advantages: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor
    metrics: Dict[str, float] = field(default_factory=dict)

    def rows(self, idx) -> Experience:
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return Experience(*(pick(getattr(self, f)) for f in (
            "sequences", "attention_mask", "action_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs", "values",
            "advantages", "returns", "scores")), metrics={})


@dataclass
class StepState:
    """What one step accumulates, stage by stage (identical on every rank after each stage)."""
    step: int
    prompts: list
    n_samples: int
    kl_coef: float = 0.0
    batch: Optional[RolloutBatch] = None
    rewards: Optional[dict] = None
    ref_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    experience: Optional[Experience] = None
    metrics: Dict[str, float] = field(default_factory=dict)

    @property
    def labels(self) -> List:
        return [p.label for p in self.prompts for _ in range(self.n_samples)]


@dataclass
class Stage:
    name: str
    run: Callable                     # run(trainer, state)
    role: Optional[str] = None        # the role the phase scheduler wakes (None: no model)
    applies: Callable = lambda tr: True  # from shared state only (config, placement)
    share: Optional[str] = None
    tags: Optional[List[str]] = None
    # the rollout ranks of their own skip it under --async_train (they generate meanwhile): its collectives run
    # over the model roles' ranks only (Groups.trainers); from the placement, so the same on every rank of a kind
    trainers_only: bool = False


def inference_rows(cfg) -> int:
    """Rows (samples) per inference forward (ref, old log-probs, values, reward model) on one rank:
    --micro_rollout_batch_size, which counts samples as in OpenRLHF (its make_experience splits the samples
    into micro-batches of micro_rollout_batch_size)."""
    return cfg.rollout.micro_rollout_batch_size


class InferencePlan:
    """--use_dynamic_batch for one inference forward of a role (ref / old log-probs / values / reward model): the
    batch's rows over the role's DP ranks by tokens and into micro-batches of at most --rollout_max_tokens_per_gpu
    (rlhf.algorithms.seqlen_balancing.plan_step; OpenRLHF's experience maker splits its rollout samples with the
    same functions, openrlhf/trainer/ppo_utils/experience_maker.py ``split_rollout_samples``).

    Rows are reordered (``perm``) so that each DP rank's rows, and each of its micro-batches, are contiguous:
    ``rows(i)`` / ``plan(i)`` are slices of the permuted batch, which ``ModelRole.rows_forward`` runs and
    gathers as usual; the caller puts the output back in the batch's order (``inverse``).  Packed forwards cost
    their real tokens; padded ones (values, reward model, unpacked log-probs) every column of the batch's width,
    so there a budget fixes the rows per forward (budget // width), like --micro_rollout_batch_size."""

    def __init__(self, batch: RolloutBatch, size: int, budget: int, packed: bool):
        from rlhf.algorithms.seqlen_balancing import Item, plan_step

        from .ppo_update import row_items

        width = batch.sequences.size(1)
        items = row_items(batch.attention_mask, batch.action_mask) if packed else \
            [Item(0, width)] * batch.sequences.size(0)
        _, micro = plan_step(items, size, budget, packed)
        order: List[int] = []
        self._rows, self._micro = [], []
        for parts in micro:
            start, mine = len(order), []
            for m in parts:
                if m is not None:
                    order += m
                mine.append(None if m is None else slice(len(order) - len(m), len(order)))
            self._rows.append(slice(start, len(order)))
            self._micro.append(mine)
        self.perm = torch.tensor(order, dtype=torch.long)
        self.inverse = torch.argsort(self.perm)

    def plan(self, index: int) -> List[Optional[slice]]:
        return self._micro[index]

    def rows(self, index: int) -> slice:
        return self._rows[index]


def inference_forward(cfg, role, batch: RolloutBatch, call: Callable, packed: bool = False) -> torch.Tensor:
    """``call(batch, micro)`` (a role's logprobs / values / scores) with fixed micro-batches of
    --micro_rollout_batch_size rows, or under --use_dynamic_batch on the batch reordered by an ``InferencePlan``
    and put back in order.  The plan is a function of the batch, which every rank holds: the same on every rank."""
    if not cfg.optim.use_dynamic_batch:
        return call(batch, inference_rows(cfg))
    from rlhf.config.batching_checks import row_budgets

    plan = InferencePlan(batch, role.dp_size, row_budgets(cfg)[1], packed)
    return call(batch.select(plan.perm), plan)[plan.inverse]


def on_policy_single_update(cfg) -> bool:
    """One epoch and one optimizer step per rollout batch, and no async lag: old log-probs equal the current ones.

    With --enable_is_correction the old log-probs are still needed (they are the IS numerator), so not then.
    """
    r, o, a = cfg.rollout, cfg.optim, cfg.algorithm
    return (o.max_epochs == 1 and r.rollout_batch_size * r.n_samples_per_prompt == o.train_batch_size
            and not r.async_train and not a.enable_is_correction)


def logprob_temperature(cfg) -> float:
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


# ---- stages ------------------------------------------------------------------------------------------------------
def rollout_stage(tr, st: StepState) -> None:
    if tr.async_rollout is not None:  # generated ahead (rlhf.trainers.async_rollout): gathered now
        st.batch = tr.async_rollout.take(st)
        return
    local = tr.roles.rollout.generate(st.prompts, tr.sampling(st.step))
    st.batch = gathered_rollout(tr, local, st.prompts, st.n_samples)
    tr.scheduler.sync_follows("rollout")  # the step's weight sync comes before the next generate: vLLM sleeps level 2


def gathered_rollout(tr, local: Optional[RolloutBatch], prompts: list, n_samples: int) -> RolloutBatch:
    """The full batch of these prompts' samples on every rank, from this rank's generated rows (collective)."""
    return tr.roles.rollout.gather(local, len(prompts), n_samples, tr.tokenizer.pad_token_id,
                                   with_rewards=tr.agent_mode)


def score_batch(tr, batch: RolloutBatch, labels: List) -> dict:
    """{rewards, scores, valid, extra_logs} for every row, on every rank (collective)."""
    n = batch.sequences.size(0)
    if tr.agent_mode:  # agent rollouts: the environment already scored every row
        r = batch.rewards
        return {"rewards": r, "scores": batch.scores, "valid": torch.isfinite(r), "extra_logs": {}}
    if tr.roles.reward is not None:  # gathered over the world: every rank calls this (under --async_train too,
        # where only the eval does: the train batches are scored ahead)
        r = inference_forward(tr.cfg, tr.roles.reward, batch,
                              lambda b, micro: tr.roles.reward.scores(b, micro, tr.roles.reward_stats, over=None))
        return {"rewards": r, "scores": r, "valid": torch.ones_like(r, dtype=torch.bool), "extra_logs": {}}
    # a reward function: every rank calls it on its share of the rows (remote servers see parallel requests)
    sl = shard_rows(n, tr.rank, tr.world)
    res = None
    if sl.stop > sl.start:
        queries, prompts = decode_queries(tr.tokenizer, batch, sl)
        with tr.watchdog.phase("reward_function"):  # its own phase: the watchdog report tells it from the gather
            res = tr.reward_source(queries, prompts, labels[sl])
    ints = gather_rows(None if res is None else res["valid"].long(), sl, n, 1, torch.long)
    cols = gather_rows(None if res is None else torch.stack([res["rewards"], res["scores"]], 1), sl, n, 2)
    keys = sorted({k for ks in all_gather_objects(sorted(res["extra_logs"]) if res else []) for k in ks})
    extra = {}
    for k in keys:
        v = None if res is None or k not in res["extra_logs"] else res["extra_logs"][k].float()
        extra[k] = gather_rows(v, sl, n, 1).squeeze(1)
    return {"rewards": cols[:, 0], "scores": cols[:, 1], "valid": ints[:, 0].bool(), "extra_logs": extra}


def reward_stage(tr, st: StepState) -> None:
    st.rewards = score_batch(tr, st.batch, st.labels)


def _take(res: dict, rows: torch.Tensor) -> dict:
    return {"rewards": res["rewards"][rows], "scores": res["scores"][rows], "valid": res["valid"][rows],
            "extra_logs": {k: v[rows] for k, v in res["extra_logs"].items()}}


def _cat(parts: List[dict]) -> dict:
    keys = set.intersection(*(set(p["extra_logs"]) for p in parts))
    return {"rewards": torch.cat([p["rewards"] for p in parts]), "scores": torch.cat([p["scores"] for p in parts]),
            "valid": torch.cat([p["valid"] for p in parts]),
            "extra_logs": {k: torch.cat([p["extra_logs"][k] for p in parts]) for k in sorted(keys)}}


def refill_rollout_stage(tr, st: StepState) -> None:
    """Dynamic sampling with refill (DAPO / OpenRLHF): generate and score; keep the prompt groups whose mean score
    lies inside --dynamic_filtering_reward_range; while fewer than --rollout_batch_size groups passed, generate for
    more prompts (as many as the observed pass rate says are needed), up to --dynamic_filtering_max_rounds extra
    rounds.  The batch then holds the first rollout_batch_size kept groups; if it still is not full, filtered
    groups fill it and stay masked out of the loss (counted in ``filtered_frac``).

    Every decision reads gathered scores, the same on every rank, so every rank runs the same rounds."""
    from rlhf.algorithms import dynamic_filter_mask, dynamic_filter_refill
    from rlhf.rollout.base import merge_batches

    a, n, target = tr.cfg.algorithm, st.n_samples, len(st.prompts)
    pad = tr.tokenizer.pad_token_id
    prompts, kept, spare = st.prompts, [], []   # (prompts, batch, rewards) pieces, one group each
    rounds = seen = passed = 0
    while True:
        # each round its own deadline (generation + scoring); the stage's deadline is the sum over the rounds
        with tr.watchdog.phase(f"rollout_refill round {rounds + 1}", deadline_s=tr.refill_round_s):
            with tr.scheduler.phase("rollout", role="rollout"):
                local = tr.roles.rollout.generate(prompts, tr.sampling(st.step, salt=rounds))
                batch = gathered_rollout(tr, local, prompts, n)
            # a reward function holds no device memory: the engine stays awake while it scores, so another round
            # generates with nothing moved, and only the last round's sleep comes, at level 2 (a sync follows it);
            # a reward model on this rank needs the device: the engine sleeps, at level 2 in the last allowed round
            rm_here = "reward" in tr.scheduler.roles
            if rm_here and rounds + 1 > a.dynamic_filtering_max_rounds:
                tr.scheduler.sync_follows("rollout")
            with tr.scheduler.phase("reward", role="reward", share=None if rm_here else "rollout"):
                res = score_batch(tr, batch, [p.label for p in prompts for _ in range(n)])
        keep = dynamic_filter_mask(res["scores"], n, a.dynamic_filtering_reward_range, res["valid"]).view(-1, n)[:, 0]
        for g, ok in enumerate(keep.tolist()):
            rows = torch.arange(g * n, (g + 1) * n)
            piece = (prompts[g], batch.select(rows), _take(res, rows))
            (kept if ok else spare).append(piece)
        seen, passed, rounds = seen + len(prompts), passed + int(keep.sum()), rounds + 1
        if len(kept) >= target or rounds > a.dynamic_filtering_max_rounds:
            tr.scheduler.sync_follows("rollout")  # the step's weight sync comes before the next generate
            break
        extra = dynamic_filter_refill(len(kept), target, passed / seen, max_extra=4 * target)
        prompts = tr.refill_prompts(st.step, rounds, extra)
    if len(kept) < target:
        log0(f"[dynamic filtering] step {st.step + 1}: {len(kept)} of {target} prompt groups passed "
               f"--dynamic_filtering_reward_range {tuple(a.dynamic_filtering_reward_range)} after {rounds} rounds "
               f"({seen} prompts); the other {target - len(kept)} train nothing (masked). If this repeats, widen the "
               f"range or raise --dynamic_filtering_max_rounds")
    chosen = (kept + spare)[:target]
    st.prompts = [c[0] for c in chosen]
    st.batch = merge_batches([c[1] for c in chosen], pad)
    st.rewards = _cat([c[2] for c in chosen])
    st.metrics.update({"dynamic_filter_rounds": float(rounds), "dynamic_filter_pass_rate": passed / seen,
                       "dynamic_filter_generated_prompts": float(seen)})


def ref_stage(tr, st: StepState) -> None:
    m = tr.cfg.model
    st.ref_logprobs = inference_forward(tr.cfg, tr.roles.ref, st.batch, lambda b, micro: tr.roles.ref.logprobs(
        b, logprob_temperature(tr.cfg), micro, m.logprob_chunk_size, m.packing_samples), m.packing_samples)


def values_stage(tr, st: StepState) -> None:
    st.values = inference_forward(tr.cfg, tr.roles.critic, st.batch, tr.roles.critic.values)


def old_logprobs_stage(tr, st: StepState) -> None:
    m = tr.cfg.model
    st.old_logprobs = inference_forward(tr.cfg, tr.roles.actor, st.batch, lambda b, micro: tr.roles.actor.logprobs(
        b, logprob_temperature(tr.cfg), micro, m.logprob_chunk_size, m.packing_samples), m.packing_samples)


def gap_due(cfg, step: int) -> bool:
    """Whether 0-based ``step`` measures ``rollout_logprob_gap`` where the old log-prob forward is skipped: the
    first step and every --logprob_gap_interval-th (1-based steps N, 2N, ...: the ones --logging_steps N logs).
    From the step number and the config only, so every rank decides alike."""
    n = cfg.logging.logprob_gap_interval
    return n > 0 and (step == 0 or (step + 1) % n == 0)


def measures_gap_only(tr) -> bool:
    """The old log-prob forward is skipped (one on-policy update, nothing else needs it) and --logprob_gap_interval
    asks for the gap now and then: the ``logprob_gap`` stage applies."""
    return (tr.cfg.logging.logprob_gap_interval > 0
            and not needs_old_logprobs(tr.cfg, on_policy_single_update(tr.cfg)))


def logprob_gap_stage(tr, st: StepState) -> None:
    """issue 26 item 4: on-policy single-update steps skip the trainer's own log-prob forward, so nothing compares
    the rollout engine's log-probs with the trainer's (a stale vLLM LM head went unseen).  On the steps ``gap_due``
    names, the actor group runs that forward on the rollout batch (every member, SPMD; the other ranks take the
    gather) and logs ``rollout_logprob_gap`` (advantage_stage._gap_metric, the same definition as on the steps that
    compute old log-probs).  The log-probs serve the metric only: ``st.old_logprobs`` stays None, so the update is
    the same with the measurement as without it."""
    if not gap_due(tr.cfg, st.step):
        return
    m = tr.cfg.model
    with tr.scheduler.phase("logprob_gap", role="actor"):
        lp = inference_forward(tr.cfg, tr.roles.actor, st.batch, lambda b, micro: tr.roles.actor.logprobs(
            b, logprob_temperature(tr.cfg), micro, m.logprob_chunk_size, m.packing_samples), m.packing_samples)
    st.metrics.update(_gap_metric(lp, st.batch.rollout_logprobs, st.batch.action_mask.float()))


def advantages_stage(tr, st: StepState) -> None:
    b, res = st.batch, st.rewards
    out = advantage_stage(tr.cfg, StageInputs(res["rewards"], res["scores"], res["valid"], b.action_mask, b.truncated,
                                              b.rollout_logprobs, st.old_logprobs, st.ref_logprobs, st.values,
                                              res["extra_logs"]), st.kl_coef, tr.reward_norm, tr.invalid_rewards)
    st.experience = Experience(b.sequences, b.attention_mask, out.train_mask, b.rollout_logprobs, st.old_logprobs,
                               st.ref_logprobs, st.values, out.advantages, out.returns, res["scores"], out.metrics)
    st.metrics.update(out.metrics)


def produce_stage(tr, st: StepState) -> None:
    """Async: the rollout ranks generate the batch of step t + K now, with this step's weights, while the actor
    ranks train on this one (no collective: the batch is gathered when its step comes)."""
    if st.step + tr.cfg.rollout.async_queue_size < tr.total_steps:
        tr.async_rollout.produce(st.step, st.step + tr.cfg.rollout.async_queue_size)


def reward_ahead_stage(tr, st: StepState) -> None:
    """Async with a reward model: the batch ``produce`` just made goes to the reward model's ranks and is scored
    there (``AsyncRollout.score_ahead``), after the updates: a reward model on ranks of its own (or the critic's)
    scores while the actor trains, one on the actor's ranks scores while the actor would wait for the engines at
    the weight sync anyway.  The rollout and reward ranks take part; the others pass."""
    if st.step + tr.cfg.rollout.async_queue_size < tr.total_steps:  # produce_stage made a batch this step
        tr.async_rollout.score_ahead(1)


def critic_update_stage(tr, st: StepState) -> None:
    c = tr.roles.critic
    if c.is_member:
        st.metrics.update(c.update(st.experience, st.kl_coef, st.step))


def actor_update_stage(tr, st: StepState) -> None:
    a = tr.roles.actor
    if st.step < tr.cfg.optim.freezing_actor_steps:  # the step counter is shared: every rank skips alike
        return
    if a.is_member:
        st.metrics.update(a.update(st.experience, st.kl_coef, st.step))


def weight_sync_stage(tr, st: StepState) -> None:
    tr.sync_weights()


def refills(cfg) -> bool:
    """Dynamic filtering refills the batch (synchronous rollouts; async ones filter each group as it completes and
    draw a new prompt in its place: rlhf.rollout.stream)."""
    a = cfg.algorithm
    return a.dynamic_filtering and a.dynamic_filtering_max_rounds > 0 and not cfg.rollout.async_train


def rl_stages() -> List[Stage]:
    """The stages of one RL step, in order; ``applies`` reads only config and placement (shared by every rank)."""
    return [
        Stage("rollout", rollout_stage, role="rollout", applies=lambda tr: not refills(tr.cfg)),
        Stage("reward", reward_stage, role="reward", applies=lambda tr: not refills(tr.cfg) and not rewards_ahead(tr),
              trainers_only=True),  # async: streamed as the groups completed, or scored ahead (``reward_ahead``)
        Stage("rollout_refill", refill_rollout_stage, applies=lambda tr: refills(tr.cfg)),
        Stage("produce", produce_stage, applies=lambda tr: tr.cfg.rollout.async_train),
        Stage("ref", ref_stage, role="ref", applies=lambda tr: tr.roles.ref is not None, trainers_only=True),
        Stage("values", values_stage, role="critic", applies=lambda tr: tr.roles.critic is not None,
              trainers_only=True),
        Stage("old_logprobs", old_logprobs_stage, role="actor",
              applies=lambda tr: needs_old_logprobs(tr.cfg, on_policy_single_update(tr.cfg)), trainers_only=True),
        Stage("logprob_gap", logprob_gap_stage, applies=measures_gap_only,  # its own scheduler phase, when due
              trainers_only=True),
        Stage("advantages", advantages_stage, trainers_only=True),
        Stage("critic_update", critic_update_stage, role="critic", applies=lambda tr: tr.roles.critic is not None,
              trainers_only=True),
        Stage("actor_update", actor_update_stage, role="actor", trainers_only=True),
        Stage("reward_ahead", reward_ahead_stage,
              applies=lambda tr: tr.cfg.rollout.async_train and tr.roles.reward is not None),
        Stage("weight_sync", weight_sync_stage, role="rollout", share="actor", tags=["weights"]),
    ]


def decode_queries(tokenizer, batch: RolloutBatch, sl: slice):
    """(query = prompt + response text, prompt text) for rows sl, decoded in one batch call each."""
    P = batch.prompt_len
    seq, att, am = batch.sequences[sl].tolist(), batch.attention_mask[sl, :P].tolist(), batch.action_mask[sl].tolist()
    p_ids = [[t for t, k in zip(s[:P], m) if k] for s, m in zip(seq, att)]
    r_ids = [[t for t, k in zip(s[P:], m) if k] for s, m in zip(seq, am)]
    prompts = tokenizer.batch_decode(p_ids, skip_special_tokens=False)
    responses = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
    return [p + r for p, r in zip(prompts, responses)], prompts
