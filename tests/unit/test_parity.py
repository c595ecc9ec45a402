"""OpenRLHF parity: every convention pinned with numbers computed by hand (see README "Algorithms and parity").

Each test names the convention it pins; the 2-rank test checks that a step split into micro-batches and
data-parallel ranks has the loss and gradient of one full-batch computation.
"""
import math
import warnings

import pytest
import torch
from helpers.mp import spawn

from rlhf.algorithms import (
    IS_CORRECTIONS,
    IS_GATES,
    POLICY_LOSSES,
    LossTotals,
    aggregate,
    compute_advantages,
    compute_kl,
    dynamic_filter_mask,
    dynamic_filter_refill,
    dynamic_filter_select,
    fold_kl_into_rewards,
    importance_weights,
    kl_unbiased_gradient,
    masked_whiten,
    overlong_penalty,
    stop_properly_penalty,
)
from rlhf.algorithms.preference import rm_logsigmoid
from rlhf.config import TrainConfig

T = torch.tensor
NAN = float("nan")


def close(a, b, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape and torch.allclose(a, b, atol=tol), f"got {a.tolist()}, expected {b.tolist()}"


# ---- bug 1: global normalisation over the optimizer step --------------------------------------------------------

LOSS_A, MASK_A = T([[1.0, 2.0, 3.0]]), T([[1.0, 1.0, 1.0]])      # micro-batch 1: one 3-token row
LOSS_B, MASK_B = T([[4.0, 0.0, 0.0]]), T([[1.0, 0.0, 0.0]])      # micro-batch 2: one 1-token row
STEP = LossTotals(tokens=4.0, seqs=2.0)


@pytest.mark.parametrize("mode,full", [("token-mean", (1 + 2 + 3 + 4) / 4),          # every token weighs 1/4
                                       ("seq-mean-token-mean", (2.0 + 4.0) / 2),     # row means 2 and 4
                                       ("seq-mean-token-sum", (6.0 + 4.0) / 2),
                                       ("seq-mean-token-sum-norm", 10.0 / (2 * 3.0))])
def test_micro_batches_sum_to_the_full_batch_value(mode, full):
    parts = aggregate(LOSS_A, MASK_A, mode, 3.0, STEP) + aggregate(LOSS_B, MASK_B, mode, 3.0, STEP)
    close(parts, full)
    close(aggregate(torch.cat([LOSS_A, LOSS_B]), torch.cat([MASK_A, MASK_B]), mode, 3.0), full)


def test_per_micro_batch_mean_would_differ():
    naive = (aggregate(LOSS_A, MASK_A, "token-mean") + aggregate(LOSS_B, MASK_B, "token-mean")) / 2
    close(naive, 3.0)  # (2 + 4) / 2: the 1-token row weighs 1/2 instead of 1/4; the global value is 2.5
    assert abs(float(naive) - 2.5) > 0.4


# ---- bug 2: GSPO (and SAPO) aggregate per sequence whatever --loss_agg_mode says --------------------------------

def test_gspo_forces_sequence_mean():
    # two rows, 2 and 1 tokens; ratio 1 (logp = old) so l = -A on every token of the row
    lp, mask = torch.zeros(2, 2), T([[1.0, 1.0], [1.0, 0.0]])
    adv = T([[1.0, 1.0], [-2.0, -2.0]])
    for agg in ("token-mean", "seq-mean-token-sum"):
        loss, _ = POLICY_LOSSES["gspo"](lp, lp, adv, mask, agg_mode=agg)
        close(loss, (-1.0 + 2.0) / 2)  # seq-mean-token-mean = 0.5; token-mean would be (-1 -1 +2)/3
    assert POLICY_LOSSES["gspo"].forced_agg == "seq-mean-token-mean"


# ---- bug 3: overlong penalty floor -------------------------------------------------------------------------------

def test_overlong_penalty_floor():
    # L_max 10, buffer 4: zero up to 6 tokens, -0.5 at 8, -factor at 10, and still -factor at 40 (agent episodes)
    close(overlong_penalty(T([6, 8, 10, 40]), 10, 4, 2.0), [0.0, -1.0, -2.0, -2.0])


# ---- conventions -------------------------------------------------------------------------------------------------

def test_whitening_biased_variance_and_eps_clamp():
    x, m = T([[1.0, 3.0]]), T([[1.0, 1.0]])
    close(masked_whiten(x, m), [[-1.0, 1.0]])           # var = ((1-2)^2 + (3-2)^2) / 2 = 1 (biased)
    close(masked_whiten(x, m, std=False), [[-1.0, 1.0]])
    close(masked_whiten(T([[2.0, 2.0 + 1e-5]]), m), [[-0.05, 0.05]], 1e-3)  # var 2.5e-11 < 1e-8: rsqrt(1e-8)


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


def test_no_advantage_std_norm_also_drops_std_from_global_whitening():
    m = torch.ones(2, 1)
    adv, _ = compute_advantages("reinforce", T([1.0, 5.0]), m, std_norm=False)
    close(adv[:, 0], [-2.0, 2.0])                        # centred only
    adv, _ = compute_advantages("reinforce", T([1.0, 5.0]), m)
    close(adv[:, 0], [-1.0, 1.0])                        # centred and divided by the biased std 2


def test_kl_estimator_clamp_and_negative_coef():
    close(compute_kl("k1", T([[30.0]]), T([[0.0]])), [[10.0]])
    close(compute_kl("k1", T([[-30.0]]), T([[0.0]])), [[-10.0]])
    close(compute_kl("k2", T([[5.0]]), T([[0.0]])), [[10.0]])        # 12.5 -> 10
    close(compute_kl("k3", T([[-5.0]]), T([[0.0]])), [[10.0]])       # e^5 - 5 - 1 = 142.4 -> 10
    close(fold_kl_into_rewards(T([1.0]), T([[1.0, 1.0]]), -0.5, T([[1, 1]])), [[0.0, 1.0]])  # beta < 0 -> 0


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


def test_gamma_forced_to_one_for_group_estimators():
    from rlhf.trainers.advantage_stage import advantage_stage

    cfg = _stage_cfg("rloo", gamma=0.5)
    x = _stage_inputs(T([1.0, 0.0]), valid=T([True, True]), mask=T([[1, 1], [1, 1]]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = advantage_stage(cfg, x, 0.0)
    close(out.advantages, [[1.0, 1.0], [-1.0, -1.0]])   # with gamma 0.5 the first token would get 0.5
    assert any("gamma" in str(m.message) for m in w)


def test_entropy_is_token_mean_and_negative_coef_applied():
    # The entropy term is aggregated token-mean (peers), and any nonzero coefficient is applied (OpenRLHF)
    ent, mask = T([[1.0, 3.0], [5.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    close(aggregate(ent, mask, "token-mean"), 3.0)       # (1 + 3 + 5) / 3, not the seq mean (2 + 5) / 2
    from rlhf.config.schema import AlgorithmConfig
    assert "negative" in AlgorithmConfig.__dataclass_fields__["entropy_loss_coef"].metadata["help"]


def test_is_corrections_by_hand():
    old = T([[math.log(0.25), math.log(1.0), math.log(8.0)]])
    roll, mask = torch.zeros(1, 3), torch.ones(1, 3)
    close(importance_weights(old, roll, mask, "tis", 0.5, 5.0), [[0.5, 1.0, 5.0]])        # lower bound too
    close(importance_weights(old, roll, mask, "icepop", 0.5, 5.0), [[0.0, 1.0, 0.0]])     # outside: dropped
    # seq-mask-tis: geometric mean of (0.25, 1, 8) = 2^(1/3) inside [0.5, 5]: token weights kept, not truncated
    close(importance_weights(old, roll, mask, "seq-mask-tis", 0.5, 5.0), [[0.25, 1.0, 8.0]])
    close(importance_weights(old, roll, mask, "seq-mask-tis", 0.5, 1.2), [[0.0, 0.0, 0.0]])
    assert sorted(IS_CORRECTIONS) == ["icepop", "seq-mask-tis", "tis"]


def test_is_divergence_gates_by_hand():
    """OpenRLHF 0.11.2 is_correction_gating binary_kl / tv (openrlhf/models/loss.py PolicyLoss): p = rollout prob,
    q = trainer prob of the sampled token; mask mode keeps the survivors' weight q / p."""
    # tokens: (p, q) = (0.5, 0.5), (0.5, 0.25), (0.2, 0.4); ratio q / p = 1, 0.5, 2
    roll = T([[math.log(0.5), math.log(0.5), math.log(0.2)]])
    old = T([[math.log(0.5), math.log(0.25), math.log(0.4)]])
    mask = torch.ones(1, 3)
    bkl = [0.0, 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), 0.2 * math.log(0.5) + 0.8 * math.log(0.8 / 0.6)]
    # = 0, 0.143841, 0.091516
    close(IS_GATES["binary_kl"](old, roll), [bkl])
    close(IS_GATES["tv"](old, roll), [[0.0, 0.25, 0.2]])
    # token level, mask: binary KL <= 0.1 keeps tokens 0 and 2 (0.1438 > 0.1 is dropped)
    close(importance_weights(old, roll, mask, "icepop", 0.0, 0.1, gating="binary_kl"), [[1.0, 0.0, 2.0]])
    close(importance_weights(old, roll, mask, "icepop", 0.0, 0.21, gating="tv"), [[1.0, 0.0, 2.0]])
    # seq level: mean binary KL (0 + 0.143841 + 0.091516) / 3 = 0.078452: inside 0.08, outside 0.07
    close(importance_weights(old, roll, mask, "seq-mask-tis", 0.0, 0.08, gating="binary_kl"), [[1.0, 0.5, 2.0]])
    close(importance_weights(old, roll, mask, "seq-mask-tis", 0.0, 0.07, gating="binary_kl"), [[0.0, 0.0, 0.0]])
    # seq level, tv: masked mean over the first two tokens only, (0 + 0.25) / 2 = 0.125 <= 0.13; padding weighs 0
    pad = T([[1.0, 1.0, 0.0]])
    close(importance_weights(old, roll, pad, "seq-mask-tis", 0.0, 0.13, gating="tv"), [[1.0, 0.5, 0.0]])
    close(importance_weights(old, roll, pad, "seq-mask-tis", 0.0, 0.12, gating="tv"), [[0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="use --is_correction_type icepop"):   # a divergence cannot clamp
        importance_weights(old, roll, mask, "tis", 0.0, 0.1, gating="tv")
    assert sorted(IS_GATES) == ["binary_kl", "tv"]


@pytest.mark.parametrize("level,mode,gating,thr,kind", [
    ("token", "clip", "ratio", ["0.3", "3"], "tis"),
    ("token", "mask", "ratio", ["0.3", "3"], "icepop"),
    ("seq", "mask", "ratio", ["0.3", "3"], "seq-mask-tis"),
    ("seq", "mask", "binary_kl", ["5e-3"], "seq-mask-tis"),
    ("token", "mask", "tv", ["0.1"], "icepop"),
])
def test_is_correction_0_11_2_flags(level, mode, gating, thr, kind):
    """OpenRLHF 0.11.2's --algo.advantage.is_correction_level / _mode / _gating / _threshold [LOW] HIGH land on
    the flat flags: level+mode pick the kind, one threshold value is the upper bound (LOW 0)."""
    from rlhf.config.cli import parse

    argv = ["--advantage_estimator", "reinforce", "--algo.advantage.is_correction_level", level,
            "--algo.advantage.is_correction_mode", mode, "--algo.advantage.is_correction_gating", gating,
            "--algo.advantage.is_correction_threshold", *thr, "--actor.loss_agg_mode", "seq-mean-token-mean"]
    a = parse("ppo", argv).algorithm
    lo, hi = (0.0, float(thr[0])) if len(thr) == 1 else (float(thr[0]), float(thr[1]))
    assert (a.enable_is_correction, a.is_correction_type, a.is_correction_gating) == (True, kind, gating)
    assert (a.is_truncated_threshold_low, a.is_truncated_threshold) == (lo, hi)
    assert a.loss_agg_mode == "seq-mean-token-mean"
    off = parse("ppo", ["--advantage_estimator", "reinforce", "--enable_is_correction",
                        "--algo.advantage.is_correction_level", "off"]).algorithm
    assert not off.enable_is_correction   # level off wins over the 0.11.0 switch


def test_is_correction_0_11_2_yaml(tmp_path):
    """The same names nested in YAML (FlashREINFORCE's setting): a scalar threshold is the upper bound."""
    from rlhf.config.cli import parse

    (tmp_path / "c.yaml").write_text("algo:\n  advantage: {estimator: reinforce, is_correction_level: seq, "
                                     "is_correction_gating: binary_kl, is_correction_threshold: 5.0e-3}\n"
                                     "actor: {loss_agg_mode: seq-mean-token-mean}\n")
    a = parse("ppo", ["--config", str(tmp_path / "c.yaml")]).algorithm
    assert (a.enable_is_correction, a.is_correction_type, a.is_correction_gating) == (True, "seq-mask-tis", "binary_kl")
    assert (a.is_truncated_threshold_low, a.is_truncated_threshold, a.loss_agg_mode) == (0.0, 5e-3,
                                                                                        "seq-mean-token-mean")


@pytest.mark.parametrize("argv,msg", [
    (["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "clip"],
     "needs --is_correction_level token (got seq); use --is_correction_mode mask"),
    (["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip",
      "--algo.advantage.is_correction_gating", "tv", "--algo.advantage.is_correction_threshold", "0.1"],
     "cannot clamp"),
    (["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_gating", "binary_kl"],
     "takes an upper bound only"),
    (["--algo.advantage.is_correction_level", "diag"], "diag"),
])
def test_is_correction_0_11_2_errors(argv, msg):
    import click

    from rlhf.config.cli import parse

    with pytest.raises(click.UsageError) as e:
        parse("ppo", ["--advantage_estimator", "reinforce", *argv])
    assert msg in str(e.value), str(e.value)


def test_kl_in_reward_requires_actor_logprobs():
    from rlhf.trainers.advantage_stage import needs_old_logprobs

    cfg = _stage_cfg("group_norm")
    cfg.algorithm.init_kl_coef, cfg.algorithm.use_kl_loss = 0.1, False
    assert needs_old_logprobs(cfg, on_policy_single_update=True)       # KL in the reward: actor log-probs
    cfg.algorithm.use_kl_loss = True
    assert not needs_old_logprobs(cfg, on_policy_single_update=True)   # KL loss: the trainer's own log-probs
    assert needs_old_logprobs(cfg, on_policy_single_update=False)


# ---- missing features --------------------------------------------------------------------------------------------

def test_stop_properly_penalty():
    r, trunc = T([1.0, 1.0, -2.0]), T([True, False, True])
    close(stop_properly_penalty(r, trunc, 0.5), [0.5, 1.0, -1.0])    # c >= 0: scale truncated rewards
    close(stop_properly_penalty(r, trunc, -0.5), [-0.5, 1.0, -0.5])  # c < 0: set them to c
    close(stop_properly_penalty(r, trunc, None), [1.0, 1.0, -2.0])
    with pytest.raises(ValueError, match="stop_properly_penalty_coef"):
        stop_properly_penalty(r, trunc, 1.5)


def test_cispo_by_hand():
    # ratio 2 clipped to 1.2 (detached); l = -1.2 * A * logp; gradient -1.2 A on logp
    lp = T([[math.log(2.0)]], requires_grad=True)
    loss, met = POLICY_LOSSES["cispo"](lp, torch.zeros(1, 1), T([[1.0]]), torch.ones(1, 1))
    close(loss, -1.2 * math.log(2.0))
    loss.backward()
    close(lp.grad, [[-1.2]])
    assert met["clip_frac"] == 1.0


def test_sapo_by_hand():
    # A = 1 > 0: tau 1, f(2) = sigmoid(1) * 4;  A = -1: tau 1.05, f(0.5) = sigmoid(-0.525) * 4 / 1.05
    lp = T([[math.log(2.0)], [math.log(0.5)]])
    adv, mask = T([[1.0], [-1.0]]), torch.ones(2, 1)
    loss, _ = POLICY_LOSSES["sapo"](lp, torch.zeros(2, 1), adv, mask, agg_mode="token-mean")
    f1 = 4 / (1 + math.exp(-1.0))
    f2 = 4 / 1.05 / (1 + math.exp(0.525))
    close(loss, (-f1 + f2) / 2)
    # at ratio 1 the gate's slope is 1: the gradient equals PPO's (-A per token)
    lp1 = torch.zeros(1, 1, requires_grad=True)
    POLICY_LOSSES["sapo"](lp1, torch.zeros(1, 1), T([[1.0]]), torch.ones(1, 1))[0].backward()
    close(lp1.grad, [[-1.0]])


def test_kl_unbiased_gradient_straight_through():
    lp = T([[0.5]], requires_grad=True)
    ref, old = T([[0.0]]), T([[0.5 - math.log(2.0)]])      # w = exp(lp - old) = 2
    val = compute_kl("k3", lp, ref)
    out = kl_unbiased_gradient(val, lp, ref, old)
    close(out, val.detach())                                # value: the estimator's
    out.sum().backward()
    close(lp.grad, [[2.0 * 0.5]])                           # gradient: w * (lp - ref)
    lp2 = T([[0.5]], requires_grad=True)
    kl_unbiased_gradient(compute_kl("k1", lp2, ref), lp2, ref).sum().backward()
    close(lp2.grad, [[0.5]])                                # k1 too: w = 1 without old log-probs


def test_rm_margin_per_sample():
    chosen, rejected, margin = T([2.0, 2.0]), T([1.0, 1.0]), T([0.0, 1.0])
    close(rm_logsigmoid(chosen, rejected, margin), [-math.log(1 / (1 + math.exp(-1.0))), math.log(2.0)])


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


# ---- issue 18: NaN rewards ---------------------------------------------------------------------------------------

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
    from rlhf.trainers.advantage_stage import StageInputs

    b, r = mask.shape
    return StageInputs(rewards, rewards.clone(), valid, mask, torch.zeros(b, dtype=torch.bool), torch.zeros(b, r),
                       None, None, None)


def test_stage_nan_metrics_counts_and_guard():
    from rlhf.trainers.advantage_stage import InvalidRewardGuard, advantage_stage

    cfg = _stage_cfg("group_norm", max_invalid_reward_batches=2)
    mask = torch.ones(4, 2, dtype=torch.long)
    x = _stage_inputs(T([1.0, NAN, NAN, NAN]), T([True, False, False, False]), mask)
    guard = InvalidRewardGuard(2)
    out = advantage_stage(cfg, x, 0.0, guard=guard)
    assert out.metrics["reward"] == 1.0                   # NaN is not counted as 0 (that would give 0.25)
    assert out.metrics["reward_invalid"] == 3.0 and out.metrics["reward_invalid_groups"] == 1.0
    close(out.advantages, torch.zeros(4, 2))
    assert out.train_mask[1:].sum() == 0                  # invalid rows train on nothing
    allnan = _stage_inputs(T([NAN] * 4), T([False] * 4), mask)
    with pytest.warns(RuntimeWarning, match="all 4 rewards of this batch are invalid"):
        advantage_stage(cfg, allnan, 0.0, guard=guard)
    with pytest.raises(RuntimeError, match="--max_invalid_reward_batches 2"):
        advantage_stage(cfg, allnan, 0.0, guard=guard)
    advantage_stage(cfg, x, 0.0, guard=guard)             # a valid batch resets the streak
    assert guard.streak == 0


# ---- 2 ranks x 2 micro-batches == one full batch ----------------------------------------------------------------

def _two_rank_worker(rank, world, kit):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlhf.algorithms import aggregate, compute_kl
    from rlhf.algorithms.policy_loss import ppo_clip_loss
    from rlhf.backends.base import EngineSpec
    from rlhf.backends.fsdp2 import FSDP2Engine
    from rlhf.models.forward import action_logprobs
    from rlhf.trainers.experience import Experience
    from rlhf.trainers.ppo_update import step_totals, train_actor

    # the count is one collective that every rank runs, also with an empty shard
    tot = step_totals([torch.ones(2, 3)] if rank == 0 else [], None)
    assert (tot.tokens, tot.seqs) == (6.0, 2.0), tot

    torch.manual_seed(0)
    B, P, R = 8, 3, 5
    vocab = AutoModelForCausalLM.from_pretrained(kit).config.vocab_size
    seqs = torch.randint(3, vocab, (B, P + R))
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])      # uneven responses: micro-batches differ in tokens
    amask = (torch.arange(R)[None] < lengths[:, None]).long()
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), amask], 1)
    adv = torch.randn(B, R) * amask
    plain = AutoModelForCausalLM.from_pretrained(kit)
    with torch.no_grad():
        lp0, _ = action_logprobs(plain, seqs, attn, R)
    old = (lp0 + 0.3 * torch.randn(B, R)) * amask        # ratios away from 1: clipping happens
    ref = (lp0 - 0.2 * torch.randn(B, R)) * amask
    exp = Experience(seqs, attn, amask, old.clone(), old, ref, None, adv, adv, torch.zeros(B))

    cfg = TrainConfig()
    cfg.optim.train_batch_size, cfg.optim.micro_train_batch_size, cfg.optim.max_epochs = 8, 2, 1
    cfg.data.generate_max_len = R
    a = cfg.algorithm
    a.use_kl_loss, a.kl_estimator, a.entropy_loss_coef, a.clip_eps_low, a.clip_eps_high = True, "k3", 0.01, 0.2, 0.2
    eng = FSDP2Engine(AutoModelForCausalLM.from_pretrained(kit),
                      EngineSpec(lr=0.0, train_batch_size=8, micro_batch_size=2, total_steps=10, warmup_ratio=0.0))
    assert eng.accum_steps == 2
    captured = {}
    real_step = eng.step

    def step():
        captured["g"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                         for n, p in eng.model.named_parameters()}
        return real_step()

    eng.step = step
    for mode in ("token-mean", "seq-mean-token-mean"):
        a.loss_agg_mode = mode
        logs = train_actor(cfg, eng, exp, rank, world, kl_coef=0.1, step_seed=0)
        every = [None] * world
        dist.all_gather_object(every, logs["policy_loss"])
        step_loss = sum(every) / world                     # what rl_trainer logs (mean over ranks)
        # one full-batch computation on one process
        plain.zero_grad()
        lp, ent = action_logprobs(plain, seqs, attn, R, with_entropy=True, entropy_grad=True)
        m = amask.float()
        pl, _ = ppo_clip_loss(lp, old, adv, m, agg_mode=mode, norm_const=float(R))
        total = (pl - 0.01 * aggregate(ent, m, "token-mean")
                 + 0.1 * aggregate(compute_kl("k3", lp, ref, m), m, mode, float(R)))
        total.backward()
        assert abs(step_loss - float(pl)) < 1e-5, (mode, step_loss, float(pl))
        worst = max(float((captured["g"][n] - p.grad).abs().max()) for n, p in plain.named_parameters())
        scale = max(float(p.grad.abs().max()) for p in plain.parameters())
        assert worst < 1e-5 * max(1.0, scale), (mode, worst, scale)
        if mode == "token-mean":  # the old per-micro-batch mean differs here by far more than the tolerance
            per_mb = []
            for rows in ([0, 1], [2, 3], [4, 5], [6, 7]):
                per_mb.append(ppo_clip_loss(lp[rows], old[rows], adv[rows], m[rows], agg_mode=mode)[0])
            assert abs(float(sum(per_mb) / 4) - float(pl)) > 1e-3


def test_two_ranks_two_micro_batches_equal_one_full_batch(tiny_kit):
    spawn(_two_rank_worker, 2, tiny_kit)


# ---- OpenRLHF's hierarchical flag spelling ----------------------------------------------------------------------

FLAT = ["--pretrain", "P", "--reward_pretrain", "R", "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--micro_rollout_batch_size", "2",
        "--train_batch_size", "16", "--micro_train_batch_size", "2", "--actor_learning_rate", "3e-6",
        "--adam_betas", "0.9", "0.99", "--weight_decay", "0.01", "--max_norm", "0.5", "--lr_warmup_ratio", "0.1",
        "--init_kl_coef", "0.02", "--kl_estimator", "k3", "--use_kl_loss", "--kl_unbiased_gradient",
        "--clip_eps_low", "0.2", "--clip_eps_high", "0.28", "--dual_clip", "3", "--entropy_loss_coef", "0.001",
        "--zero_stage", "2", "--temperature", "0.9", "--top_p", "0.95", "--generate_max_len", "64",
        "--max_len", "128", "--reward_clip_range", "-5", "5", "--overlong_buffer_len", "8",
        "--stop_properly_penalty_coef", "-0.5", "--enable_is_correction", "--is_correction_type", "icepop",
        "--is_truncated_threshold_low", "0.3", "--is_truncated_threshold", "3",
        "--dynamic_filtering", "--dynamic_filtering_reward_range", "0.1", "0.9", "--no_advantage_std_norm",
        "--gamma", "1", "--lambd", "0.9", "--ckpt_path", "C", "--save_path", "S", "--load_checkpoint",
        "--save_steps", "5", "--max_ckpt_num", "2", "--logging_steps", "2", "--eval_steps", "4",
        "--wandb_project", "W", "--seed", "7", "--num_episodes", "2", "--max_epochs", "2",
        "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "1", "--colocate_all_models",
        "--vllm_gpu_memory_utilization", "0.4", "--remote_rm_url", "U", "--prompt_data", "D",
        "--input_key", "q", "--label_key", "a", "--apply_chat_template", "--lora_rank", "8",
        "--target_modules", "q_proj,v_proj", "--packing_samples", "--aux_loss_coef", "0.01"]
DOTTED = ["--actor.model_name_or_path", "P", "--reward.model_name_or_path", "R",
          "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
          "--rollout.batch_size", "8", "--rollout.micro_batch_size", "2", "--train.batch_size", "16",
          "--train.micro_batch_size", "2", "--actor.adam.lr", "3e-6", "--actor.adam.betas", "0.9", "0.99",
          "--actor.adam.weight_decay", "0.01", "--actor.max_norm", "0.5", "--actor.lr_warmup_ratio", "0.1",
          "--algo.kl.init_coef", "0.02", "--algo.kl.estimator", "k3", "--algo.kl.use_loss",
          "--algo.kl.unbiased_gradient", "--actor.eps_clip_low_high", "0.2", "0.28", "--actor.dual_clip", "3",
          "--actor.entropy_coef", "0.001", "--ds.zero_stage", "2", "--rollout.temperature", "0.9",
          "--rollout.top_p", "0.95", "--rollout.max_new_tokens", "64", "--data.max_len", "128",
          "--reward.clip_range", "-5", "5", "--reward.overlong_buffer_len", "8",
          "--reward.stop_properly_penalty_coef", "-0.5", "--algo.advantage.is_correction_enable",
          "--algo.advantage.is_correction_type", "icepop", "--algo.advantage.is_correction_threshold", "0.3", "3",
          "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "0.9",
          "--algo.advantage.no_std_norm", "--algo.advantage.gamma", "1", "--algo.advantage.lambd", "0.9",
          "--ckpt.path", "C", "--ckpt.output_dir", "S", "--ckpt.load_enable", "--ckpt.save_steps", "5",
          "--ckpt.max_num", "2", "--logger.logging_steps", "2", "--eval.steps", "4",
          "--logger.wandb.project", "W", "--train.seed", "7", "--train.num_episodes", "2", "--train.max_epochs=2",
          "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "1", "--train.colocate_all",
          "--vllm.gpu_memory_utilization", "0.4", "--reward.remote_url", "U", "--data.prompt_dataset", "D",
          "--data.input_key", "q", "--data.label_key", "a", "--data.apply_chat_template", "--ds.lora.rank", "8",
          "--ds.lora.target_modules", "q_proj", "v_proj", "--ds.packing_samples", "--actor.aux_loss_coef", "0.01",
          "--actor.adam.eps", "1e-8", "--actor.optim", "adam", "--actor.muon.no_nesterov"]


def _config_fields(cfg):
    return {g: dict(v) for g, v in cfg.to_dict().items()}


def test_both_flag_spellings_give_the_same_config(capsys):
    from rlhf.config.cli import parse

    flat, dotted = parse("ppo", FLAT), parse("ppo", DOTTED)
    assert _config_fields(dotted) == _config_fields(flat)
    assert flat.optim.actor_learning_rate == 3e-6 and dotted.algorithm.is_truncated_threshold_low == 0.3
    assert dotted.model.target_modules == "q_proj,v_proj" and dotted.algorithm.clip_eps_high == 0.28
    err = capsys.readouterr().err
    assert "--actor.adam.eps has no effect here" in err and "--actor.muon.no_nesterov has no effect" in err


def test_both_spellings_in_yaml(tmp_path):
    from rlhf.config.cli import parse

    (tmp_path / "flat.yaml").write_text("pretrain: P\nactor_learning_rate: 3.0e-6\ninit_kl_coef: 0.05\n"
                                        "clip_eps_low: 0.1\nclip_eps_high: 0.1\nzero_stage: 2\nuse_kl_loss: true\n"
                                        "algorithm:\n  advantage_estimator: rloo\n"
                                        "rollout:\n  n_samples_per_prompt: 4\n")
    (tmp_path / "dotted.yaml").write_text("actor.model_name_or_path: P\nactor.adam.lr: 3.0e-6\n"
                                          "algo.kl.init_coef: 0.05\nactor.eps_clip: 0.1\nds.zero_stage: 2\n"
                                          "algo.kl.use_loss: true\nalgorithm:\n  advantage_estimator: rloo\n"
                                          "rollout.n_samples_per_prompt: 4\n")
    (tmp_path / "nested.yaml").write_text("actor:\n  model_name_or_path: P\n  adam: {lr: 3.0e-6}\n"
                                          "  eps_clip: 0.1\nalgo:\n  kl: {init_coef: 0.05, use_loss: true}\n"
                                          "  advantage: {estimator: rloo}\nds: {zero_stage: 2}\n"
                                          "rollout:\n  n_samples_per_prompt: 4\n")
    cfgs = [parse("ppo", ["--config", str(tmp_path / f"{n}.yaml")]) for n in ("flat", "dotted", "nested")]
    assert _config_fields(cfgs[0]) == _config_fields(cfgs[1]) == _config_fields(cfgs[2])
    assert cfgs[2].optim.actor_learning_rate == 3e-6 and cfgs[2].algorithm.clip_eps_high == 0.1


def test_unknown_dotted_names_fail_with_did_you_mean(tmp_path):
    import click

    from rlhf.config.cli import parse

    with pytest.raises(click.UsageError, match=r"unknown flag --algo.kl.init_cof; did you mean --algo.kl.init_coef"):
        parse("ppo", ["--algo.kl.init_cof", "0.1"])
    with pytest.raises(click.UsageError, match=r"--actor.max_norm and --critic.max_norm both set --max_norm"):
        parse("ppo", ["--actor.max_norm", "1", "--critic.max_norm", "2"])
    with pytest.raises(click.UsageError, match=r"--actor.optim muon is not supported: the Muon optimizer"):
        parse("ppo", ["--actor.optim", "muon"])
    (tmp_path / "bad.yaml").write_text("actor:\n  adam: {lrr: 1.0e-6}\n")
    with pytest.raises(click.UsageError, match=r"bad.yaml: unknown flag --actor.adam.lrr; did you mean --actor.adam.lr"):
        parse("ppo", ["--config", str(tmp_path / "bad.yaml")])
    (tmp_path / "bad2.yaml").write_text("algorithm:\n  gammma: 1.0\n")
    with pytest.raises(click.UsageError, match=r"'gammma' is not a flag of group 'algorithm'"):
        parse("ppo", ["--config", str(tmp_path / "bad2.yaml")])


# OpenRLHF flat-era names this project accepts through openrlhf_compat (issue 18) rather than as its own flags
OPENRLHF_FLAT_ERA = {
    "adam_offload", "async_queue_size", "dataset_split", "prompt_split", "attn_implementation", "best_metric_key", "compute_fp32_loss",
    "dataloader_num_workers", "deepcompile", "disable_ds_ckpt", "disable_fast_tokenizer", "ds_tensor_parallel_size",
    "ema_beta", "enable_ema", "enable_prefix_caching", "freeze_visual_encoder", "freezing_actor_steps",
    "full_determinism", "grad_accum_dtype", "gradient_checkpointing_use_reentrant", "image_key", "load_in_4bit",
    "lora_dropout", "max_ckpt_mem", "max_images_per_prompt", "multiturn", "overlap_comm", "param_dtype",
    "partial_rollout", "pretrain_mode", "prompt_key", "ref_reward_offload", "ring_attn_size", "ring_head_stride",
    "rollout_max_tokens_per_gpu", "save_value_network", "tokenizer_chat_template", "train_max_tokens_per_gpu",
    "use_ds_universal_ckpt", "use_dynamic_batch", "use_liger_kernel", "value_head_prefix", "vllm_generate_batch_size",
    "vllm_sync_backend", "vllm_sync_with_ray", "wandb_group", "zpg"}


def test_every_dotted_name_maps_to_a_known_flat_name():
    from rlhf.config.hierarchical import HIERARCHICAL, Fanout, Notice, Split, Switch
    from rlhf.config.schema import flag_index

    ours = set(flag_index())
    for dotted, e in HIERARCHICAL.items():
        targets = ([e] if isinstance(e, str) else [e.first, e.second] if isinstance(e, Split)
                   else list(e.targets) if isinstance(e, Fanout) else [e.target] if isinstance(e, Switch) else [])
        for t in targets:
            assert t in ours or t in OPENRLHF_FLAT_ERA, f"--{dotted} maps to --{t}, which is neither ours nor OpenRLHF's"
        assert "." in dotted and (isinstance(e, (str, Split, Fanout, Switch)) or isinstance(e, Notice) or e.target == "")


def test_rm_margin_column_read_per_pair(tiny_kit, tmp_path):
    from rlhf.data.loading import DataError, load_rows
    from rlhf.models.load import load_tokenizer
    from rlhf.trainers.tasks import RMTask

    cfg = TrainConfig()
    cfg.algorithm.margin_loss = True
    task = RMTask(cfg, load_tokenizer(tiny_kit, padding_side="right"))
    assert task.required_keys["margin_key"] is None and "margin_key" not in RMTask.required_keys
    rows = [{"input": "1+1=", "chosen": "2", "rejected": "3", "margin": 0.5},
            {"input": "2+2=", "chosen": "4", "rejected": "5", "margin": 2.0}]
    samples = [task.make_sample(r) for r in rows]
    close(task.margins(samples), [0.5, 2.0])
    # the data must carry the column: the loader names the flag that picks it
    f = tmp_path / "pairs.jsonl"
    f.write_text('{"input": "1+1=", "chosen": "2", "rejected": "3"}\n')
    keys = {k: getattr(cfg.data, k) for k in task.required_keys}
    with pytest.raises(DataError, match="set --margin_key"):
        load_rows(str(f), keys)
    cfg.algorithm.margin_loss = False
    assert RMTask(cfg, task.tokenizer).margins(samples) == 0.0   # the constant --margin otherwise


def test_moe_aux_loss_is_read_and_added():
    from transformers import MixtralConfig, MixtralForCausalLM

    from rlhf.trainers.ppo_update import _AuxLossTap

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                             num_experts_per_tok=2))
    tap = _AuxLossTap(model, True)
    ids = torch.randint(0, 32, (2, 5))
    out = model(input_ids=ids)
    got = tap.take()
    assert got is not None and torch.isfinite(got) and float(got) > 0 and torch.equal(got, out.aux_loss)
    tap.close()
    from transformers import LlamaConfig, LlamaForCausalLM
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.warns(UserWarning, match="--aux_loss_coef is set but the model has no MoE router"):
        _AuxLossTap(dense, True)


@pytest.mark.parametrize("argv,msg", [
    (["--enable_is_correction", "--is_truncated_threshold_low", "2", "--is_truncated_threshold", "1"],
     "is_truncated_threshold_low < --is_truncated_threshold"),
    (["--stop_properly_penalty_coef", "2"], "--stop_properly_penalty_coef 2.0: use a factor in"),
    (["--scale_rewards", "batch", "--advantage_estimator", "rloo", "--n_samples_per_prompt", "2"],
     "--scale_rewards batch changes group_norm's std only"),
    (["--kl_unbiased_gradient"], "--kl_unbiased_gradient changes the gradient of the KL loss"),
    (["--policy_loss_type", "sapo", "--sapo_tau_neg", "0"], "--sapo_tau_pos and --sapo_tau_neg must be > 0"),
    (["--max_invalid_reward_batches", "-1"], "--max_invalid_reward_batches must be >= 0"),
])
def test_parity_flags_checked_at_parse_time(argv, msg):
    import click

    from rlhf.config.cli import parse

    with pytest.raises(click.UsageError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse("ppo", argv)


# ---- issue 41 items 2 and 11: GAE lambda default, flash_reinforce -------------------------------------------------

def test_ppo_defaults_match_openrlhf():
    """OpenRLHF 0.11.2 openrlhf/cli/train_ppo_ray.py (and 0.10.1's flat --lambd / --gamma): --algo.advantage.lambd 1,
    --algo.advantage.gamma 1, eps_clip 0.2, value_clip 0.5, kl init_coef 0.01, kl horizon 10000, kl estimator k1,
    reward clip (-10, 10), actor / critic lr 1e-6 / 9e-6, betas (0.9, 0.95), warmup 0.03, max_norm 1."""
    from rlhf.config import parse

    cfg = parse("ppo", [])
    a, o = cfg.algorithm, cfg.optim
    got = (a.lambd, a.gamma, a.clip_eps_low, a.clip_eps_high, a.value_clip, a.init_kl_coef, a.kl_horizon,
           a.kl_estimator, a.reward_clip_range, o.actor_learning_rate, o.critic_learning_rate, o.adam_betas,
           o.lr_warmup_ratio, o.max_norm, o.lr_scheduler)
    want = (1.0, 1.0, 0.2, 0.2, 0.5, 0.01, 10000, "k1", (-10.0, 10.0), 1e-6, 9e-6, (0.9, 0.95), 0.03, 1.0,
            "cosine_with_min_lr")
    assert got == want, f"PPO defaults differ from OpenRLHF's: got {got}, want {want}"


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
    from rlhf.trainers.advantage_stage import advantage_stage

    cfg = parse("ppo", ["--advantage_estimator", "flash_reinforce", "--n_samples_per_prompt", "1",
                        "--rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "1",
                        "--gamma", "0.5"])
    assert cfg.algorithm.advantage_estimator == "flash_reinforce" and cfg.model.critic_pretrain is None
    x = _stage_inputs(T([1.0, 0.0, 0.0, 3.0]), valid=torch.ones(4, dtype=torch.bool), mask=torch.ones(4, 2))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = advantage_stage(cfg, x, 0.0)
    close(out.advantages, [[0.0, 0.0], [-1.0, -1.0], [-1.0, -1.0], [2.0, 2.0]])
    assert any("gamma" in str(m.message) for m in w), "--gamma 0.5 with flash_reinforce should warn"
    # dynamic filtering (groups of 2): group 0 {1, 0} kept, group 1 {0, 3} mean 1.5 outside (0, 1) dropped:
    # the batch mean is over the kept rows only (0.5), as OpenRLHF computes advantages over accepted samples
    cfg = _stage_cfg("flash_reinforce", dynamic_filtering=True, dynamic_filtering_reward_range=(0.0, 1.0))
    out = advantage_stage(cfg, x, 0.0)
    close(out.advantages, [[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]])


def test_flash_reinforce_dotted_flag():
    """--algo.advantage.estimator flash_reinforce (OpenRLHF 0.11.2 train_flash_reinforce_ray_agent_async.sh)."""
    from rlhf.config import parse

    cfg = parse("ppo", ["--algo.advantage.estimator", "flash_reinforce", "--rollout.n_samples_per_prompt", "1",
                        "--rollout.batch_size", "8", "--train.batch_size", "8"])
    assert cfg.algorithm.advantage_estimator == "flash_reinforce"
