"""The micro-batching of the PPO-style updates (``rlhf.roles.actor.Actor.update``, any estimator, and
``rlhf.roles.critic.Critic.update``): optimizer steps of micro-batches with accumulation.

Global loss normalisation: before the micro-batches of an optimizer step run, one all_reduce over the
role's process group sums this step's token and sequence counts over every micro-batch on every rank
(``step_totals``).  Each micro-batch loss divides by those totals, so the step's micro-batch losses add up
to the full-batch loss whatever the split; the value handed to ``engine.backward`` is multiplied by
(accumulation steps x data-parallel ranks) because the engines divide by the one and average over the other.
Every rank of the group runs ``step_totals`` once per optimizer step, also with an empty shard, so the
collective sequence is the same on every rank whatever its data.
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Dict, List, NamedTuple, Optional

import torch

from rlhf.algorithms import LossTotals
from rlhf.algorithms.seqlen_balancing import Item, plan_step
from rlhf.distributed import comm, shard_rows
from rlhf.distributed.mesh import RoleMesh
from rlhf.roles.base import ModelRole


class Micro(NamedTuple):
    """One micro-batch's row indices; ``real`` False for a dummy forward (a rank with fewer token-budget
    micro-batches than the others runs it on a real row with its loss times 0: FSDP's collectives need the same
    number of forwards and backwards on every rank)."""
    rows: torch.Tensor
    real: bool = True


def row_items(attention_mask: torch.Tensor, action_mask: torch.Tensor) -> List[Item]:
    """Each row's (prompt tokens, response width) for the micro-batcher: the prompt is left-padded (its real
    tokens: the attention mask over the first P columns), the response right-padded (its width: up to its last
    attended or action position)."""
    R = action_mask.size(1)
    P = attention_mask.size(1) - R
    left = attention_mask[:, :P].long().sum(1)
    used = attention_mask[:, P:].bool() | action_mask.bool()
    right = torch.where(used.any(1), R - used.long().flip(1).argmax(1), torch.zeros_like(left))
    return [Item(int(a), max(int(b), 1)) for a, b in zip(left.tolist(), right.tolist())]


class TokenBudget(NamedTuple):
    """--use_dynamic_batch for one batch: its rows' sizes, the per-rank token budget, packed or padded."""
    items: List[Item]
    budget: int
    packed: bool

    def split(self, step_rows: torch.Tensor, rank: int, world: int) -> List[Micro]:
        """This rank's micro-batches of one step (rlhf.algorithms.seqlen_balancing.plan_step: rows over ranks by
        tokens, then by the budget); the same count on every rank, dummies last."""
        _, micro = plan_step([self.items[i] for i in step_rows.tolist()], world, self.budget, self.packed)
        dummy = step_rows[:1]
        return [Micro(step_rows[torch.tensor(m, dtype=torch.long)]) if m is not None else Micro(dummy, False)
                for m in micro[rank]]


class UpdateSettings(NamedTuple):
    """What an update reads of the config besides the algorithm section (``update_settings``): the epochs and
    batch sizes of the optimizer steps, the token budget, and how the forward computes log-probs."""
    max_epochs: int
    train_batch_size: int
    micro_train_batch_size: int
    token_budget: Optional[int]  # --use_dynamic_batch: tokens per rank and micro-batch (None: fixed size)
    packing_samples: bool
    temperature: float           # the rollout's (0 -> 1: greedy rollouts are scored at temperature 1)
    logprob_chunk_size: int
    lm_head_keep_bytes: int
    generate_max_len: int        # the constant-normaliser of --loss_agg_mode seq-mean-token-sum-norm


def update_settings(o, m, r, generate_max_len: int, token_budget: Optional[int]) -> UpdateSettings:
    """The UpdateSettings from the optim (``o``), model (``m``) and rollout (``r``) groups, --generate_max_len and
    the training token budget (rlhf.config.batching_checks ``dynamic_budgets``; None: fixed micro-batches).  The
    roles keep these, never the config."""
    return UpdateSettings(o.max_epochs, o.train_batch_size, o.micro_train_batch_size, token_budget, m.packing_samples,
                          r.temperature if r.temperature > 0 else 1.0, m.logprob_chunk_size, m.lm_head_keep_bytes,
                          generate_max_len)


def token_budget(s: UpdateSettings, exp) -> Optional[TokenBudget]:
    """The batch's TokenBudget under --use_dynamic_batch (None: fixed --micro_train_batch_size)."""
    if s.token_budget is None:
        return None
    return TokenBudget(row_items(exp.attention_mask, exp.action_mask), s.token_budget, s.packing_samples)


def step_batches(s: UpdateSettings, n_rows: int, rank: int, world: int, seed: int, dyn: Optional[TokenBudget]):
    """Every epoch's optimizer steps, each as this rank's micro-batches (``_minibatches``; epoch e seeds
    ``seed + e``)."""
    for epoch in range(s.max_epochs):
        yield from _minibatches(n_rows, rank, world, s.train_batch_size, s.micro_train_batch_size, seed + epoch, dyn)


def _minibatches(n_rows: int, rank: int, world: int, train_batch_size: int, micro: int, epoch_seed: int,
                 dyn: Optional[TokenBudget] = None) -> List[Micro]:
    """Per optimizer step, this rank's micro-batches (global shuffle, then a DP shard per step).
    Yields once per step on every rank (an empty list when this rank's shard of the step is empty).
    Fixed size: ``micro`` rows each, the step's rows split over ranks by count.  ``dyn`` (--use_dynamic_batch):
    the step's rows split over ranks by tokens and into micro-batches by the token budget, every rank the same
    number (``TokenBudget.split``)."""
    g = torch.Generator().manual_seed(epoch_seed)
    perm = torch.randperm(n_rows, generator=g)
    for s in range(0, n_rows, train_batch_size):
        step_rows = perm[s:s + train_batch_size]
        if dyn is not None:
            yield dyn.split(step_rows, rank, world)
            continue
        mine = step_rows[shard_rows(step_rows.numel(), rank, world)]
        yield [Micro(mine[i:i + micro]) for i in range(0, mine.numel(), micro)]


def trim_padding(mb):
    """The micro-batch without the columns none of its rows uses: prompt columns left of its longest prompt and
    response columns right of its longest response (left-padded prompts, right-padded responses).  Positions come
    from the attention mask, so the log-probs are those of the untrimmed rows (up to float rounding)."""
    R = mb.action_mask.size(1)
    P = mb.sequences.size(1) - R
    cols = mb.attention_mask.bool().any(0)
    lead = int(cols[:P].long().argmax()) if bool(cols[:P].any()) else P
    resp = cols[P:] | mb.action_mask.bool().any(0)
    r = int(resp.nonzero().max()) + 1 if bool(resp.any()) else 1
    if lead == 0 and r == R:
        return mb
    cut = lambda t: None if t is None else t[:, :r]  # noqa: E731
    return replace(mb, sequences=mb.sequences[:, lead:P + r], attention_mask=mb.attention_mask[:, lead:P + r],
                   **{f: cut(getattr(mb, f)) for f in ("action_mask", "rollout_logprobs", "old_logprobs",
                                                       "ref_logprobs", "values", "advantages", "returns")},
                   routed_experts=None if mb.routed_experts is None else mb.routed_experts[:, lead:P + r])


def micro_batch(exp, micro: Micro, dyn: Optional[TokenBudget]):
    """The rows of one micro-batch; token-budget padded micro-batches drop their all-padding columns."""
    mb = exp.select(micro.rows)
    return trim_padding(mb) if dyn is not None and not dyn.packed else mb


def padding_counts(mb, packed: bool, real: bool) -> tuple:
    """(real tokens, token slots the forward computes) of a micro-batch: a padded forward computes every column of
    every row, a packed one only the real tokens; a dummy forward's tokens are all waste."""
    tokens = float(mb.attention_mask.sum())
    slots = tokens if packed else float(mb.attention_mask.numel())
    return (tokens if real else 0.0), slots


def step_totals(masks: List[torch.Tensor], group=None, replicas: int = 1) -> LossTotals:
    """[tokens, non-empty sequences] of this rank's micro-batch masks, summed over the group: one all_reduce.
    ``replicas``: ranks that hold the same micro-batches (an SP group, --ring_attn_size): each counted once."""
    t = torch.zeros(2, dtype=torch.float64)
    for m in masks:
        m = m.float()
        t[0] += float(m.sum())
        t[1] += float((m.sum(-1) > 0).sum())
    comm.all_reduce(t, group=group)
    t /= replicas
    return LossTotals(float(t[0]), float(t[1]))


def mean_logs(d: Dict[str, List[float]]) -> Dict[str, float]:
    return {k: sum(v) / len(v) for k, v in d.items() if v}


class AuxLossTap:
    """Reads a MoE model's load-balancing ``aux_loss`` from its forward output (HF ``output_router_logits``)."""

    def __init__(self, model, enabled: bool):
        self.value, self.handle = None, None
        if not enabled:
            return
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "output_router_logits"):
            warnings.warn("--aux_loss_coef is set but the model has no MoE router (config.output_router_logits): "
                          "no auxiliary loss to add", UserWarning, stacklevel=3)
            return
        cfg.output_router_logits = True
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        self.value = getattr(out, "aux_loss", None)

    def take(self):
        v, self.value = self.value, None
        return v

    def close(self):
        if self.handle is not None:
            self.handle.remove()


class UpdatingRole(ModelRole):
    """A role with optimizer steps of its own (``Actor``, ``Critic``): its config's algorithm section (``algo``) and
    the batching of its updates (``settings``: ``UpdateSettings``), checkpointed as a trained role."""

    trains = True

    def __init__(self, name: str, mesh: RoleMesh, algo=None, settings: Optional[UpdateSettings] = None):
        super().__init__(name, mesh)
        self.algo, self.settings = algo, settings
