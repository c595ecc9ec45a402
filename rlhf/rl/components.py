"""What the stages of an RL step use besides the batch and the roles, each built once from its part of the config:
how an inference forward runs (``Forwards``), how rows are scored (``Scorer``), how generated rows reach every rank
(``Rollouts``), the sampling parameters of a generate call (``Sampler``), and the decisions every rank takes alike
from config and placement (``on_policy_single_update``, ``refills``, ``gap_due``).  The stages themselves:
rlhf.rl.stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from rlhf.batch import Batch, row_fields
from rlhf.distributed.batch_gather import gather_batch
from rlhf.distributed.sharding import shard_rows
from rlhf.engines.rollout import SamplingParams


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

    def __init__(self, batch: Batch, size: int, budget: int, packed: bool):
        from rlhf.algorithms.seqlen_balancing import Item, plan_step
        from rlhf.roles.update_batches import row_items

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


@dataclass
class Forwards:
    """How an inference forward of a role (ref / old log-probs / values / reward model) runs: ``micro_rows`` rows
    per forward (--micro_rollout_batch_size, which counts samples as in OpenRLHF: its make_experience splits the
    samples into micro-batches of micro_rollout_batch_size), or under --use_dynamic_batch an ``InferencePlan`` of
    at most ``budget`` tokens per forward (--rollout_max_tokens_per_gpu); log-probs at ``temperature`` (the
    rollout's, 1 for greedy), ``chunk`` (--logprob_chunk_size), packed under ``packing`` (--packing_samples)."""
    micro_rows: int
    budget: Optional[int]
    temperature: float
    chunk: int
    packing: bool

    @classmethod
    def from_config(cls, rollout, model, budget: Optional[int]) -> Forwards:
        """From the rollout and model groups (rlhf.config.schema RolloutConfig, ModelConfig) and ``budget``, the
        inference token budget (rlhf.config.batching_checks ``dynamic_budgets``; None: fixed micro-batches)."""
        t = rollout.temperature
        return cls(rollout.micro_rollout_batch_size, budget, t if t > 0 else 1.0, model.logprob_chunk_size,
                   model.packing_samples)

    def run(self, role, batch: Batch, call: Callable, packed: bool = False) -> torch.Tensor:
        """``call(batch, micro)`` (a role's logprobs / values / scores) with fixed micro-batches, or on the batch
        reordered by an ``InferencePlan`` and put back in order.  The plan is a function of the batch, which every
        rank holds: the same on every rank."""
        if self.budget is None:
            return call(batch, self.micro_rows)
        plan = InferencePlan(batch, role.dp_size, self.budget, packed)
        return call(batch.select(plan.perm), plan)[plan.inverse]

    def logprobs(self, role, batch: Batch) -> torch.Tensor:
        """The role's (actor / reference) log-probs of the batch's response tokens, (B, R)."""
        return self.run(role, batch, lambda b, micro: role.logprobs(b, self.temperature, micro, self.chunk,
                                                                    self.packing), self.packing)


@dataclass
class Sampler:
    """The sampling parameters of a generate call (--temperature, --top_p, --top_k, --generate_max_len, the eval
    flags), seeded per step and per engine (not per rank: the TP ranks of one vLLM engine must sample alike)."""
    n: int
    temperature: float
    eval_n: int
    eval_temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_id: int
    seed: int
    engine_index: int

    @classmethod
    def from_config(cls, rollout, generate_max_len: int, seed: int, eos_token_id: int,
                    engine_index: Optional[int]) -> Sampler:
        """From the rollout group (RolloutConfig), --generate_max_len and --seed."""
        r = rollout
        return cls(r.n_samples_per_prompt, r.temperature, r.eval_n_samples_per_prompt, r.eval_temperature, r.top_p,
                   r.top_k, generate_max_len, eos_token_id, seed, engine_index or 0)

    def params(self, step: int, eval_mode: bool = False, salt: int = 0) -> SamplingParams:
        return SamplingParams(n=self.eval_n if eval_mode else self.n,
                              temperature=self.eval_temperature if eval_mode else self.temperature,
                              top_p=self.top_p, top_k=self.top_k, max_new_tokens=self.max_new_tokens,
                              stop_token_ids=(self.stop_token_id,),
                              seed=self.seed * 100003 + step * 97 + self.engine_index + salt * 1000003)


@dataclass
class Rollouts:
    """Generate for a list of prompts and bring every engine's rows to every rank (``RolloutRole.gather``);
    ``with_rewards``: agent rollouts, whose environment scored each row."""
    pad_id: int
    with_rewards: bool
    with_images: bool = False  # agent rows of a VLM carry their episode's images (pixel_values, image_grid_thw)

    def gather(self, roles, local: Optional[Batch], prompts: list, n_samples: int) -> Batch:
        """The full batch of these prompts' samples on every rank, from this rank's generated rows (collective)."""
        return roles.rollout.gather(local, len(prompts), n_samples, self.pad_id, with_rewards=self.with_rewards,
                                     with_images=self.with_images)

    def generate(self, roles, prompts: list, params: SamplingParams) -> Batch:
        return self.gather(roles, roles.rollout.generate(prompts, params), prompts, params.n)


@dataclass
class Scorer:
    """The reward fields of a batch: an agent's environment scored the rows already; a reward model scores them
    (over the world); else a reward function (``reward_source``: --remote_rm_url or the built-in) on every rank's
    share of the rows, each call under the watchdog's "reward_function" phase, then gathered."""
    agent_mode: bool
    reward_source: Optional[Callable]
    tokenizer: object
    watchdog: object
    forwards: Forwards
    rank: int
    world: int

    def call(self, batch: Batch, rows: slice, labels: List) -> dict:
        """The reward function on ``rows`` of the batch (this rank only): {rewards, scores, valid, extra_logs}."""
        queries, prompts = decode_queries(self.tokenizer, batch, rows)
        with self.watchdog.phase("reward_function"):  # its own phase: the watchdog report tells it from the gather
            return self.reward_source(queries, prompts, labels)

    def score(self, batch: Batch, roles, labels: List) -> Batch:
        """The reward fields (rewards, scores, valid, extra_logs) of every row, on every rank (collective)."""
        n = batch.sequences.size(0)
        if self.agent_mode:  # agent rollouts: the environment already scored every row
            r = batch.rewards
            return Batch(rewards=r, scores=batch.scores, valid=torch.isfinite(r), extra_logs={})
        if roles.reward is not None:  # gathered over the world: every rank calls this (under --async_train too,
            # where only the eval does: the train batches are scored ahead)
            rm = roles.reward
            r = self.forwards.run(rm, batch, lambda b, micro: rm.scores(b, micro, roles.reward_stats, over=None))
            return Batch(rewards=r, scores=r, valid=torch.ones_like(r, dtype=torch.bool), extra_logs={})
        # a reward function: every rank calls it on its share of the rows (remote servers see parallel requests)
        sl = shard_rows(n, self.rank, self.world)
        local = None
        if sl.stop > sl.start:
            res = self.call(batch, sl, labels[sl])
            local = Batch(rewards=res["rewards"], scores=res["scores"], valid=res["valid"],
                          extra_logs=res["extra_logs"])
        return gather_batch(local, sl, n, row_fields("reward"), self.tokenizer.pad_token_id)


def on_policy_single_update(r, o, a) -> bool:
    """One epoch and one optimizer step per rollout batch, and no async lag: old log-probs equal the current ones
    (``r``, ``o``, ``a``: the rollout, optim and algorithm groups),

        max_epochs == 1 and rollout_batch_size * n_samples_per_prompt == train_batch_size and not async_train.

    With --enable_is_correction the old log-probs are still needed (they are the IS numerator), so not then.
    """
    return (o.max_epochs == 1 and r.rollout_batch_size * r.n_samples_per_prompt == o.train_batch_size
            and not r.async_train and not a.enable_is_correction)


def gap_due(n: int, step: int) -> bool:
    """Whether 0-based ``step`` measures ``rollout_logprob_gap`` where the old log-prob forward is skipped: the
    first step and every ``n``-th, --logprob_gap_interval (1-based steps N, 2N, ...: the ones --logging_steps N
    logs).  From the step number and the config only, so every rank decides alike."""
    return n > 0 and (step == 0 or (step + 1) % n == 0)


def measures_gap_only(interval: int, old_logprobs: bool) -> bool:
    """The old log-prob forward is skipped (``old_logprobs``: ``needs_old_logprobs`` says False) and
    --logprob_gap_interval (``interval``) asks for the gap now and then: the ``logprob_gap`` stage applies."""
    return interval > 0 and not old_logprobs


def refills(a, async_train: bool) -> bool:
    """Dynamic filtering refills the batch (``a``: the algorithm group; synchronous rollouts only: async ones
    filter each group as it completes and draw a new prompt in its place: rlhf.rl.stream)."""
    return a.dynamic_filtering and a.dynamic_filtering_max_rounds > 0 and not async_train


def decode_queries(tokenizer, batch: Batch, sl: slice):
    """(query = prompt + response text, prompt text) for rows sl, decoded in one batch call each."""
    P = batch.prompt_len
    seq, att, am = batch.sequences[sl].tolist(), batch.attention_mask[sl, :P].tolist(), batch.action_mask[sl].tolist()
    p_ids = [[t for t, k in zip(s[:P], m) if k] for s, m in zip(seq, att)]
    r_ids = [[t for t, k in zip(s[P:], m) if k] for s, m in zip(seq, am)]
    prompts = tokenizer.batch_decode(p_ids, skip_special_tokens=False)
    responses = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
    return [p + r for p, r in zip(prompts, responses)], prompts
