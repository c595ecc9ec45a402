"""OpenRLHF parity, rewards and advantages: every convention pinned with numbers computed by hand (see README
"Algorithms and parity"). One section per formula, each naming OpenRLHF's file."""
import warnings

import pytest
import torch
from helpers.parity import NAN, T, close

from rlhf.algorithms import (
    compute_advantages,
    dynamic_filter_mask,
    dynamic_filter_refill,
    dynamic_filter_select,
    masked_whiten,
    overlong_penalty,
    stop_properly_penalty,
)
from rlhf.config import TrainConfig

# ---- whitening A' = (A - mean) / sqrt(max(var_biased, 1e-8)) ---------------------------------------------------------
# OpenRLHF: openrlhf/trainer/ppo_utils/experience_maker.py (rsqrt(var.clamp(min=1e-8)))

def test_whitening_biased_variance_and_eps_clamp():
    x, m = T([[1.0, 3.0]]), T([[1.0, 1.0]])
    close(masked_whiten(x, m), [[-1.0, 1.0]])           # var = ((1-2)^2 + (3-2)^2) / 2 = 1 (biased)
    close(masked_whiten(x, m, std=False), [[-1.0, 1.0]])
    close(masked_whiten(T([[2.0, 2.0 + 1e-5]]), m), [[-0.05, 0.05]], 1e-3)  # var 2.5e-11 < 1e-8: rsqrt(1e-8)


def test_no_advantage_std_norm_also_drops_std_from_global_whitening():
    m = torch.ones(2, 1)
    adv, _ = compute_advantages("reinforce", T([1.0, 5.0]), m, std_norm=False)
    close(adv[:, 0], [-2.0, 2.0])                        # centred only
    adv, _ = compute_advantages("reinforce", T([1.0, 5.0]), m)
    close(adv[:, 0], [-1.0, 1.0])                        # centred and divided by the biased std 2


# ---- group estimators: group_norm A = (s - mean_g) / (std_g + 1e-9) (unbiased std), rloo, dr_grpo,
# reinforce_baseline; gamma 1
# OpenRLHF: openrlhf/trainer/ppo_utils/experience_maker.py compute_advantages_and_returns

def test_group_norm_eps_and_unbiased_group_std():
    adv, _ = compute_advantages("group_norm", T([1.0, 3.0]), torch.ones(2, 1), group_size=2)
    s = 2 ** 0.5                                          # unbiased std of {1, 3}
    close(adv[:, 0], [-1 / (s + 1e-9), 1 / (s + 1e-9)])
    adv, _ = compute_advantages("group_norm", T([5.0, 5.0]), torch.ones(2, 1), group_size=2)
    close(adv[:, 0], [0.0, 0.0])                          # zero std: 0 / 1e-9 = 0


def test_scale_rewards_batch_and_none():
    scores = T([0.0, 2.0, 4.0, 4.0])                      # groups {0, 2} and {4, 4}
    bstd = float(scores.std())                            # unbiased std over the batch = sqrt(11/3)
    adv, _ = compute_advantages("group_norm", scores, torch.ones(4, 1), group_size=2, scale="batch")
    close(adv[:, 0], [-1 / bstd, 1 / bstd, 0.0, 0.0], 1e-6)
    adv, _ = compute_advantages("group_norm", scores, torch.ones(4, 1), group_size=2, scale="none")
    close(adv[:, 0], [-1.0, 1.0, 0.0, 0.0])
    adv, _ = compute_advantages("group_norm", scores, torch.ones(4, 1), group_size=2, std_norm=False)
    close(adv[:, 0], [-1.0, 1.0, 0.0, 0.0])              # --no_advantage_std_norm: mean only


def test_gamma_forced_to_one_for_group_estimators():
    from rlhf.rl.advantage_stage import advantage_stage

    cfg = _stage_cfg("rloo", gamma=0.5)
    x = _stage_inputs(T([1.0, 0.0]), valid=T([True, True]), mask=T([[1, 1], [1, 1]]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = advantage_stage(cfg.algorithm, x, 0.0, cfg.data.generate_max_len, cfg.rollout.n_samples_per_prompt)
    close(out.advantages, [[1.0, 1.0], [-1.0, -1.0]])   # with gamma 0.5 the first token would get 0.5
    assert any("gamma" in str(m.message) for m in w)


# ---- reward shaping: clip(s - baseline, -10, 10); KL in the reward r_t = -beta KL_t (+ s at the last token); overlong
# penalty; stop-properly penalty
# OpenRLHF: openrlhf/trainer/ppo_utils/experience_maker.py, openrlhf/models/utils.py compute_reward

def test_reward_clip_after_baseline_default_range():
    cfg = TrainConfig()
    assert cfg.algorithm.reward_clip_range == (-10.0, 10.0)
    # rloo on {0, 30}: baselines 30 and 0 -> s' = -30, 30, then clipped to -10, 10 (clip after the baseline)
    adv, _ = compute_advantages("rloo", T([0.0, 30.0]), torch.ones(2, 1), group_size=2, clip_range=(-10.0, 10.0))
    close(adv[:, 0], [-10.0, 10.0])
    # gae: score 30 clipped to 10 at the last token, then the KL penalty is added on top (not clipped)
    _, ret = compute_advantages("gae", T([30.0]), T([[1, 1]]), values=torch.zeros(1, 2), kl=T([[1.0, 1.0]]),
                                kl_coef=0.5, gamma=1.0, lambd=1.0, whiten=False, clip_range=(-10.0, 10.0))
    close(ret, [[-0.5 + 9.5, 9.5]])


def test_kl_in_reward_requires_actor_logprobs():
    from rlhf.rl.advantage_stage import needs_old_logprobs

    cfg = _stage_cfg("group_norm")
    cfg.algorithm.init_kl_coef, cfg.algorithm.use_kl_loss = 0.1, False
    assert needs_old_logprobs(cfg.algorithm, on_policy_single_update=True)       # KL in the reward: actor log-probs
    cfg.algorithm.use_kl_loss = True
    assert not needs_old_logprobs(cfg.algorithm, on_policy_single_update=True)   # KL loss: the trainer's own log-probs
    assert needs_old_logprobs(cfg.algorithm, on_policy_single_update=False)


def test_overlong_penalty_floor():
    # L_max 10, buffer 4: zero up to 6 tokens, -0.5 at 8, -factor at 10, and still -factor at 40 (agent episodes)
    close(overlong_penalty(T([6, 8, 10, 40]), 10, 4, 2.0), [0.0, -1.0, -2.0, -2.0])


def test_stop_properly_penalty():
    r, trunc = T([1.0, 1.0, -2.0]), T([True, False, True])
    close(stop_properly_penalty(r, trunc, 0.5), [0.5, 1.0, -1.0])    # c >= 0: scale truncated rewards
    close(stop_properly_penalty(r, trunc, -0.5), [-0.5, 1.0, -0.5])  # c < 0: set them to c
    close(stop_properly_penalty(r, trunc, None), [1.0, 1.0, -2.0])
    with pytest.raises(ValueError, match="stop_properly_penalty_coef"):
        stop_properly_penalty(r, trunc, 1.5)


# ---- dynamic filtering: keep a group when lo < mean_g(s) < hi; refill ceil(missing / pass rate) ----------------------
# OpenRLHF: openrlhf/trainer/ppo_utils/experience_maker.py (dynamic_filtering)

def test_dynamic_filtering_openrlhf_rule_and_refill():
    # groups of 2: means 1, 0.5, 0, and 0.5 (an all-equal 0.5 group is kept: OpenRLHF keeps lo < mean < hi)
    keep = dynamic_filter_mask(T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5]), 2, (0.0, 1.0))
    assert keep.tolist() == [False, False, True, True, False, False, True, True]
    assert dynamic_filter_refill(kept_groups=2, target_groups=4) == 2
    assert dynamic_filter_refill(kept_groups=2, target_groups=4, pass_rate=0.5) == 4   # ceil(2 / 0.5)
    assert dynamic_filter_refill(kept_groups=2, target_groups=4, pass_rate=0.1, max_extra=8) == 8
    assert dynamic_filter_refill(kept_groups=5, target_groups=4) == 0
    # the rows of the first 1 (then all) kept groups: groups 1 and 3 are kept
    assert dynamic_filter_select(keep, 2, 1).tolist() == [2, 3]
    assert dynamic_filter_select(keep, 2, 4).tolist() == [2, 3, 6, 7]


# ---- NaN rewards: excluded from every group statistic, their rows get A = 0 ------------------------------------------
# OpenRLHF: (this project; OpenRLHF has no NaN rule)

ONE = torch.ones(3, 1)


def test_nan_excluded_from_group_norm():
    # group {1, 0, NaN}: stats over {1, 0}: mean 0.5, unbiased std sqrt(0.5)
    adv, _ = compute_advantages("group_norm", T([1.0, 0.0, NAN]), ONE, group_size=3)
    s = 0.5 / (0.5 ** 0.5 + 1e-9)
    close(adv[:, 0], [s, -s, 0.0])
    # valid siblings of a NaN that agree get 0 (NaN counted as 0 would give them 0.577 each)
    adv, _ = compute_advantages("group_norm", T([1.0, 1.0, NAN]), ONE, group_size=3)
    close(adv[:, 0], [0.0, 0.0, 0.0])


def test_nan_excluded_from_rloo_reinforce_baseline_dr_grpo():
    adv, _ = compute_advantages("rloo", T([1.0, 3.0, NAN]), ONE, group_size=3)
    close(adv[:, 0], [-2.0, 2.0, 0.0])                     # leave-one-out over the 2 valid: k - 1 = 1
    adv, _ = compute_advantages("dr_grpo", T([1.0, 3.0, NAN]), ONE, group_size=3)
    close(adv[:, 0], [-1.0, 1.0, 0.0])
    _, ret = compute_advantages("reinforce_baseline", T([1.0, 3.0, NAN]), ONE, group_size=3)
    close(ret[:, 0], [-1.0, 1.0, 0.0])
    adv, _ = compute_advantages("reinforce_baseline", T([1.0, 3.0, NAN]), ONE, group_size=3)
    close(adv[:, 0], [-1.0, 1.0, 0.0])                     # whitened over the 2 valid tokens only
    # valid=False excludes a finite reward the same way
    adv, _ = compute_advantages("rloo", T([1.0, 3.0, 100.0]), ONE, group_size=3, valid=T([True, True, False]))
    close(adv[:, 0], [-2.0, 2.0, 0.0])


def test_single_valid_and_all_nan_groups_get_zero():
    adv, _ = compute_advantages("group_norm", T([1.0, NAN, NAN, NAN, NAN, NAN]), torch.ones(6, 1), group_size=3)
    close(adv[:, 0], [0.0] * 6)


def _stage_cfg(est, **alg):
    cfg = TrainConfig()
    cfg.algorithm.advantage_estimator = est
    cfg.rollout.n_samples_per_prompt = 2
    cfg.data.generate_max_len = 2
    for k, v in alg.items():
        setattr(cfg.algorithm, k, v)
    return cfg


def _stage_inputs(rewards, valid, mask):
    from rlhf.batch import Batch

    b, r = mask.shape
    return Batch(rewards=rewards, scores=rewards.clone(), valid=valid, action_mask=mask,
                 truncated=torch.zeros(b, dtype=torch.bool), rollout_logprobs=torch.zeros(b, r))


def test_stage_nan_metrics_counts_and_guard():
    from rlhf.rl.advantage_stage import InvalidRewardGuard, advantage_stage

    cfg = _stage_cfg("group_norm", max_invalid_reward_batches=2)
    mask = torch.ones(4, 2, dtype=torch.long)
    x = _stage_inputs(T([1.0, NAN, NAN, NAN]), T([True, False, False, False]), mask)
    guard = InvalidRewardGuard(2)
    out = advantage_stage(cfg.algorithm, x, 0.0, cfg.data.generate_max_len, cfg.rollout.n_samples_per_prompt, guard=guard)
    assert out.metrics["reward"] == 1.0                   # NaN is not counted as 0 (that would give 0.25)
    assert out.metrics["reward_invalid"] == 3.0 and out.metrics["reward_invalid_groups"] == 1.0
    close(out.advantages, torch.zeros(4, 2))
    assert out.action_mask[1:].sum() == 0                  # invalid rows train on nothing
    allnan = _stage_inputs(T([NAN] * 4), T([False] * 4), mask)
    with pytest.warns(RuntimeWarning, match="all 4 rewards of this batch are invalid"):
        advantage_stage(cfg.algorithm, allnan, 0.0, cfg.data.generate_max_len, cfg.rollout.n_samples_per_prompt, guard=guard)
    with pytest.raises(RuntimeError, match="--max_invalid_reward_batches 2"):
        advantage_stage(cfg.algorithm, allnan, 0.0, cfg.data.generate_max_len, cfg.rollout.n_samples_per_prompt, guard=guard)
    # a valid batch resets the streak
    advantage_stage(cfg.algorithm, x, 0.0, cfg.data.generate_max_len, cfg.rollout.n_samples_per_prompt, guard=guard)
    assert guard.streak == 0


# ---- GAE delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum (gamma lambda)^k delta_{t+k}, default lambda = gamma = 1 -----
# OpenRLHF: openrlhf/trainer/ppo_utils/experience_maker.py get_advantages_and_returns, openrlhf/cli/train_ppo_ray.py

def test_gae_with_default_lambda_is_openrlhf_monte_carlo():
    """With OpenRLHF's default lambd = gamma = 1 (openrlhf/trainer/ppo_utils/experience_maker.py
    ``get_advantages_and_returns``), A_t = sum_{u>=t} r_u - V_t: rewards r = (0, 0, 1), values (0.5, 0.2, 0.4) give
    A = (0.5, 0.8, 0.6), returns 1; lambda 0.95 (this project's old default) gives A = (0.4315, 0.77, 0.6)."""
    from rlhf.config import parse

    lambd = parse("ppo", []).algorithm.lambd
    adv, ret = compute_advantages("gae", T([1.0]), T([[1, 1, 1]]), values=T([[0.5, 0.2, 0.4]]), gamma=1.0,
                                  lambd=lambd, whiten=False, clip_range=(-10.0, 10.0))
    close(adv, [[0.5, 0.8, 0.6]])
    close(ret, [[1.0, 1.0, 1.0]])
    # the estimator's own default is OpenRLHF's too
    adv2, _ = compute_advantages("gae", T([1.0]), T([[1, 1, 1]]), values=T([[0.5, 0.2, 0.4]]), whiten=False)
    close(adv2, [[0.5, 0.8, 0.6]])


# ---- FlashREINFORCE: s' = s - mean_batch(s), return-to-go with the KL penalty ----------------------------------------
# OpenRLHF: openrlhf/trainer/ppo_utils/experience_maker.py (flash_reinforce)

def test_flash_reinforce_batch_mean_by_hand():
    """FlashREINFORCE (OpenRLHF 0.11.2 experience_maker.py: ``rewards = rewards - rewards.mean()`` over the whole
    rollout batch, no group, no whitening, gamma 1): scores (1, 0, 0, 3) -> mean 1 -> s' = (0, -1, -1, 2); with a
    KL of 1 per token and coefficient 0.1 the return-to-go of a 2-token row is (s' - 0.2, s' - 0.1)."""
    mask = torch.ones(4, 2)
    adv, ret = compute_advantages("flash_reinforce", T([1.0, 0.0, 0.0, 3.0]), mask, kl=torch.ones(4, 2),
                                  kl_coef=0.1, clip_range=(-10.0, 10.0), group_size=2)
    s = T([0.0, -1.0, -1.0, 2.0])
    close(adv, torch.stack([s - 0.2, s - 0.1], 1))
    close(ret, adv)
    # not whitened and not grouped: a group-of-2 baseline would give (0.5, -0.5, -1.5, 1.5)
    adv, _ = compute_advantages("flash_reinforce", T([1.0, 0.0, 0.0, 3.0]), torch.ones(4, 1))
    close(adv[:, 0], [0.0, -1.0, -1.0, 2.0])
    # an invalid (NaN) reward enters no mean and gets 0
    adv, _ = compute_advantages("flash_reinforce", T([1.0, NAN, 3.0]), torch.ones(3, 1))
    close(adv[:, 0], [-1.0, 0.0, 1.0])


def test_flash_reinforce_stage_single_sample_gamma_and_filtering():
    """Through the advantage stage: n_samples_per_prompt 1 is accepted (no group), --gamma is forced to 1 with a
    warning (OpenRLHF: "gamma is set to 1.0 for flash_reinforce"), and the batch mean is over the rows that train."""
    from rlhf.config import parse
    from rlhf.rl.advantage_stage import advantage_stage

    cfg = parse("ppo", ["--advantage_estimator", "flash_reinforce", "--n_samples_per_prompt", "1",
                        "--rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "1",
                        "--gamma", "0.5"])
    assert cfg.algorithm.advantage_estimator == "flash_reinforce" and cfg.model.critic_pretrain is None
    x = _stage_inputs(T([1.0, 0.0, 0.0, 3.0]), valid=torch.ones(4, dtype=torch.bool), mask=torch.ones(4, 2))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = advantage_stage(cfg.algorithm, x, 0.0, cfg.data.generate_max_len, cfg.rollout.n_samples_per_prompt)
    close(out.advantages, [[0.0, 0.0], [-1.0, -1.0], [-1.0, -1.0], [2.0, 2.0]])
    assert any("gamma" in str(m.message) for m in w), "--gamma 0.5 with flash_reinforce should warn"
    # dynamic filtering (groups of 2): group 0 {1, 0} kept, group 1 {0, 3} mean 1.5 outside (0, 1) dropped:
    # the batch mean is over the kept rows only (0.5), as OpenRLHF computes advantages over accepted samples
    cfg = _stage_cfg("flash_reinforce", dynamic_filtering=True, dynamic_filtering_reward_range=(0.0, 1.0))
    out = advantage_stage(cfg.algorithm, x, 0.0, cfg.data.generate_max_len, cfg.rollout.n_samples_per_prompt)
    close(out.advantages, [[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]])
