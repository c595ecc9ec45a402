"""Policy-gradient losses, importance-sampling correction, entropy, value loss.

Shapes: log-probs, advantages and masks are (B, T) over response tokens.  Each loss
returns ``(loss, metrics)`` where metrics are detached floats.  ``totals`` (see
aggregation.py) makes the aggregation global over the optimizer step.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from rlhf.algorithms.aggregation import LossTotals, aggregate
from rlhf.algorithms.masked import masked_mean
from rlhf.algorithms.registry import IS_CORRECTIONS, IS_GATES, POLICY_LOSSES

Tensor = torch.Tensor


def _ratio(logp: Tensor, old_logp: Tensor) -> Tuple[Tensor, Tensor]:
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    return log_ratio, torch.exp(log_ratio)


def _finish(loss, mask, agg_mode, norm_const, totals, is_weights):
    if is_weights is not None:
        loss = loss * is_weights
    return aggregate(loss, mask, agg_mode, norm_const, totals)


@POLICY_LOSSES.register("ppo", forced_agg=None)
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_eps_low: float = 0.2,
                  clip_eps_high: float = 0.2, dual_clip: Optional[float] = None, agg_mode: str = "token-mean",
                  norm_const: Optional[float] = None, is_weights: Optional[Tensor] = None,
                  totals: Optional[LossTotals] = None) -> Tuple[Tensor, Dict]:
    """rho = exp(logp - old_logp);  l = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    Dual clip (Ye et al. 2020), for A < 0 only:  l = min(l, -c A).
    Optional token IS weights w multiply l (rollout/train mismatch, see IS_CORRECTIONS).
    """
    log_ratio, ratio = _ratio(logp, old_logp)
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(surr1, surr2)
    clipped = (surr2 > surr1).float()
    dual_frac = 0.0
    if dual_clip is not None:
        capped = torch.minimum(loss, -adv * dual_clip)
        use = (adv < 0).float()
        dual_frac = float(masked_mean(((loss > -adv * dual_clip) & (adv < 0)).float(), mask))
        loss = use * capped + (1 - use) * loss
    out = _finish(loss, mask, agg_mode, norm_const, totals, is_weights)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean(clipped, mask).item(), "dual_clip_frac": dual_frac,
                   "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask).item(),
                   "ratio_mean": masked_mean(ratio, mask).item()}
    return out, metrics


@POLICY_LOSSES.register("gspo", forced_agg="seq-mean-token-mean")
def gspo_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_eps_low: float = 3e-4,
              clip_eps_high: float = 4e-4, agg_mode: str = "seq-mean-token-mean", norm_const: Optional[float] = None,
              is_weights: Optional[Tensor] = None, totals: Optional[LossTotals] = None) -> Tuple[Tensor, Dict]:
    """GSPO (Zheng et al. 2025): s_i = exp(mean_t (logp - old_logp)) (gradient through every token's logp);
    l = -min(s_i A, clip(s_i, 1-eps_low, 1+eps_high) A), aggregated seq-mean-token-mean whatever
    --loss_agg_mode (``agg_mode``) says (OpenRLHF forces sequence-level aggregation for GSPO: ``forced_agg``)."""
    mask_f = mask.to(logp.dtype)
    seq_log_ratio = ((logp - old_logp) * mask_f).sum(1) / mask_f.sum(1).clamp(min=1.0)
    ratio = torch.exp(seq_log_ratio.clamp(max=10.0)).unsqueeze(1) * mask_f
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(surr1, surr2)
    out = _finish(loss, mask, "seq-mean-token-mean", norm_const, totals, is_weights)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((surr2 > surr1).float(), mask).item(),
                   "approx_kl": masked_mean(0.5 * (logp - old_logp) ** 2, mask).item(),
                   "ratio_mean": torch.exp(seq_log_ratio).mean().item(), "dual_clip_frac": 0.0}
    return out, metrics


@POLICY_LOSSES.register("cispo", forced_agg=None)
def cispo_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, clip_eps_low: float = 0.2,
               clip_eps_high: float = 0.2, agg_mode: str = "token-mean", norm_const: Optional[float] = None,
               is_weights: Optional[Tensor] = None, totals: Optional[LossTotals] = None) -> Tuple[Tensor, Dict]:
    """CISPO (MiniMax-M1, veRL ``cispo``): l = -sg(clip(rho, 1-eps_low, 1+eps_high)) * A * logp.

    The clipped ratio is a detached weight, so every token keeps a gradient A * grad(logp) scaled by it."""
    log_ratio, ratio = _ratio(logp, old_logp)
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = -clipped.detach() * adv * logp
    out = _finish(loss, mask, agg_mode, norm_const, totals, is_weights)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((ratio != clipped).float(), mask).item(), "dual_clip_frac": 0.0,
                   "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask).item(),
                   "ratio_mean": masked_mean(ratio, mask).item()}
    return out, metrics


@POLICY_LOSSES.register("sapo", forced_agg="seq-mean-token-mean")
def sapo_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, sapo_tau_pos: float = 1.0,
              sapo_tau_neg: float = 1.05, agg_mode: str = "seq-mean-token-mean", norm_const: Optional[float] = None,
              is_weights: Optional[Tensor] = None, totals: Optional[LossTotals] = None) -> Tuple[Tensor, Dict]:
    """SAPO (arXiv 2511.20347, veRL ``sapo``): a soft gate instead of a hard clip,
    f(rho) = sigmoid(tau (rho - 1)) * 4 / tau,  tau = tau_pos if A > 0 else tau_neg;  l = -f(rho) A,
    aggregated seq-mean-token-mean whatever ``agg_mode`` says (as veRL; ``forced_agg``).  At rho = 1 the gradient
    equals PPO's: f'(1) = 1."""
    log_ratio, ratio = _ratio(logp, old_logp)
    tau = torch.where(adv > 0, torch.as_tensor(sapo_tau_pos, dtype=ratio.dtype),
                      torch.as_tensor(sapo_tau_neg, dtype=ratio.dtype))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = -gate * adv
    out = _finish(loss, mask, "seq-mean-token-mean", norm_const, totals, is_weights)
    with torch.no_grad():
        metrics = {"clip_frac": 0.0, "dual_clip_frac": 0.0, "approx_kl": masked_mean(0.5 * log_ratio ** 2, mask).item(),
                   "ratio_mean": masked_mean(ratio, mask).item()}
    return out, metrics


# ---- rollout-vs-trainer importance-sampling correction (--is_correction_type) ------------------------------------

def _is_log_w(old_logp, rollout_logp, mask):
    return (old_logp.float() - rollout_logp.float()).clamp(-20.0, 20.0) * mask


@IS_CORRECTIONS.register("tis")
def is_tis(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float = 0.5, high: float = 5.0) -> Tensor:
    """Truncated IS: w_t = clamp(exp(old_t - rollout_t), low, high)  (OpenRLHF ``tis``; low 0 = no lower bound)."""
    return torch.exp(_is_log_w(old_logp, rollout_logp, mask)).clamp(min=low, max=high) * mask


@IS_CORRECTIONS.register("icepop")
def is_icepop(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float = 0.5, high: float = 5.0) -> Tensor:
    """IcePop: w_t = exp(old_t - rollout_t) * [low <= w_t <= high]  (tokens outside the band are dropped)."""
    w = torch.exp(_is_log_w(old_logp, rollout_logp, mask))
    return w * ((w >= low) & (w <= high)).to(w.dtype) * mask


@IS_CORRECTIONS.register("seq-mask-tis")
def is_seq_mask_tis(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float = 0.5,
                    high: float = 5.0) -> Tensor:
    """Sequence mask: g_i = exp(mean_t (old - rollout)); w_t = exp(old_t - rollout_t) * [low <= g_i <= high]
    (OpenRLHF ``seq-mask-tis``: the band filters whole sequences, the token weights are not truncated)."""
    log_w = _is_log_w(old_logp, rollout_logp, mask)
    geo = torch.exp(log_w.sum(1) / mask.sum(1).clamp(min=1))
    keep = ((geo >= low) & (geo <= high)).to(log_w.dtype).unsqueeze(1)
    return torch.exp(log_w) * keep * mask


# ---- OpenRLHF 0.11.2's divergence gates (--is_correction_gating binary_kl | tv) -----------------------------------
# openrlhf/models/loss.py PolicyLoss (is_correction_level / _mode / _gating): with p = rollout prob, q = trainer
# (old) prob of the sampled token, both clamped to [1e-6, 1 - 1e-6], a gate statistic is read per token (level
# token) or as its masked mean per sequence (level seq); units outside [low, high] are dropped (mode mask) and the
# survivors keep the token weight exp(old - rollout).  A divergence takes an upper bound only.

def _probs(old_logp: Tensor, rollout_logp: Tensor) -> Tuple[Tensor, Tensor]:
    p = torch.exp(rollout_logp.float()).clamp(1e-6, 1 - 1e-6)
    q = torch.exp(old_logp.float()).clamp(1e-6, 1 - 1e-6)
    return p, q


@IS_GATES.register("binary_kl")
def gate_binary_kl(old_logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """Sampled-token binary KL(rollout || trainer): d_t = p log(p / q) + (1 - p) log((1 - p) / (1 - q)),
    p = exp(rollout_t), q = exp(old_t) clamped to [1e-6, 1 - 1e-6] (OpenRLHF 0.11.2 ``binary_kl``)."""
    p, q = _probs(old_logp, rollout_logp)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


@IS_GATES.register("tv")
def gate_tv(old_logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """Sampled-token total variation: d_t = |p - q|, p = exp(rollout_t), q = exp(old_t) clamped to
    [1e-6, 1 - 1e-6] (OpenRLHF 0.11.2 ``tv``)."""
    p, q = _probs(old_logp, rollout_logp)
    return (p - q).abs()


def divergence_gated_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, gating: str, level: str,
                             low: float = 0.0, high: float = 5e-3) -> Tensor:
    """Mask-mode IS weights gated by a divergence d (IS_GATES[gating]):
    level token: w_t = exp(old_t - rollout_t) * [low <= d_t <= high];
    level seq:   D_i = sum_t m_t d_t / sum_t m_t,  w_t = exp(old_t - rollout_t) * [low <= D_i <= high]."""
    d = IS_GATES.get_fn(gating)(old_logp, rollout_logp)
    if level == "seq":
        d = ((d * mask).sum(1) / mask.sum(1).clamp(min=1)).unsqueeze(1)
    elif level != "token":
        raise ValueError(f"--is_correction_level {level!r}: use token or seq")
    keep = ((d >= low) & (d <= high)).to(torch.float32)
    return torch.exp(_is_log_w(old_logp, rollout_logp, mask)) * keep * mask


# (level, mode) of OpenRLHF 0.11.2 -> the correction kind of 0.11.0 / the flat --is_correction_type
IS_LEVEL_MODE_KIND = {("token", "clip"): "tis", ("token", "mask"): "icepop", ("seq", "mask"): "seq-mask-tis"}


def importance_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, kind: str = "tis", low: float = 0.5,
                       high: float = 5.0, gating: str = "ratio") -> Tensor:
    """Detached (B, T) weights of the chosen correction; 0 outside the mask.  gating "ratio" gates the IS ratio
    itself (IS_CORRECTIONS[kind]); "binary_kl" / "tv" gate a divergence at the level of the mask kind
    (icepop: token, seq-mask-tis: seq; see divergence_gated_weights)."""
    with torch.no_grad():
        if gating == "ratio":
            return IS_CORRECTIONS.get_fn(kind)(old_logp, rollout_logp, mask.float(), low, high)
        level = {"icepop": "token", "seq-mask-tis": "seq"}.get(kind)
        if level is None:
            raise ValueError(f"--is_correction_gating {gating} drops units (mode mask); --is_correction_type {kind} "
                             f"clamps: use --is_correction_type icepop (token) or seq-mask-tis (seq)")
        return divergence_gated_weights(old_logp, rollout_logp, mask.float(), gating, level, low, high)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v, over the last dim."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: Optional[float] = 0.5,
               agg_mode: str = "token-mean", totals: Optional[LossTotals] = None) -> Tuple[Tensor, Dict]:
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
    return aggregate(loss, mask, agg_mode, None, totals), {"vf_clip_frac": frac}
