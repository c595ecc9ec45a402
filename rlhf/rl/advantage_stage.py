"""The advantage stage: gathered rewards, log-probs and values -> shaped rewards, advantages, returns, metrics.

Pure tensor code on the full batch (identical on every rank, no collectives): the
orchestration (which rank computes what, gathering) lives in experience.py; the
order of operations and its conventions live here, in one place (OpenRLHF's order):

  1. length penalties on the raw reward: DAPO overlong (floored at -factor), then ProRL stop-properly;
  2. optional running normalisation (--running_reward_norm, over valid rewards; OpenRLHF's --normalize_reward is
     not this: it rescales the reward model's score by its saved mean / std, ``reward_model_stats`` in rlhf.rewards.reward_model);
  3. dynamic filtering (which groups train);
  4. KL per token: estimator(old log-probs, ref log-probs), clamped to [-10, 10]; kl_coef < 0 counts as 0;
  5. the estimator: group baseline -> clip to --reward_clip_range -> KL folded in -> returns -> whitening, over
     the rows that train (valid and not filtered: OpenRLHF computes advantages over the accepted samples only,
     so filtered groups enter neither flash_reinforce's batch mean nor the whitening moments).

Invalid rewards (``valid`` False) enter no statistic: not the group baselines, not the whitening, not the
``reward`` metrics; their rows get advantage 0 and no loss.  A batch with no valid reward warns, and
``--max_invalid_reward_batches`` such batches in a row stop the run with a message (an ``InvalidRewardGuard``).
Because every rank runs this on the same data, every rank raises together: no rank waits.
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Dict, Optional

import torch

from rlhf.algorithms import (
    ADVANTAGE_ESTIMATORS,
    RunningMeanStd,
    compute_advantages,
    compute_kl,
    dynamic_filter_mask,
    masked_mean,
    overlong_penalty,
    stop_properly_penalty,
)
from rlhf.batch import Batch
from rlhf.utils.cadence import StreakGuard


def kl_in_reward(a) -> bool:
    """The KL penalty is folded into the rewards (not a loss) and has a reference model to compare with (``a``: the
    algorithm group, AlgorithmConfig)."""
    return a.init_kl_coef > 0 and not a.use_kl_loss


def needs_old_logprobs(a, on_policy_single_update: bool) -> bool:
    """Old log-probs must be computed unless the update is a single on-policy step AND nothing else needs them:
    KL in the reward must use the actor's log-probs (OpenRLHF), not the rollout engine's, which differ."""
    return not on_policy_single_update or kl_in_reward(a)


def running_reward_norm(a) -> Optional[RunningMeanStd]:
    """The running mean / std every reward is normalised by (step 2), only with --running_reward_norm (``a``: the
    algorithm group)."""
    return RunningMeanStd() if a.running_reward_norm else None


class InvalidRewardGuard(StreakGuard):
    """Consecutive batches without a single valid reward."""

    flag = "--max_invalid_reward_batches"
    fix = "Check the reward function / reward model output"

    def check(self, n_valid: int, n: int) -> None:
        self.record(None if n_valid > 0 else (
            lambda k: f"all {n} rewards of this batch are invalid (NaN or failed reward call): nothing trains "
                      f"({k} such batch(es) in a row)"), stacklevel=3)


_WARNED = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, UserWarning, stacklevel=3)


def advantage_stage(a, x: Batch, kl_coef: float, generate_max_len: int, group_size: int, reward_norm=None,
                    guard: Optional[InvalidRewardGuard] = None) -> Batch:
    """``x``'s rewards, scores, valid, extra_logs, action_mask, truncated and log-probs / values -> a copy with
    ``advantages``, ``returns`` (both 0 where nothing trains), ``action_mask`` zeroed on the rows that train nothing
    (invalid or filtered) and ``metrics`` (this stage's only).  ``a``: the algorithm group (AlgorithmConfig);
    ``generate_max_len`` (--generate_max_len) is the overlong penalty's limit, ``group_size``
    (--n_samples_per_prompt) the rows of one prompt's group."""
    n = x.rewards.numel()
    valid = x.valid.bool() & torch.isfinite(x.rewards.float())
    rewards = torch.where(valid, x.rewards.float(), torch.zeros_like(x.rewards, dtype=torch.float32))
    n_valid = int(valid.sum())
    if guard is not None:  # the trainer's, counting batches across steps
        guard.check(n_valid, n)
    kl_coef = max(float(kl_coef), 0.0)
    mask = x.action_mask.float()
    resp_len = x.action_mask.sum(1)
    # 1. length penalties
    pen = overlong_penalty(resp_len, generate_max_len, a.overlong_buffer_len, a.overlong_penalty_factor)
    shaped = stop_properly_penalty(rewards + pen, x.truncated, a.stop_properly_penalty_coef)
    # 2. running normalisation (--running_reward_norm; OpenRLHF's --normalize_reward rescales the RM's score instead)
    if reward_norm is not None:
        if n_valid:
            reward_norm.update(shaped[valid])
        shaped = reward_norm.normalize(shaped)
    shaped = torch.where(valid, shaped, torch.full_like(shaped, float("nan")))
    # 3. dynamic filtering
    keep = valid.clone()
    filtered = 0.0
    if a.dynamic_filtering:
        dyn = dynamic_filter_mask(x.scores, group_size, a.dynamic_filtering_reward_range, valid)
        filtered = 1.0 - dyn.float().mean().item()
        keep &= dyn
    # 4. KL
    kl = None
    kl_mean = 0.0
    if x.ref_logprobs is not None:
        cur = x.old_logprobs
        if cur is None:
            if kl_in_reward(a):
                raise ValueError("KL in the reward needs the actor's log-probs (old_logprobs): compute them "
                                 "whenever advantage_stage.needs_old_logprobs(algorithm, ...) is True")
            cur = x.rollout_logprobs  # KL is a loss here: this value is a metric only
        kl_tok = compute_kl(a.kl_estimator, cur, x.ref_logprobs, mask)
        kl_mean = float(masked_mean(kl_tok, mask * valid.unsqueeze(1)))
        if not a.use_kl_loss:
            kl = kl_tok
    # 5. estimator
    spec = ADVANTAGE_ESTIMATORS[a.advantage_estimator]
    gamma = a.gamma
    if getattr(spec, "forces_gamma1", False) and gamma != 1.0:
        _warn_once(f"gamma-{a.advantage_estimator}", f"--gamma {gamma} is ignored: {a.advantage_estimator} uses "
                                                     f"gamma = 1 (as OpenRLHF)")
        gamma = 1.0
    adv, ret = compute_advantages(a.advantage_estimator, shaped, mask, values=x.values, kl=kl, kl_coef=kl_coef,
                                  gamma=gamma, lambd=a.lambd, group_size=group_size,
                                  std_norm=not a.no_advantage_std_norm, scale=a.scale_rewards, valid=keep,
                                  clip_range=a.reward_clip_range)
    train_mask = x.action_mask * keep.long().unsqueeze(1)
    metrics = _metrics(x, valid, rewards, shaped, resp_len, mask, adv, kl_mean, kl_coef, filtered, pen,
                       group_size)
    return replace(x, advantages=adv * train_mask, returns=ret * train_mask, action_mask=train_mask, metrics=metrics)


def _vmean(t: torch.Tensor, valid: torch.Tensor) -> float:
    return float(t.float()[valid].mean()) if bool(valid.any()) else 0.0


def _gap_metric(old: Optional[torch.Tensor], rollout: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """``rollout_logprob_gap``: mean |trainer - rollout engine| log-prob of the sampled tokens, ~0 on-policy,
    > 0 one step off-policy (async) or when the engine's weights are stale.  Only when measured, i.e. when the
    trainer computed its own (old) log-probs this step (``needs_old_logprobs``); absent otherwise, never a 0.0
    that was not measured (issue 26 item 4: a fake 0.0 hid a stale vLLM LM head)."""
    if old is None:
        return {}
    return {"rollout_logprob_gap": float(masked_mean((old - rollout).abs(), mask))}


def _metrics(x, valid, rewards, shaped, resp_len, mask, adv, kl_mean, kl_coef, filtered, pen, group) -> Dict[str, float]:
    n = rewards.numel()
    vr = rewards[valid]
    old = x.old_logprobs
    vmask = mask * valid.unsqueeze(1)
    invalid_groups = 0.0
    if group > 1 and n % group == 0:
        invalid_groups = float((valid.view(-1, group).sum(1) == 0).sum())
    return {
        "reward": float(vr.mean()) if vr.numel() else 0.0,
        "reward_std": float(vr.std()) if vr.numel() > 1 else 0.0,
        "score": _vmean(x.scores, valid & torch.isfinite(x.scores.float())),
        "shaped_reward": _vmean(shaped, valid), "response_len": float(resp_len.float().mean()),
        "truncated_frac": float(x.truncated.float().mean()), "kl": kl_mean, "kl_coef": kl_coef,
        "reward_invalid": float((~valid).sum()), "reward_invalid_groups": invalid_groups,
        "reward_all_invalid": float(not bool(valid.any())), "filtered_frac": filtered,
        "overlong_penalized": float((pen < 0).sum()),
        "adv_mean": float(masked_mean(adv, vmask)), "adv_abs": float(masked_mean(adv.abs(), vmask)),
        **_gap_metric(old, x.rollout_logprobs, mask),
        **{f"reward_{k}": _vmean(v, valid & torch.isfinite(v.float())) for k, v in (x.extra_logs or {}).items()},
    }
