"""``is_filter_ratio``: the share of units the rollout-vs-trainer IS correction drops (mask modes) or clamps (tis).

Mirrors OpenRLHF 0.11.2 ``openrlhf/models/loss.py`` ``PolicyLoss.forward`` (IS-correction branch), logged per
micro-batch in ``openrlhf/trainer/ray/ppo_actor.py`` as ``experience.info["is_filter_ratio"]`` and averaged over the
micro-batches and data-parallel ranks (here: ``rlhf.roles.actor.Actor.update``, for every --policy_loss_type whose loss
takes the IS weights, i.e. all but gspo, whose ratio is taken against the rollout; OpenRLHF has ppo and gspo
only and logs it for ppo).  With ``old`` the trainer's and ``rollout`` the engine's log-probs of the
sampled tokens and m the action mask, the gated statistic of a unit is

    gating ratio:          s_t = exp(old_t - rollout_t)                  (token)
                           S_i = exp(sum_t m_t (old_t - rollout_t) / sum_t m_t)      (seq: geometric mean)
    gating binary_kl / tv: s_t = d_t (policy_loss.IS_GATES)               (token)
                           S_i = sum_t m_t d_t / sum_t m_t                (seq)

and a unit is filtered when it lies outside [low, high] (mask modes drop it, clip mode clamps it):

    token level (tis, icepop):  is_filter_ratio = sum_t m_t [s_t < low or s_t > high] / sum_t m_t
    seq level (seq-mask-tis):   is_filter_ratio = mean over sequences of [S_i < low or S_i > high]

OpenRLHF's seq-level mean runs over every row of the micro-batch; here over the rows with at least one action
token, because our micro-batches keep rows whose loss is masked out (invalid rewards, dynamic filtering) where
OpenRLHF drops them: such a row counted as "kept" would understate the ratio.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rlhf.algorithms.policy_loss import IS_GATES

# --is_correction_type -> (level, mode) of OpenRLHF 0.11.2 (the inverse of policy_loss.IS_LEVEL_MODE_KIND)
IS_KIND_LEVEL = {"tis": "token", "icepop": "token", "seq-mask-tis": "seq"}


@torch.no_grad()
def is_filter_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, kind: str = "tis", low: float = 0.5,
                    high: float = 5.0, gating: str = "ratio") -> Optional[float]:
    """The fraction of tokens (tis, icepop) or sequences (seq-mask-tis) outside [low, high] (module docstring);
    None when there is nothing to count (no action token, or at seq level no non-empty row)."""
    if kind not in IS_KIND_LEVEL:
        raise ValueError(f"--is_correction_type {kind!r}: use one of {sorted(IS_KIND_LEVEL)}")
    m = mask.float()
    log_w = (old_logp.float() - rollout_logp.float()) * m
    stat = log_w if gating == "ratio" else IS_GATES.get_fn(gating)(old_logp, rollout_logp) * m
    if IS_KIND_LEVEL[kind] == "seq":
        rows = m.sum(1) > 0
        if not bool(rows.any()):
            return None
        stat = stat.sum(1) / m.sum(1).clamp(min=1)
        if gating == "ratio":
            stat = torch.exp(stat)
        return float(((stat < low) | (stat > high))[rows].float().mean())
    if float(m.sum()) == 0:
        return None
    if gating == "ratio":
        stat = torch.exp(stat)
    return float((((stat < low) | (stat > high)).float() * m).sum() / m.sum())
