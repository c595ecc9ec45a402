"""Loss aggregation modes (``--loss_agg_mode``) over a (B, T) per-token loss and mask."""
from __future__ import annotations

from typing import Optional

import torch

from .registry import LOSS_AGGREGATIONS


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss, mask, norm_const: Optional[float] = None):
    """sum_{i,t} l_it m_it / sum_{i,t} m_it  (every token weighs the same)."""
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss, mask, norm_const: Optional[float] = None):
    """mean_i sum_t l_it m_it."""
    return (loss * mask.to(loss.dtype)).sum(1).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss, mask, norm_const: Optional[float] = None):
    """mean_i [ sum_t l_it m_it / sum_t m_it ]  (original GRPO)."""
    mask = mask.to(loss.dtype)
    return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1.0)).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss, mask, norm_const: Optional[float] = None):
    """sum_{i,t} l_it m_it / (B * C), C a constant (max response length) - Dr. GRPO."""
    if norm_const is None:
        norm_const = float(mask.size(1))
    return (loss * mask.to(loss.dtype)).sum() / (mask.size(0) * norm_const)


def aggregate(loss, mask, mode: str, norm_const: Optional[float] = None):
    return LOSS_AGGREGATIONS.get_fn(mode)(loss, mask, norm_const)
