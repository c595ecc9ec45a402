"""Reward shaping applied to sequence scores before the advantage estimator."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def clip_rewards(scores: Tensor, clip_range: Optional[Tuple[float, float]]) -> Tensor:
    """r = clamp(r, lo, hi)  (identity when clip_range is None)."""
    return scores if clip_range is None else scores.clamp(clip_range[0], clip_range[1])


def overlong_penalty(response_lengths: Tensor, max_new_tokens: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO soft overlong punishment:  p = min(0, -(L - (L_max - L_buf)) / L_buf * factor).

    Zero up to L_max - L_buf tokens, falling linearly to -factor at L_max.
    """
    if buffer_len <= 0:
        return torch.zeros_like(response_lengths, dtype=torch.float32)
    expected = max_new_tokens - buffer_len
    exceed = response_lengths.float() - expected
    return torch.clamp(-exceed / buffer_len * factor, max=0.0)


class RunningMeanStd:
    """Running mean/variance (Chan et al. parallel update); normalise(r) = (r - mean) / (std + eps)."""

    def __init__(self, eps: float = 1e-8):
        self.mean, self.var, self.count, self.eps = 0.0, 1.0, 0, eps

    def update(self, x: Tensor) -> None:
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        bmean, bvar = x.mean().item(), x.var(unbiased=False).item()
        tot = self.count + n
        delta = bmean - self.mean
        m2 = self.var * self.count + bvar * n + delta * delta * self.count * n / tot
        self.mean, self.var, self.count = self.mean + delta * n / tot, m2 / tot, tot

    def normalize(self, x: Tensor) -> Tensor:
        return (x - self.mean) / (self.var ** 0.5 + self.eps)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, s: dict) -> None:
        self.mean, self.var, self.count = s["mean"], s["var"], s["count"]


def dynamic_filter_mask(scores: Tensor, group_size: int, score_range: Tuple[float, float]) -> Tensor:
    """Keep a prompt group (all its n rows) iff its scores are not all equal and lo < mean < hi.

    Returns a bool mask of shape (B,).  Groups whose samples all agree carry no
    group-relative signal (DAPO dynamic sampling).
    """
    g = scores.float().view(-1, group_size)
    lo, hi = score_range
    mean = g.mean(1)
    keep = (g.max(1).values - g.min(1).values > 1e-8) & (mean > lo) & (mean < hi)
    return keep.repeat_interleave(group_size)
