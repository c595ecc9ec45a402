"""The advantage stage: gathered rewards, log-probs and values -> shaped rewards, advantages, returns, metrics.

Pure tensor code on the full batch (identical on every rank, no collectives): the
orchestration (which rank computes what, gathering) lives in experience.py; the
order of operations and its conventions live here, in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from rlhf.algorithms import clip_rewards, compute_advantages, compute_kl, dynamic_filter_mask, masked_mean, overlong_penalty


@dataclass
class StageInputs:
    rewards: torch.Tensor                  # (B,) reward-source rewards (invalid rows hold any value)
    scores: torch.Tensor                   # (B,) task scores (dynamic filtering, accuracy)
    valid: torch.Tensor                    # (B,) bool: the reward is finite and usable
    action_mask: torch.Tensor              # (B, R) long
    truncated: torch.Tensor                # (B,) bool
    rollout_logprobs: torch.Tensor         # (B, R) from the rollout engine
    old_logprobs: Optional[torch.Tensor]   # (B, R) actor before the update (None: single on-policy update)
    ref_logprobs: Optional[torch.Tensor]   # (B, R)
    values: Optional[torch.Tensor]         # (B, R) critic
    extra_logs: Dict[str, torch.Tensor] = field(default_factory=dict)  # per-row reward-function logs


@dataclass
class StageOutputs:
    advantages: torch.Tensor
    returns: torch.Tensor
    train_mask: torch.Tensor               # action mask with filtered / invalid rows zeroed
    metrics: Dict[str, float]


def advantage_stage(cfg, x: StageInputs, kl_coef: float, reward_norm=None) -> StageOutputs:
    a, r = cfg.algorithm, cfg.rollout
    rewards, scores, valid = x.rewards, x.scores, x.valid
    n = rewards.numel()
    mask = x.action_mask.float()
    resp_len = x.action_mask.sum(1)
    shaped = clip_rewards(rewards, a.reward_clip_range)
    shaped = shaped + overlong_penalty(resp_len, cfg.data.generate_max_len, a.overlong_buffer_len,
                                       a.overlong_penalty_factor)
    if reward_norm is not None:
        reward_norm.update(shaped[valid])
        shaped = reward_norm.normalize(shaped)
    keep = valid.clone()
    filtered = 0.0
    if a.dynamic_filtering:
        dyn = dynamic_filter_mask(scores, r.n_samples_per_prompt, a.dynamic_filtering_reward_range)
        filtered = 1.0 - dyn.float().mean().item()
        keep &= dyn
    kl = None
    kl_mean = 0.0
    if x.ref_logprobs is not None:
        kl_tok = compute_kl(a.kl_estimator, x.rollout_logprobs if x.old_logprobs is None else x.old_logprobs,
                            x.ref_logprobs, mask)
        kl_mean = float(masked_mean(kl_tok, mask))
        if not a.use_kl_loss:
            kl = kl_tok
    adv, ret = compute_advantages(a.advantage_estimator, shaped, mask, values=x.values, kl=kl, kl_coef=kl_coef,
                                  gamma=a.gamma, lambd=a.lambd, group_size=r.n_samples_per_prompt,
                                  std_norm=not a.no_advantage_std_norm)
    train_mask = x.action_mask * keep.long().unsqueeze(1)
    old = x.old_logprobs
    metrics = {
        "reward": float(rewards.mean()), "reward_std": float(rewards.std()) if n > 1 else 0.0,
        "score": float(scores.mean()),
        "shaped_reward": float(shaped.mean()), "response_len": float(resp_len.float().mean()),
        "truncated_frac": float(x.truncated.float().mean()), "kl": kl_mean, "kl_coef": kl_coef,
        "reward_invalid": float((~valid).sum()), "filtered_frac": filtered,
        "adv_mean": float(masked_mean(adv, mask)), "adv_abs": float(masked_mean(adv.abs(), mask)),
        # rollout engine vs trainer log-probs of the same tokens: ~0 on-policy, > 0 one step off-policy (async)
        "rollout_logprob_gap": 0.0 if old is None else float(masked_mean((old - x.rollout_logprobs).abs(), mask)),
        **{f"reward_{k}": float(v.float().mean()) for k, v in x.extra_logs.items()},
    }
    return StageOutputs(adv, ret, train_mask, metrics)
