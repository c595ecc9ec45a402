"""Policy-gradient losses, importance-sampling correction, entropy, value loss.

Shapes: log-probs, advantages and masks are (B, T) over response tokens.
Each loss returns ``(loss, metrics)`` where metrics are detached scalars.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .aggregation import aggregate
from .masked import masked_mean
from .registry import POLICY_LOSSES

Tensor = torch.Tensor


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_eps_low: float = 0.2,
                  clip_eps_high: float = 0.2, dual_clip: Optional[float] = None, agg_mode: str = "token-mean",
                  norm_const: Optional[float] = None, is_weights: Optional[Tensor] = None, **_) -> Tuple[Tensor, Dict]:
    """rho = exp(logp - old_logp);  l = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    Dual clip (Ye et al. 2020), for A < 0 only:  l = min(l, -c A).
    Optional token IS weights w multiply l (truncated IS for rollout/train mismatch).
    """
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(surr1, surr2)
    clipped = (surr2 > surr1).float()
    dual_frac = torch.zeros((), device=logp.device)
    if dual_clip is not None:
        capped = torch.minimum(loss, -adv * dual_clip)
        use = (adv < 0).float()
        dual_frac = masked_mean(((loss > -adv * dual_clip) & (adv < 0)).float(), mask)
        loss = use * capped + (1 - use) * loss
    if is_weights is not None:
        loss = loss * is_weights
    out = aggregate(loss, mask, agg_mode, norm_const)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clipped, mask).item(),
            "dual_clip_frac": float(dual_frac),
            "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return out, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_eps_low: float = 3e-4,
              clip_eps_high: float = 4e-4, agg_mode: str = "seq-mean-token-mean", norm_const: Optional[float] = None,
              is_weights: Optional[Tensor] = None, **_) -> Tuple[Tensor, Dict]:
    """GSPO (Zheng et al. 2025): sequence ratio s_i = exp(mean_t (logp - old_logp)), applied per token as
    s_it = sg(s_i) * pi_t / sg(pi_t), so the value is s_i and the gradient flows through each token;
    l = -min(s_it A, clip(s_it, 1-eps_low, 1+eps_high) A)."""
    mask_f = mask.to(logp.dtype)
    seq_log_ratio = ((logp - old_logp) * mask_f).sum(1) / mask_f.sum(1).clamp(min=1.0)
    log_ratio_tok = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(1)
    ratio = torch.exp(log_ratio_tok.clamp(max=10.0))
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(surr1, surr2)
    if is_weights is not None:
        loss = loss * is_weights
    out = aggregate(loss, mask, agg_mode, norm_const)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((surr2 > surr1).float(), mask).item(),
                   "approx_kl": masked_mean(0.5 * (logp - old_logp) ** 2, mask).item(),
                   "ratio_mean": torch.exp(seq_log_ratio).mean().item(), "dual_clip_frac": 0.0}
    return out, metrics


def importance_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float = 2.0,
                       seq_mask_threshold: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """Truncated IS for the rollout engine's sampling distribution differing from the trainer's:
    w_t = min(exp(old_logp_t - rollout_logp_t), cap), detached.

    With seq_mask_threshold tau, a sequence whose geometric-mean ratio lies outside [1/tau, tau]
    is masked out entirely.  Returns (w (B, T), sequence keep mask (B,)).
    """
    with torch.no_grad():
        log_w = (old_logp.float() - rollout_logp.float()).clamp(-20.0, 20.0) * mask
        w = torch.exp(log_w).clamp(max=cap) * mask
        keep = torch.ones(mask.size(0), dtype=torch.bool, device=mask.device)
        if seq_mask_threshold is not None:
            geo = torch.exp(log_w.sum(1) / mask.sum(1).clamp(min=1))
            keep = (geo <= seq_mask_threshold) & (geo >= 1.0 / seq_mask_threshold)
        return w * keep.unsqueeze(1).to(w.dtype), keep


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v, over the last dim."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: Optional[float] = 0.5,
               agg_mode: str = "token-mean") -> Tuple[Tensor, Dict]:
    """Clipped value loss:  V_c = V_old + clip(V - V_old, -c, c);
    l = 0.5 * max((V - R)^2, (V_c - R)^2)   (plain 0.5 (V - R)^2 when clip is None)."""
    err = (values - returns) ** 2
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_c = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(err, err_c)
        frac = masked_mean((err_c > err).float(), mask).item()
    else:
        loss, frac = 0.5 * err, 0.0
    return aggregate(loss, mask, agg_mode), {"vf_clip_frac": frac}


def policy_loss(name: str, *args, **kwargs):
    return POLICY_LOSSES.get_fn(name)(*args, **kwargs)
