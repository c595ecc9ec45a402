"""Advantage estimators, selected by ``--advantage_estimator``.

Every estimator takes sequence scores ``scores`` (B,) (already length-penalised), the
action mask (B, T), optional per-token KL estimates ``kl`` (B, T; folded in as
``-kl_coef * kl``) and optional ``valid`` (B,) bool, and returns ``(advantages, returns)``,
both (B, T) and zero outside the mask.  Samples of one prompt are contiguous: rows
[g*n, (g+1)*n) form group g, n = ``group_size``.

Order of operations (OpenRLHF's ``compute_advantages_and_returns``):
  1. group baseline / normalisation of the scores (group estimators only);
  2. clip to ``clip_range`` (``--reward_clip_range``, default (-10, 10));
  3. token rewards: the clipped score at the last action token, ``-kl_coef * kl`` on every token;
  4. returns (GAE for gae, return-to-go otherwise);
  5. global whitening for gae / reinforce / reinforce_baseline (biased variance; no std with std_norm=False).

Invalid samples (``valid`` False: NaN reward, failed reward call) take part in no statistic:
group means, stds, leave-one-out baselines and the whitening moments are over valid samples
only, and their own advantages and returns are 0.  A group with fewer than two valid samples
has no baseline: its advantages are 0.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from rlhf.algorithms.kl import fold_kl_into_rewards
from rlhf.algorithms.masked import masked_whiten
from rlhf.algorithms.registry import ADVANTAGE_ESTIMATORS
from rlhf.algorithms.shaping import clip_rewards

Tensor = torch.Tensor
GROUP_NORM_EPS = 1e-9  # OpenRLHF: (r - mean) / (std + 1e-9)


def _valid(scores: Tensor, valid: Optional[Tensor]) -> Tensor:
    v = torch.isfinite(scores.float())
    return v if valid is None else v & valid.bool()


def _groups(scores: Tensor, valid: Optional[Tensor], group_size: int) -> Tuple[Tensor, Tensor]:
    """(G, n) scores with invalid entries zeroed, and the (G, n) validity, both float64.

    Group statistics run in float64: in float32 one reward of 1e20 squares past float32's 3.4e38 in the std, the
    std becomes inf and every advantage of the group 0 (issue 27 item 5); float64 gives that row
    (s - mean) / std = 1.5 and the others -0.5 (n = 4).  The estimators return float32 (``_token_returns``)."""
    if group_size is None or group_size < 2:
        raise ValueError(f"group estimators need group_size (n_samples_per_prompt) > 1, got {group_size}")
    if scores.numel() % group_size:
        raise ValueError(f"batch of {scores.numel()} scores is not a whole number of groups of {group_size}")
    v = _valid(scores, valid).double().view(-1, group_size)
    g = torch.nan_to_num(scores.double(), nan=0.0, posinf=0.0, neginf=0.0).view(-1, group_size) * v
    return g, v


def group_mean(g: Tensor, v: Tensor) -> Tensor:
    """mean_j over the valid samples of each group:  sum_j v_j s_j / max(sum_j v_j, 1)   -> (G, 1)."""
    return (g * v).sum(1, keepdim=True) / v.sum(1, keepdim=True).clamp(min=1.0)


def group_std(g: Tensor, v: Tensor) -> Tensor:
    """Unbiased std over the valid samples of each group:  sqrt(sum_j v_j (s_j - mean)^2 / (k - 1)), k = sum_j v_j
    (0 where k < 2)   -> (G, 1)."""
    k = v.sum(1, keepdim=True)
    var = (((g - group_mean(g, v)) ** 2) * v).sum(1, keepdim=True) / (k - 1).clamp(min=1.0)
    return var.sqrt() * (k >= 2)


def batch_std(g: Tensor, v: Tensor) -> Tensor:
    """Unbiased std of all valid scores of the batch (TRL's scale_rewards="batch"; 0 with < 2 valid)."""
    k = v.sum()
    mean = (g * v).sum() / k.clamp(min=1.0)
    return ((((g - mean) ** 2) * v).sum() / (k - 1).clamp(min=1.0)).sqrt() * (k >= 2)


def _with_baseline(shifted: Tensor, v: Tensor) -> Tensor:
    """Flatten; rows of groups with < 2 valid samples, and invalid rows, get 0."""
    ok = v * (v.sum(1, keepdim=True) >= 2)
    return (shifted * ok).reshape(-1)


def return_to_go(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{k>=t} gamma^(k-t) r_k over action tokens (padding contributes nothing)."""
    r = token_rewards.float() * mask
    out = torch.zeros_like(r)
    running = torch.zeros(r.size(0), dtype=r.dtype, device=r.device)
    for t in reversed(range(r.size(1))):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out * mask


def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float) -> Tuple[Tensor, Tensor]:
    """delta_t = r_t + gamma V_{t+1} - V_t ;  A_t = sum_l (gamma lambda)^l delta_{t+l} ;  R_t = A_t + V_t.

    V is zero past the last action token (episode ends), padding is skipped.
    """
    mask = mask.float()
    values = values.float() * mask
    r = token_rewards.float() * mask
    T = r.size(1)
    adv = torch.zeros_like(r)
    last = torch.zeros(r.size(0), dtype=r.dtype, device=r.device)
    next_v = torch.zeros_like(last)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_v - values[:, t]
        last_new = delta + gamma * lambd * last
        # padding: carry state through unchanged
        last = torch.where(m > 0, last_new, last)
        next_v = torch.where(m > 0, values[:, t], next_v)
        adv[:, t] = last * m
    return adv, (adv + values) * mask


def _token_returns(seq_scores, mask, v_rows, kl, kl_coef, gamma, clip_range):
    """Steps 2-4 for the return-to-go estimators; mask restricted to valid rows (float32 out, whatever the
    precision of the group statistics before)."""
    v_rows = v_rows.float()
    m = mask.float() * v_rows.unsqueeze(1)
    s = clip_rewards(torch.nan_to_num(seq_scores.float(), nan=0.0) * v_rows, clip_range)
    return return_to_go(fold_kl_into_rewards(s, kl, kl_coef, m), m, gamma), m


@ADVANTAGE_ESTIMATORS.register("gae", needs_critic=True, needs_group=False, forces_gamma1=False)
def gae(scores, mask, *, values, kl=None, kl_coef=0.0, gamma=1.0, lambd=1.0, whiten=True, std_norm=True,
        valid=None, clip_range=None):
    """PPO: r_t = clip(s) [t = last] - kl_coef kl_t; GAE(gamma, lambda); A whitened over the batch's valid tokens."""
    v = _valid(scores, valid).float()
    m = mask.float() * v.unsqueeze(1)
    s = clip_rewards(torch.nan_to_num(scores.float(), nan=0.0) * v, clip_range)
    adv, ret = gae_advantages(fold_kl_into_rewards(s, kl, kl_coef, m), values, m, gamma, lambd)
    return (masked_whiten(adv, m, std=std_norm) if whiten else adv), ret


@ADVANTAGE_ESTIMATORS.register("reinforce", needs_critic=False, needs_group=False, forces_gamma1=False)
def reinforce(scores, mask, *, kl=None, kl_coef=0.0, gamma=1.0, std_norm=True, valid=None, clip_range=None):
    """REINFORCE++: G_t = return-to-go of the token rewards; A = whiten(G) over the batch's valid tokens."""
    v = _valid(scores, valid).float()
    ret, m = _token_returns(scores, mask, v, kl, kl_coef, gamma, clip_range)
    return masked_whiten(ret, m, std=std_norm), ret


@ADVANTAGE_ESTIMATORS.register("reinforce_baseline", needs_critic=False, needs_group=True, forces_gamma1=True)
def reinforce_baseline(scores, mask, *, group_size, kl=None, kl_coef=0.0, gamma=1.0, std_norm=True, valid=None,
                       clip_range=None):
    """REINFORCE++-baseline: s' = s - mean_group(s); G = return-to-go; A = whiten(G) over the valid tokens."""
    g, v = _groups(scores, valid, group_size)
    ret, m = _token_returns(_with_baseline(g - group_mean(g, v), v), mask, v.view(-1), kl, kl_coef, gamma,
                            clip_range)
    return masked_whiten(ret, m, std=std_norm), ret


@ADVANTAGE_ESTIMATORS.register("group_norm", needs_critic=False, needs_group=True, forces_gamma1=True)
def group_norm(scores, mask, *, group_size, kl=None, kl_coef=0.0, gamma=1.0, std_norm=True, scale="group",
               eps=GROUP_NORM_EPS, valid=None, clip_range=None):
    """GRPO: s' = (s - mean_group) / (std + eps), std unbiased, eps 1e-9;
    std = the group's (scale="group"), the whole batch's (scale="batch", TRL's scale_rewards=batch), or none
    (scale="none" or --no_advantage_std_norm);  A_t = return-to-go of (clip(s') at the last token - kl_coef kl)."""
    g, v = _groups(scores, valid, group_size)
    centred = g - group_mean(g, v)
    if std_norm and scale != "none":
        if scale == "group":
            std = group_std(g, v)
        elif scale == "batch":
            std = batch_std(g, v)
        else:
            raise ValueError(f"--scale_rewards must be group, batch or none, got {scale!r}")
        centred = centred / (std + eps)
    ret, _ = _token_returns(_with_baseline(centred, v), mask, v.view(-1), kl, kl_coef, gamma, clip_range)
    return ret, ret


@ADVANTAGE_ESTIMATORS.register("dr_grpo", needs_critic=False, needs_group=True, forces_gamma1=True)
def dr_grpo(scores, mask, *, group_size, kl=None, kl_coef=0.0, gamma=1.0, valid=None, clip_range=None):
    """Dr. GRPO: s' = s - mean_group(s) (no std, no length normalisation here); A = return-to-go."""
    g, v = _groups(scores, valid, group_size)
    ret, _ = _token_returns(_with_baseline(g - group_mean(g, v), v), mask, v.view(-1), kl, kl_coef, gamma,
                            clip_range)
    return ret, ret


@ADVANTAGE_ESTIMATORS.register("rloo", needs_critic=False, needs_group=True, forces_gamma1=True)
def rloo(scores, mask, *, group_size, kl=None, kl_coef=0.0, gamma=1.0, valid=None, clip_range=None):
    """RLOO: s'_i = s_i - (sum_{j valid} s_j - s_i) / (k - 1), k = valid samples of the group;
    A = return-to-go of s' (and KL penalties)."""
    g, v = _groups(scores, valid, group_size)
    k = v.sum(1, keepdim=True)
    baseline = ((g * v).sum(1, keepdim=True) - g) / (k - 1).clamp(min=1.0)
    ret, _ = _token_returns(_with_baseline(g - baseline, v), mask, v.view(-1), kl, kl_coef, gamma, clip_range)
    return ret, ret


@ADVANTAGE_ESTIMATORS.register("flash_reinforce", needs_critic=False, needs_group=False, forces_gamma1=True)
def flash_reinforce(scores, mask, *, kl=None, kl_coef=0.0, gamma=1.0, valid=None, clip_range=None):
    """FlashREINFORCE (OpenRLHF 0.11.2, openrlhf/trainer/ppo_utils/experience_maker.py
    ``compute_advantages_and_returns``: ``rewards = rewards - rewards.mean()``): one baseline for the whole rollout
    batch, no prompt group, no std, no whitening:

        s'_i = s_i - (1/k) sum_{j valid} s_j          (k = valid samples of the batch; any n_samples_per_prompt)
        r_t  = clip(s'_i) [t = last action token] - kl_coef kl_t
        A_t  = G_t = sum_{u >= t} r_u                 (gamma = 1, as OpenRLHF forces for it)

    Invalid rows enter no mean and get 0."""
    v = _valid(scores, valid).double()
    s = torch.nan_to_num(scores.double(), nan=0.0, posinf=0.0, neginf=0.0) * v
    mean = s.sum() / v.sum().clamp(min=1.0)
    ret, _ = _token_returns((s - mean) * v, mask, v, kl, kl_coef, gamma, clip_range)
    return ret, ret


def compute_advantages(name: str, scores: Tensor, mask: Tensor, **kwargs) -> Tuple[Tensor, Tensor]:
    """The estimator ``name`` (``--advantage_estimator``) with the keywords it takes; an unknown keyword raises."""
    return ADVANTAGE_ESTIMATORS.call(name, scores, mask, **kwargs)
