"""Loss aggregation modes (``--loss_agg_mode``) over a (B, T) per-token loss and mask.

Global normalisation (OpenRLHF, veRL, TRL's ``dapo``): an optimizer step is split into
micro-batches and data-parallel ranks, and each mode divides by the *whole step's*
count, not the micro-batch's.  ``totals`` carries those counts (tokens, and sequences
with at least one token) summed over every micro-batch of the step on every rank;
then the micro-batch losses of the step add up to one full-batch value.  Without
``totals`` the counts are the micro-batch's own (one micro-batch = the full batch).

The caller scales the returned value by (gradient-accumulation steps x DP ranks) before
``backward`` because the engines divide by the former and average over the latter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rlhf.algorithms.registry import LOSS_AGGREGATIONS


@dataclass(frozen=True)
class LossTotals:
    """Counts over one optimizer step (all micro-batches, all data-parallel ranks)."""
    tokens: float
    seqs: float


def local_totals(mask: torch.Tensor) -> LossTotals:
    """LossTotals of one mask: sum(m) tokens, #rows with sum_t m > 0 sequences."""
    m = mask.float()
    return LossTotals(float(m.sum()), float((m.sum(-1) > 0).sum()))


def _tot(mask, totals: Optional[LossTotals]) -> LossTotals:
    return totals if totals is not None else local_totals(mask)


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss, mask, norm_const: Optional[float] = None, totals: Optional[LossTotals] = None):
    """sum_{i,t} l_it m_it / N_tok  (N_tok = the step's token count: every token weighs the same)."""
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / max(_tot(mask, totals).tokens, 1.0)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss, mask, norm_const: Optional[float] = None, totals: Optional[LossTotals] = None):
    """sum_i sum_t l_it m_it / N_seq  (N_seq = the step's non-empty sequences)."""
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / max(_tot(mask, totals).seqs, 1.0)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss, mask, norm_const: Optional[float] = None, totals: Optional[LossTotals] = None):
    """sum_i [ sum_t l_it m_it / sum_t m_it ] / N_seq  (original GRPO; empty rows contribute 0)."""
    mask = mask.to(loss.dtype)
    per_seq = (loss * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return per_seq.sum() / max(_tot(mask, totals).seqs, 1.0)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss, mask, norm_const: Optional[float] = None, totals: Optional[LossTotals] = None):
    """sum_{i,t} l_it m_it / (N_seq * C), C a constant (max response length; default T) - Dr. GRPO."""
    if norm_const is None:
        norm_const = float(mask.size(1))
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / (max(_tot(mask, totals).seqs, 1.0) * norm_const)


def aggregate(loss, mask, mode: str, norm_const: Optional[float] = None, totals: Optional[LossTotals] = None):
    return LOSS_AGGREGATIONS.get_fn(mode)(loss, mask, norm_const, totals)
