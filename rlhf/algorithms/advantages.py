"""Advantage estimators, selected by ``--advantage_estimator``.

Every estimator takes sequence scores ``scores`` (B,), the action mask (B, T)
and optional per-token KL penalties ``kl`` (B, T, already multiplied by nothing:
the estimator folds ``-kl_coef * kl`` into the token rewards), and returns
``(advantages, returns)``, both (B, T) and zero outside the mask.  Samples of one
prompt are contiguous: rows [g*n, (g+1)*n) form group g, n = ``group_size``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .kl import fold_kl_into_rewards
from .masked import masked_whiten
from .registry import ADVANTAGE_ESTIMATORS

Tensor = torch.Tensor


def _groups(scores: Tensor, group_size: int) -> Tensor:
    if group_size is None or group_size < 2:
        raise ValueError(f"group estimators need group_size (n_samples_per_prompt) > 1, got {group_size}")
    if scores.numel() % group_size:
        raise ValueError(f"batch of {scores.numel()} scores is not a whole number of groups of {group_size}")
    return scores.float().view(-1, group_size)


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


@ADVANTAGE_ESTIMATORS.register("gae", needs_critic=True, needs_group=False)
def gae(scores, mask, *, values, kl=None, kl_coef=0.0, gamma=1.0, lambd=0.95, whiten=True, **_):
    """PPO: token rewards = score at the last token - kl_coef*kl; GAE(gamma, lambda); whitened advantages."""
    rewards = fold_kl_into_rewards(scores, kl, kl_coef, mask)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lambd)
    return (masked_whiten(adv, mask) if whiten else adv), ret


@ADVANTAGE_ESTIMATORS.register("reinforce", needs_critic=False, needs_group=False)
def reinforce(scores, mask, *, kl=None, kl_coef=0.0, gamma=1.0, **_):
    """REINFORCE++: G_t = return-to-go of the token rewards; A = whiten(G) over the global batch."""
    ret = return_to_go(fold_kl_into_rewards(scores, kl, kl_coef, mask), mask, gamma)
    return masked_whiten(ret, mask), ret


@ADVANTAGE_ESTIMATORS.register("reinforce_baseline", needs_critic=False, needs_group=True)
def reinforce_baseline(scores, mask, *, group_size, kl=None, kl_coef=0.0, gamma=1.0, **_):
    """REINFORCE++-baseline: s' = s - mean_group(s); G = return-to-go; A = whiten(G)."""
    g = _groups(scores, group_size)
    shifted = (g - g.mean(1, keepdim=True)).view(-1)
    ret = return_to_go(fold_kl_into_rewards(shifted, kl, kl_coef, mask), mask, gamma)
    return masked_whiten(ret, mask), ret


@ADVANTAGE_ESTIMATORS.register("group_norm", needs_critic=False, needs_group=True)
def group_norm(scores, mask, *, group_size, kl=None, kl_coef=0.0, gamma=1.0, std_norm=True, eps=1e-6, **_):
    """GRPO: s' = (s - mean_group) / (std_group + eps)  (std dropped by --no_advantage_std_norm);
    A_t = return-to-go of (s' at the last token - kl_coef*kl)  (= s' everywhere when KL is a loss)."""
    g = _groups(scores, group_size)
    centred = g - g.mean(1, keepdim=True)
    if std_norm:
        centred = centred / (g.std(1, keepdim=True, unbiased=True) + eps)
    ret = return_to_go(fold_kl_into_rewards(centred.view(-1), kl, kl_coef, mask), mask, gamma)
    return ret, ret


@ADVANTAGE_ESTIMATORS.register("dr_grpo", needs_critic=False, needs_group=True)
def dr_grpo(scores, mask, *, group_size, kl=None, kl_coef=0.0, gamma=1.0, **_):
    """Dr. GRPO: s' = s - mean_group(s) (no std, no length normalisation here); A = return-to-go."""
    g = _groups(scores, group_size)
    ret = return_to_go(fold_kl_into_rewards((g - g.mean(1, keepdim=True)).view(-1), kl, kl_coef, mask), mask, gamma)
    return ret, ret


@ADVANTAGE_ESTIMATORS.register("rloo", needs_critic=False, needs_group=True)
def rloo(scores, mask, *, group_size, kl=None, kl_coef=0.0, gamma=1.0, **_):
    """RLOO: s'_i = s_i - (sum_j s_j - s_i) / (n - 1); A = return-to-go of s' (and KL penalties)."""
    g = _groups(scores, group_size)
    n = g.size(1)
    baseline = (g.sum(1, keepdim=True) - g) / (n - 1)
    ret = return_to_go(fold_kl_into_rewards((g - baseline).view(-1), kl, kl_coef, mask), mask, gamma)
    return ret, ret


def compute_advantages(name: str, scores: Tensor, mask: Tensor, **kwargs) -> Tuple[Tensor, Tensor]:
    return ADVANTAGE_ESTIMATORS.get_fn(name)(scores, mask, **kwargs)
