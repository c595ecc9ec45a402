"""KL estimators (per token, masked), KL folded into rewards, KL controllers.

With log-ratio  d = log pi(a) - log pi_ref(a)  sampled from pi:
  k1 = d                       (unbiased, high variance, can be negative)
  k2 = d^2 / 2                 (biased, low variance)
  k3 = exp(-d) - 1 + d         (unbiased, >= 0; Schulman's estimator, GRPO's KL loss)

Every estimate is clamped to [-10, 10] (OpenRLHF's ``compute_approx_kl``), and a
negative KL coefficient counts as 0 (OpenRLHF's ``compute_reward``).
"""
from __future__ import annotations

from typing import Optional

import torch

from rlhf.algorithms.registry import KL_ESTIMATORS

LOG_RATIO_CLAMP = 20.0
KL_VALUE_CLAMP = 10.0
KL_IS_WEIGHT_CLIP = 10.0


def _log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp.float() - ref_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp, ref_logp, mask=None):
    """k1 = clamp(log pi - log pi_ref, -10, 10)."""
    d = _log_ratio(logp, ref_logp).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    return d if mask is None else d * mask


@KL_ESTIMATORS.register("k2")
def kl_k2(logp, ref_logp, mask=None):
    """k2 = clamp((log pi - log pi_ref)^2 / 2, -10, 10)."""
    d = _log_ratio(logp, ref_logp)
    out = (0.5 * d * d).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    return out if mask is None else out * mask


@KL_ESTIMATORS.register("k3")
def kl_k3(logp, ref_logp, mask=None):
    """k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1, clamped to [-10, 10] (it is >= 0)."""
    neg = -_log_ratio(logp, ref_logp)
    out = (torch.exp(neg) - neg - 1.0).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    return out if mask is None else out * mask


def compute_kl(name: str, logp, ref_logp, mask=None):
    return KL_ESTIMATORS.get_fn(name)(logp, ref_logp, mask)


def kl_unbiased_gradient(value: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor,
                         old_logp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """KL loss with the true reverse-KL gradient (--kl_unbiased_gradient; OpenRLHF ``algo.kl.unbiased_gradient``).

    Forward value = the chosen estimator's ``value``; gradient = that of  w * (log pi - log pi_ref)^2 / 2  with
    w = sg(min(exp(log pi - log pi_old), 10))  (importance weight of the off-policy inner loop, 1 when old is None):
        out = sg(value) + w d^2/2 - sg(w d^2/2),   d = log pi - log pi_ref.
    Its gradient  w d grad(log pi)  is the unbiased score-function estimate of grad KL(pi || pi_ref), whatever
    the estimator (k1's pathwise gradient is 0 in expectation, k3's descends the forward KL).
    """
    d = logp.float() - ref_logp.float()
    if old_logp is None:
        w = torch.ones_like(d)
    else:
        w = torch.exp((logp.float() - old_logp.float()).clamp(max=LOG_RATIO_CLAMP)).clamp(max=KL_IS_WEIGHT_CLIP).detach()
    surrogate = w * 0.5 * d * d
    return value.detach() + surrogate - surrogate.detach()


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a 0/1 mask (0 for an all-zero row)."""
    pos = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    return (pos * (mask > 0)).max(dim=1).values


def fold_kl_into_rewards(scores: torch.Tensor, kl: Optional[torch.Tensor], kl_coef: float,
                         mask: torch.Tensor) -> torch.Tensor:
    """Per-token reward  r_t = -max(kl_coef, 0) * kl_t * m_t  +  score * [t == last action token].

    kl may be None (KL used as a loss instead).  A negative coefficient counts as 0 (OpenRLHF).
    """
    kl_coef = max(float(kl_coef), 0.0)
    mask = mask.to(torch.float32)
    if kl is None:
        rewards = torch.zeros_like(mask)
    else:
        rewards = -kl_coef * kl.float() * mask
    idx = last_token_index(mask)
    rewards = rewards.clone()
    rewards[torch.arange(mask.size(0), device=mask.device), idx] += scores.float() * (mask.sum(1) > 0)
    return rewards


class FixedKLController:
    """beta stays at its initial value."""

    def __init__(self, init_kl_coef: float):
        self.value = init_kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


class AdaptiveKLController:
    """Ziegler et al. 2019:  e = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + e * n / horizon)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        err = max(min(current_kl / self.target - 1.0, 0.2), -0.2)
        self.value *= 1.0 + err * n_steps / self.horizon


def make_kl_controller(init_kl_coef: float, kl_target: Optional[float], kl_horizon: int):
    if kl_target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
