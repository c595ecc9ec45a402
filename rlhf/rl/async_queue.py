"""--async_train on rollout ranks of their own: the queue of batches generated ahead (issue 29).

Timeline of one step t, with K = --async_queue_size:

- ``take`` (the rollout stage, every rank): the batch generated during step t - K (or during the warm-up) is
  gathered from the engines' first ranks to every rank.  From here on every rank holds the same batch, and
  everything that is trained is decided from it (SPMD): never from a rank's timing.
- the reference, values, old log-prob and advantage stages, as in a synchronous step; no reward stage: rewards
  came with the batch (streamed: scored on the rollout ranks as groups completed; a reward model: scored ahead);
- ``produce`` (every rank; work only on the engines' first ranks): the batch for step t + K, generated with this
  step's weights (version t) while the actor ranks go on to their updates;
- ``score_ahead`` (the reward_ahead stage, after the updates; rollout and reward-model ranks): with a reward model,
  the batch just produced is gathered to the reward model's ranks and scored there; ``take`` hands the scores on;
- the weight sync, where actor and rollout ranks meet.

A batch is trained K syncs after its generation started (partial rollouts: a sample's oldest token may be older,
bounded by --max_staleness).  The per-token weight versions travel with the batch; ``age_metrics`` logs how far
off-policy each step was, and IS correction (on by default here) weighs each token by trainer / rollout
probability.  The queue itself is not checkpointed: a resume restarts it (the K batches are generated again with
the resumed weights) and continues each engine's prompt stream where the checkpoint left it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from rlhf.algorithms import dynamic_filter_mask
from rlhf.batch import Batch, row_fields
from rlhf.console import print0
from rlhf.distributed.batch_gather import gather_batch
from rlhf.distributed.sharding import all_gather_objects, gather_rows, shard_rows
from rlhf.rl.stream import Group, RolloutStream, age_metrics, groups_to_batch, sample_ages


def streams_rewards(agent_mode: bool, reward_model: bool, reward_source: bool) -> bool:
    """Rewards come with each group from the rollout ranks as it completes: scored there by a reward function or
    server, or by an agent's environment (a reward model scores each batch ahead instead: ``scores_ahead``).
    From config and placement: the same on every rank."""
    return agent_mode or (not reward_model and reward_source)


def scores_ahead(agent_mode: bool, reward_model: bool) -> bool:
    """A reward model scores each batch as soon as the engines produced it, on its own ranks, while the actor
    trains (``AsyncRollout.score_ahead``); agents are scored by their environment (as ``Scorer.score`` does).
    From config and placement: the same on every rank."""
    return reward_model and not agent_mode


@dataclass
class QueueSettings:
    """The queue's flags: --async_queue_size (``k``), --n_samples_per_prompt, --rollout_batch_size,
    --vllm_generate_batch_size (oversampling), --partial_rollout / --partial_rollout_chunk (``chunk``, None: whole
    responses), --generate_max_len, --max_staleness, and dynamic filtering (range, rounds; None: off)."""
    k: int
    n: int
    batch: int
    generate_batch: int
    chunk: Optional[int]
    max_new_tokens: int
    max_staleness: int
    filter_range: Optional[tuple]
    filter_rounds: int

    @classmethod
    def from_config(cls, r, a, generate_max_len: int) -> QueueSettings:
        """From the rollout (``r``) and algorithm (``a``) groups and --generate_max_len."""
        chunk = (r.partial_rollout_chunk or max(1, generate_max_len // 4)) if r.partial_rollout else None
        return cls(r.async_queue_size, r.n_samples_per_prompt, r.rollout_batch_size, r.vllm_generate_batch_size,
                   chunk, generate_max_len, r.max_staleness,
                   tuple(a.dynamic_filtering_reward_range) if a.dynamic_filtering else None,
                   a.dynamic_filtering_max_rounds)


class AsyncRollout:
    """The queue (see the module docstring), built from its settings and the components it uses: the roles and
    process groups (``groups``: Groups), this ``rank``, the ``scorer`` (streamed rewards, ahead scores: its
    reward source, tokenizer, watchdog and forwards), the ``sampler``, ``prompts_for(step)`` (the step's shuffled
    prompts) and the pad id."""

    def __init__(self, s: QueueSettings, roles, groups, rank: int, scorer, sampler, prompts_for: Callable,
                 pad_id: int):
        self.s, self.roles, self.groups, self.rank = s, roles, groups, rank
        self.scorer, self.sampler, self.prompts_for, self.pad_id = scorer, sampler, prompts_for, pad_id
        self.k, self.n, self.batch = s.k, s.n, s.batch
        role = roles.rollout
        self.engines = len(role.engine_ranks)
        agent = scorer.agent_mode  # episodes run whole by the agent and scored by its environment (no partial
        # rollout)
        self.streamed = streams_rewards(agent, roles.reward is not None, scorer.reward_source is not None)
        self.ahead = scores_ahead(agent, roles.reward is not None)
        self.produced: deque = deque()   # on the engines' first ranks: (batch, stats) not yet gathered
        self.scored: deque = deque()     # on the reward model's ranks: (group_index, sequences, scores) not yet taken
        self.stream: Optional[RolloutStream] = None
        self.drawn = 0                  # this engine's prompts drawn so far (its place in its prompt stream)
        e = role.engine_index
        if e is None or role.engine_ranks[e][0] != rank:
            return
        self.engine_index = e
        self.quota = shard_rows(self.batch, e, self.engines)
        cap = shard_rows(s.generate_batch, e, self.engines)
        filtering = s.filter_range is not None
        self.stream = RolloutStream(
            role.engine, self._draw, n=self.n, capacity=max(cap.stop - cap.start, 1),
            quota=self.quota.stop - self.quota.start, max_new_tokens=s.max_new_tokens, chunk=s.chunk,
            max_staleness=s.max_staleness, score=self._score if self.streamed and not agent else None,
            keep=self._keep if (filtering and self.streamed) else None,
            max_draws=(s.filter_rounds + 2) * max(cap.stop - cap.start, 1) if filtering else 10 ** 12,
            pad_id=pad_id, episodes=self._episodes if agent else None)

    # ---- the prompt stream ---------------------------------------------------------------------------------------
    def prompt_at(self, index: int):
        """The prompt at place ``index`` of the global stream: the shuffled episodes of ``prompts_for``."""
        return self.prompts_for(index // self.batch)[index % self.batch]

    def _draw(self):
        """This engine's next prompt: without filtering or oversampling exactly its share of ``prompts_for(step)``,
        as a synchronous step would use; beyond that, the same slices of the following steps."""
        q = self.quota.stop - self.quota.start
        step, j = divmod(self.drawn, q)
        index = step * self.batch + self.quota.start + j
        self.drawn += 1
        return index, self.prompt_at(index).ids

    # ---- streaming rewards ---------------------------------------------------------------------------------------
    def _score(self, groups: List[Group]) -> None:
        b = groups_to_batch(groups, self.pad_id)
        labels = [self.prompt_at(g.index).label for g in groups for _ in g.samples]
        res = self.scorer.call(b, slice(None), labels)
        for i, g in enumerate(groups):
            rows = slice(i * self.n, (i + 1) * self.n)
            g.reward = Batch(rewards=res["rewards"][rows].float(), scores=res["scores"][rows].float(),
                             valid=res["valid"][rows].bool(),
                             extra_logs={k: v[rows].float() for k, v in res["extra_logs"].items()})

    def _episodes(self, groups: List[Group], params) -> None:
        """--agent_func_path: the agent runs these groups' episodes whole on this engine (``RolloutRole.run_agent``,
        as a synchronous step runs them), and each group takes its samples' tokens (environment feedback with
        action-mask 0), behaviour log-probs and the environment's rewards, as ``Scorer.score`` reads them."""
        b = self.roles.rollout.run_agent([self.prompt_at(g.index) for g in groups], params, first=True)
        if b is None or b.sequences.size(0) != len(groups) * self.n:
            raise RuntimeError(f"the agent returned {None if b is None else b.sequences.size(0)} episodes for "
                               f"{len(groups)} prompts x {self.n} samples")
        P = b.prompt_len
        lens = b.attention_mask[:, P:].sum(1).tolist()
        rows = (s for g in groups for s in g.samples)
        for i, s in enumerate(rows):
            k = int(lens[i])
            s.tokens, s.logprobs = b.sequences[i, P:P + k].tolist(), b.rollout_logprobs[i, :k].tolist()
            s.mask, s.truncated = b.action_mask[i, :k].tolist(), bool(b.truncated[i])
        scores = b.scores if b.scores is not None else b.rewards
        for j, g in enumerate(groups):
            r = b.rewards[j * self.n:(j + 1) * self.n].float()
            g.reward = Batch(rewards=r, scores=scores[j * self.n:(j + 1) * self.n].float(), valid=torch.isfinite(r),
                             extra_logs={})

    def _keep(self, g: Group) -> bool:
        return bool(dynamic_filter_mask(g.reward.scores, self.n, self.s.filter_range, g.reward.valid)[0])

    # ---- produce / take ------------------------------------------------------------------------------------------
    def produce(self, version: int, train_at: int) -> None:
        """On the engines' first ranks: generate the batch trained at ``train_at`` with the weights of step
        ``version``; kept here until ``take`` gathers it."""
        if self.stream is None:
            return
        self.roles.rollout.take_agent_metrics()  # an eval's episodes are not this batch's
        groups, stats = self.stream.produce(version, train_at, self.sampler.params(train_at),
                                            round_params=lambda r: self.sampler.params(train_at, salt=r))
        b = groups_to_batch(groups, self.pad_id) if groups else None
        m = stats.as_metrics()
        m.update({"async/in_flight_groups": float(len(self.stream.flight)),
                  "async/buffered_groups": float(len(self.stream.buffer)), **self.roles.rollout.take_agent_metrics()})
        self.produced.append((b, m))

    def warm_up(self, step: int, total: int) -> None:
        """Before the first step (and after a resume): the K batches of steps step .. step + K - 1 (and, with a
        reward model, their scores)."""
        count = len(range(step, min(step + self.k, total)))
        for s in range(step, step + count):
            self.produce(step, s)
        self.score_ahead(count)

    def score_ahead(self, count: int) -> None:
        """A reward model (``scores_ahead``): the last ``count`` produced batches go from the engines to the reward
        model's ranks and are scored there at once, so reward latency leaves the trainer's path: with the reward
        model on ranks of its own (or the critic's) the actor trains meanwhile, and the scores travel with the
        batch when its step comes (``take``).  Collective over the placement's ``rollout_reward`` group only (the rollout and
        reward ranks; every other rank skips it): per batch one ``gather`` over those ranks, then the reward
        model's forwards, gathered over its own ranks.  The count is shared state (step, K, total steps)."""
        g = self.groups
        if not self.ahead or count <= 0 or self.rank not in g.ranks("rollout_reward"):
            return
        reward, stats = self.roles.reward, self.roles.reward_stats
        mine = list(self.produced)[-count:] if self.stream is not None else [(None, None)] * count
        for local, _ in mine:
            batch = self.gather(local, group=g.group("rollout_reward"))
            if reward.is_member:
                with self.scorer.watchdog.phase("reward_model"):
                    s = self.scorer.forwards.run(reward, batch, lambda b, micro: reward.scores(
                        b, micro, stats, over=reward.group))
                self.scored.append((batch.group_index, batch.sequences, s))

    def take_scores(self, batch: Batch, step: int) -> Batch:
        """Collective (every rank): the reward model's scores of this step's batch (``score_ahead``), from the
        reward model's first rank; each reward rank checks that its scores were computed for this very batch."""
        reward = self.roles.reward
        owner = self.rank == reward.members[0]
        local = None
        if reward.is_member:
            index, seqs, scores = self.scored.popleft()
            if not (torch.equal(index, batch.group_index) and torch.equal(seqs, batch.sequences)):
                raise RuntimeError(f"step {step + 1}: the reward model's scores ahead belong to another batch "
                                   f"(prompts {sorted(set(index.tolist()))} for "
                                   f"{sorted(set(batch.group_index.tolist()))}): the async queue is out of order")
            local = scores if owner else None
        rows = batch.sequences.size(0)
        r = gather_rows(local, slice(0, rows) if owner else None, rows, 1).squeeze(1)
        return Batch(rewards=r, scores=r, valid=torch.ones_like(r, dtype=torch.bool), extra_logs={})

    def take(self, st: Batch) -> Batch:
        """Collective: this step's rows on every rank, into ``st`` (with the streamed or ahead-scored rewards),
        and ``st.prompts`` and the queue's metrics; returns ``st``."""
        local, m = self.produced.popleft() if self.produced else (None, {})
        batch = st.fill(self.gather(local))
        index = batch.group_index.view(-1, self.n)[:, 0].tolist()
        st.prompts = [self.prompt_at(i) for i in index]
        if self.ahead:
            st.fill(self.take_scores(batch, st.step), row_fields("reward"))
        ages = sample_ages(batch.versions, batch.action_mask, st.step)
        too_old = ages > self.s.max_staleness  # by construction none: the stream restarts such groups
        if bool(too_old.any()):
            raise RuntimeError(f"step {st.step + 1}: {int(too_old.sum())} samples are older than --max_staleness "
                               f"{self.s.max_staleness} (ages {sorted(set(ages.tolist()))})")
        st.metrics.update(age_metrics(batch.versions, batch.action_mask, st.step))
        st.metrics.update(m)  # the engines' first ranks report their stream's counts (mean over those ranks)
        return batch

    def gather(self, local: Optional[Batch], group=None) -> Batch:
        """Every engine's rows (its share of the prompts, prompt-major) on every rank of ``group`` (default the
        world), with the weight versions, stream places and streamed rewards (``gather_batch``: the same
        collectives on every rank of the group: one max of the widths, one gather of the extra-log names when
        rewards are streamed, one gather of the int and one of the float fields)."""
        owned = None
        if local is not None:
            owned = slice(self.quota.start * self.n, self.quota.stop * self.n)
            assert local.sequences.size(0) == owned.stop - owned.start, \
                f"engine {self.engine_index} produced {local.sequences.size(0)} rows for {owned.stop - owned.start}"
        names = row_fields("rollout", "async") + (row_fields("reward") if self.streamed else [])
        return gather_batch(local, owned, self.batch * self.n, names, self.pad_id, group)

    # ---- checkpoint ----------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """Collective: each engine's place in its prompt stream (saved with the trainer state)."""
        every = all_gather_objects((self.engine_index, self.drawn) if self.stream is not None else None)
        return {"drawn": {e: d for e, d in (x for x in every if x is not None)}}

    def restore(self, state: Optional[dict]) -> None:
        if state and self.stream is not None:
            self.drawn = int(state["drawn"].get(self.engine_index, state["drawn"].get(str(self.engine_index), 0)))
        print0("[resume] the async queue restarts: its batches are generated again with the resumed weights; the "
             "prompts each engine had drawn before the checkpoint (in flight or queued, never trained) are skipped"
             if state else "[resume] the checkpoint holds no async queue state: the prompt streams start over")
