"""Reward shaping applied to sequence scores before the advantage estimator."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def clip_rewards(scores: Tensor, clip_range: Optional[Tuple[float, float]]) -> Tensor:
    """r = clamp(r, lo, hi)  (identity when clip_range is None)."""
    return scores if clip_range is None else scores.clamp(clip_range[0], clip_range[1])


def overlong_penalty(response_lengths: Tensor, max_new_tokens: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO soft overlong punishment:  p = -min(max(L - (L_max - L_buf), 0), L_buf) / L_buf * factor.

    Zero up to L_max - L_buf tokens, falling linearly to -factor at L_max, and never below -factor
    (OpenRLHF caps the excess at L_buf; agent episodes can run past L_max).
    """
    if buffer_len <= 0:
        return torch.zeros_like(response_lengths, dtype=torch.float32)
    expected = max_new_tokens - buffer_len
    exceed = (response_lengths.float() - expected).clamp(min=0.0, max=float(buffer_len))
    return -exceed / buffer_len * factor


def stop_properly_penalty(rewards: Tensor, truncated: Tensor, coef: Optional[float]) -> Tensor:
    """ProRL stop-properly penalty for truncated samples (finish reason "length"), --stop_properly_penalty_coef c:
    r' = c * r  if c >= 0 (c in [0, 1]),   r' = c  if c < 0 (a fixed reward);  untouched rows keep r."""
    if coef is None:
        return rewards
    if coef >= 0:
        if coef > 1:
            raise ValueError(f"--stop_properly_penalty_coef must lie in [0, 1] or be negative, got {coef}")
        new = rewards * coef
    else:
        new = torch.full_like(rewards, float(coef))
    return torch.where(truncated.bool(), new, rewards)


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


def dynamic_filter_mask(scores: Tensor, group_size: int, score_range: Tuple[float, float],
                        valid: Optional[Tensor] = None) -> Tensor:
    """Keep a prompt group (all its n rows) iff lo < mean_group(score) < hi (OpenRLHF / DAPO dynamic sampling;
    with 0/1 scores and the default (0, 1) this drops the groups that are all right or all wrong).

    The mean is over the group's valid samples; a group with none is dropped.  Returns a bool mask (B,).
    """
    v = torch.isfinite(scores.float())
    if valid is not None:
        v &= valid.bool()
    v = v.float().view(-1, group_size)
    g = torch.nan_to_num(scores.float()).view(-1, group_size) * v
    lo, hi = score_range
    k = v.sum(1)
    mean = g.sum(1) / k.clamp(min=1.0)
    keep = (k > 0) & (mean > lo) & (mean < hi)
    return keep.repeat_interleave(group_size)


def dynamic_filter_select(keep: Tensor, group_size: int, target_groups: int) -> Tensor:
    """Row indices of the first target_groups kept groups (keep: the (B,) mask of dynamic_filter_mask, rows of a
    group contiguous), in batch order: the rows a refilled batch trains on.  Fewer when fewer groups are kept."""
    kept = torch.nonzero(keep.view(-1, group_size)[:, 0], as_tuple=False).view(-1)[:max(int(target_groups), 0)]
    return (kept.unsqueeze(1) * group_size + torch.arange(group_size)).reshape(-1)


def dynamic_filter_refill(kept_groups: int, target_groups: int, pass_rate: Optional[float] = None,
                          max_extra: Optional[int] = None) -> int:
    """How many more prompts to generate so that the batch fills up to target_groups kept groups.

    need = target - kept; with an observed pass rate p in (0, 1] ask for ceil(need / p) prompts (so one more
    round usually suffices), capped at max_extra.  0 when the batch is full.
    """
    need = max(int(target_groups) - int(kept_groups), 0)
    if need == 0:
        return 0
    ask = need if not pass_rate or pass_rate <= 0 else int(math.ceil(need / min(float(pass_rate), 1.0)))
    return ask if max_extra is None else min(ask, int(max_extra))
