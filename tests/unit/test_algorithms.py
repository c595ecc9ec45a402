"""Every formula against a hand computation on small tensors."""
import math

import pytest
import torch

from rlhf.algorithms import (
    ADVANTAGE_ESTIMATORS,
    RunningMeanStd,
    aggregate,
    clip_rewards,
    compute_advantages,
    compute_kl,
    dpo_loss,
    dynamic_filter_mask,
    entropy_from_logits,
    fold_kl_into_rewards,
    gae_advantages,
    importance_weights,
    logprobs_from_logits,
    masked_whiten,
    overlong_penalty,
    return_to_go,
    sft_token_loss,
    value_loss,
)
from rlhf.algorithms.kl import AdaptiveKLController, FixedKLController, make_kl_controller
from rlhf.algorithms.policy_loss import gspo_loss, ppo_clip_loss
from rlhf.algorithms.preference import rm_logexp, rm_logsigmoid

T = torch.tensor


def close(a, b, tol=1e-4):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol), (a, b)


def test_kl_estimators_by_hand():
    logp, ref = T([[0.0, -1.0]]), T([[-1.0, -1.0]])
    close(compute_kl("k1", logp, ref), [[1.0, 0.0]])
    close(compute_kl("k2", logp, ref), [[0.5, 0.0]])
    close(compute_kl("k3", logp, ref), [[math.exp(-1), 0.0]])
    close(compute_kl("k3", logp, ref, T([[0.0, 1.0]])), [[0.0, 0.0]])  # mask respected


def test_fold_kl_into_rewards_by_hand():
    r = fold_kl_into_rewards(T([2.0]), T([[0.1, 0.2, 0.3]]), 0.5, T([[1, 1, 0]]))
    close(r, [[-0.05, 1.9, 0.0]])
    close(fold_kl_into_rewards(T([2.0]), None, 0.5, T([[1, 1, 0]])), [[0.0, 2.0, 0.0]])


def test_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
    ad = AdaptiveKLController(0.1, target=1.0, horizon=10)
    ad.update(2.0, 5)  # err clipped to 0.2 -> x (1 + 0.2 * 5 / 10)
    assert abs(ad.value - 0.11) < 1e-9
    assert isinstance(make_kl_controller(0.1, None, 10), FixedKLController)


def test_return_to_go_and_gae_by_hand():
    close(return_to_go(T([[1.0, 2.0, 3.0]]), T([[1, 1, 1]]), 0.5), [[2.75, 3.5, 3.0]])
    adv, ret = gae_advantages(T([[0.0, 1.0]]), T([[0.5, 0.2]]), T([[1, 1]]), gamma=1.0, lambd=0.5)
    close(adv, [[0.1, 0.8]])
    close(ret, [[0.6, 1.0]])


def test_gae_lambda1_equals_reward_to_go_minus_value():
    torch.manual_seed(0)
    r, v = torch.randn(3, 5), torch.randn(3, 5)
    mask = T([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).float()
    adv, _ = gae_advantages(r, v, mask, gamma=1.0, lambd=1.0)
    close(adv, (return_to_go(r, mask, 1.0) - v) * mask)


def test_gae_padding_invariance():
    r, v = T([[0.0, 1.0]]), T([[0.5, 0.2]])
    a1, _ = gae_advantages(r, v, T([[1, 1]]), 0.9, 0.8)
    a2, _ = gae_advantages(torch.cat([r, T([[7.0, 7.0]])], 1), torch.cat([v, T([[3.0, 3.0]])], 1),
                           T([[1, 1, 0, 0]]), 0.9, 0.8)
    close(a2[:, :2], a1)
    close(a2[:, 2:], [[0.0, 0.0]])


MASK4 = torch.ones(4, 3)


def test_group_norm_by_hand():
    adv, _ = compute_advantages("group_norm", T([1.0, 0.0, 0.0, 1.0]), MASK4, group_size=2)
    s = 1 / math.sqrt(0.5) * 0.5
    close(adv[:, 0], [s, -s, -s, s])
    close(adv[:, 2], adv[:, 0])  # same advantage on every token when KL is a loss
    adv, _ = compute_advantages("group_norm", T([1.0, 0.0, 0.0, 1.0]), MASK4, group_size=2, std_norm=False)
    close(adv[:, 0], [0.5, -0.5, -0.5, 0.5])


def test_rloo_dr_grpo_by_hand():
    m = torch.ones(3, 2)
    adv, _ = compute_advantages("rloo", T([1.0, 2.0, 3.0]), m, group_size=3)
    close(adv[:, 0], [-1.5, 0.0, 1.5])
    adv, _ = compute_advantages("dr_grpo", T([1.0, 2.0, 3.0]), m, group_size=3)
    close(adv[:, 0], [-1.0, 0.0, 1.0])


def test_reinforce_and_baseline_whitened():
    m = torch.ones(4, 2)
    adv, ret = compute_advantages("reinforce", T([1.0, 2.0, 3.0, 4.0]), m)
    close(ret[:, 0], [1.0, 2.0, 3.0, 4.0])
    close(adv.mean(), 0.0)
    close(adv.std(unbiased=False), 1.0, 1e-3)  # OpenRLHF whitening: biased variance
    adv, ret = compute_advantages("reinforce_baseline", T([1.0, 3.0, 5.0, 5.0]), m, group_size=2)
    close(ret[:, 0], [-1.0, 1.0, 0.0, 0.0])
    close(adv, masked_whiten(ret, m))


def test_group_estimators_invariant_to_group_order_and_masks_respected():
    torch.manual_seed(1)
    scores = torch.randn(6)
    mask = T([[1, 1, 0]] * 6).float()
    perm = torch.tensor([4, 5, 0, 1, 2, 3])  # swap whole groups of 2
    for name in ("group_norm", "rloo", "dr_grpo"):
        a, _ = compute_advantages(name, scores, mask, group_size=2)
        b, _ = compute_advantages(name, scores[perm], mask, group_size=2)
        close(b, a[perm])
        assert (a[:, 2] == 0).all()


def test_group_estimator_needs_group():
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages("group_norm", T([1.0, 2.0]), torch.ones(2, 2), group_size=1)
    assert ADVANTAGE_ESTIMATORS["gae"].needs_critic and not ADVANTAGE_ESTIMATORS["rloo"].needs_critic


def test_gae_estimator_folds_kl():
    adv, ret = compute_advantages("gae", T([1.0]), T([[1, 1]]), values=T([[0.0, 0.0]]), kl=T([[1.0, 1.0]]),
                                  kl_coef=0.1, gamma=1.0, lambd=1.0, whiten=False)
    close(ret, [[0.8, 0.9]])


def test_reward_shaping():
    close(clip_rewards(T([-5.0, 0.5, 5.0]), (-1.0, 1.0)), [-1.0, 0.5, 1.0])
    close(overlong_penalty(T([6, 8, 10]), 10, 4, 1.0), [0.0, -0.5, -1.0])
    close(overlong_penalty(T([6, 8, 10]), 10, 0, 1.0), [0.0, 0.0, 0.0])
    keep = dynamic_filter_mask(T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2, (0.0, 1.0))
    assert keep.tolist() == [False, False, True, True, False, False]


def test_running_mean_std_matches_batch():
    x = torch.randn(100) * 3 + 2
    rms = RunningMeanStd()
    rms.update(x[:30])
    rms.update(x[30:])
    assert abs(rms.mean - x.mean().item()) < 1e-5
    assert abs(rms.var - x.var(unbiased=False).item()) < 1e-4
    close(rms.normalize(T([rms.mean])), [0.0])


def test_ppo_clip_and_dual_clip_by_hand():
    m = T([[1.0]])
    lp = T([[math.log(1.5)]])
    loss, met = ppo_clip_loss(lp, T([[0.0]]), T([[1.0]]), m)
    close(loss, -1.2)
    assert met["clip_frac"] == 1.0
    loss, _ = ppo_clip_loss(lp, T([[0.0]]), T([[-1.0]]), m)
    close(loss, 1.5)
    loss, _ = ppo_clip_loss(T([[math.log(4.0)]]), T([[0.0]]), T([[-1.0]]), m, dual_clip=3.0)
    close(loss, 3.0)
    loss, _ = ppo_clip_loss(T([[math.log(1.1)]]), T([[0.0]]), T([[1.0]]), m, clip_eps_high=0.28)
    close(loss, -1.1)  # asymmetric clip-higher leaves 1.1 unclipped


def test_loss_aggregation_modes_by_hand():
    loss = T([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    close(aggregate(loss, mask, "token-mean"), 2.0)
    close(aggregate(loss, mask, "seq-mean-token-sum"), 3.0)
    close(aggregate(loss, mask, "seq-mean-token-mean"), 2.25)
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", 4.0), 0.75)


def test_gspo_uses_sequence_ratio():
    lp = T([[math.log(1.2), math.log(1.2)]], requires_grad=True)
    loss, met = gspo_loss(lp, torch.zeros(1, 2), T([[1.0, 1.0]]), torch.ones(1, 2), clip_eps_low=0.5,
                          clip_eps_high=0.5)
    close(loss, -1.2)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad != 0).all()


def test_importance_weights_truncated():
    w = importance_weights(T([[math.log(3.0), 0.0, math.log(0.1)]]), torch.zeros(1, 3), torch.ones(1, 3), "tis",
                           0.5, 2.0)
    close(w, [[2.0, 1.0, 0.5]])  # clamped to [low, high]
    w = importance_weights(T([[math.log(9.0)]]), T([[0.0]]), T([[1.0]]), "seq-mask-tis", 0.25, 4.0)
    assert w.sum() == 0  # geometric mean 9 lies outside [1/4, 4]: the sequence is dropped


def test_value_loss_clipped_by_hand():
    loss, met = value_loss(T([[1.0]]), T([[0.0]]), T([[2.0]]), T([[1.0]]), clip=0.5)
    close(loss, 1.125)
    loss, _ = value_loss(T([[1.0]]), T([[0.0]]), T([[2.0]]), T([[1.0]]), clip=None)
    close(loss, 0.5)


def test_dpo_family_by_hand():
    pc, pr, rc, rr = T([-1.0]), T([-2.0]), T([-1.5]), T([-1.5])
    sig = lambda x: -math.log(1 / (1 + math.exp(-x)))  # noqa: E731
    loss, cr, rj = dpo_loss("sigmoid", pc, pr, rc, rr, beta=0.1)
    close(loss, [sig(0.1)])
    close(cr, [0.05])
    close(rj, [-0.05])
    loss, _, _ = dpo_loss("sigmoid", pc, pr, rc, rr, beta=0.1, label_smoothing=0.1)
    close(loss, [0.9 * sig(0.1) + 0.1 * sig(-0.1)])
    close(dpo_loss("ipo", pc, pr, rc, rr, beta=0.1)[0], [16.0])
    close(dpo_loss("hinge", pc, pr, rc, rr, beta=0.1)[0], [0.9])


def test_rm_and_sft_losses_by_hand():
    close(rm_logsigmoid(T([2.0]), T([1.0])), [0.31326])
    close(rm_logsigmoid(T([2.0]), T([1.0]), margin=1.0), [math.log(2)])
    close(rm_logexp(T([2.0]), T([1.0])), [0.31326])
    close(sft_token_loss(T([[-1.0, -2.0], [-3.0, -4.0]]), T([[0, 1], [1, 0]])), 2.5)


def test_logprobs_chunked_and_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    close(logprobs_from_logits(logits, labels, chunk_size=3), ref, 1e-5)
    close(logprobs_from_logits(logits, labels, chunk_size=3, temperature=2.0),
          torch.log_softmax(logits / 2, -1).gather(-1, labels[..., None]).squeeze(-1), 1e-5)
    close(entropy_from_logits(torch.zeros(1, 4)), [math.log(4)])


def test_gradients_finite():
    torch.manual_seed(0)
    lp = torch.randn(4, 3, requires_grad=True)
    adv, _ = compute_advantages("group_norm", torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.ones(4, 3), group_size=2)
    loss, _ = ppo_clip_loss(lp, lp.detach() + 0.1, adv, torch.ones(4, 3), dual_clip=3.0)
    loss = loss + compute_kl("k3", lp, torch.zeros(4, 3)).mean()
    loss.backward()
    assert torch.isfinite(lp.grad).all()
