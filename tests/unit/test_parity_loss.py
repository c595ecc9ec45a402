"""OpenRLHF parity, the losses: every convention pinned with numbers computed by hand (see README "Algorithms and
parity"). One section per formula, each naming OpenRLHF's file."""
import math

import pytest
import torch
from helpers.parity import T, close
from helpers.tasks import make_task

from rlhf.algorithms import (
    IS_CORRECTIONS,
    IS_GATES,
    POLICY_LOSSES,
    LossTotals,
    aggregate,
    compute_kl,
    fold_kl_into_rewards,
    importance_weights,
    kl_unbiased_gradient,
)
from rlhf.algorithms.preference import rm_logsigmoid
from rlhf.config import TrainConfig

# ---- loss aggregation: token-mean L = sum(l * m) / sum(m) over the optimizer step's tokens; seq-mean-token-mean L =
# mean_rows(sum_t l m / sum_t m); entropy token-mean
# OpenRLHF: openrlhf/models/utils.py masked_mean, openrlhf/models/loss.py PolicyLoss (loss_agg_mode)

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


def test_entropy_is_token_mean_and_negative_coef_applied():
    # The entropy term is aggregated token-mean (peers), and any nonzero coefficient is applied (OpenRLHF)
    ent, mask = T([[1.0, 3.0], [5.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    close(aggregate(ent, mask, "token-mean"), 3.0)       # (1 + 3 + 5) / 3, not the seq mean (2 + 5) / 2
    from rlhf.config.schema import AlgorithmConfig
    assert "negative" in AlgorithmConfig.__dataclass_fields__["entropy_loss_coef"].metadata["help"]


# ---- GSPO: sequence ratio s = exp(mean_t(log r_t)), aggregated per sequence ------------------------------------------
# OpenRLHF: openrlhf/models/loss.py PolicyLoss (policy_loss_type gspo)

def test_gspo_forces_sequence_mean():
    # two rows, 2 and 1 tokens; ratio 1 (logp = old) so l = -A on every token of the row
    lp, mask = torch.zeros(2, 2), T([[1.0, 1.0], [1.0, 0.0]])
    adv = T([[1.0, 1.0], [-2.0, -2.0]])
    for agg in ("token-mean", "seq-mean-token-sum"):
        loss, _ = POLICY_LOSSES["gspo"](lp, lp, adv, mask, agg_mode=agg)
        close(loss, (-1.0 + 2.0) / 2)  # seq-mean-token-mean = 0.5; token-mean would be (-1 -1 +2)/3
    assert POLICY_LOSSES["gspo"].forced_agg == "seq-mean-token-mean"


# ---- CISPO l = -sg(clip(r, 0, 1 + eps_high)) A log p; SAPO l = -f_tau(r) A, f_tau(r) = sigmoid(tau (r - 1)) 4 / tau --
# OpenRLHF: openrlhf/models/loss.py PolicyLoss (cispo, sapo)

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


# ---- importance-sampling corrections: w = q / p truncated (tis), masked (icepop), sequence-masked (seq-mask-tis);
# gates binary_kl / tv
# OpenRLHF: openrlhf/models/loss.py PolicyLoss (vllm_is_truncated / is_correction_*), openrlhf/cli/train_ppo_ray.py

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


# ---- KL estimators k1 = log(p / p_ref), k2 = log(p / p_ref)^2 / 2, k3 = p_ref / p - 1 - log(p_ref / p), clamped to
# [-10, 10]; the unbiased gradient weighs by w = p / p_old
# OpenRLHF: openrlhf/models/utils.py compute_approx_kl, openrlhf/trainer/ppo_utils/experience_maker.py compute_reward

def test_kl_estimator_clamp_and_negative_coef():
    close(compute_kl("k1", T([[30.0]]), T([[0.0]])), [[10.0]])
    close(compute_kl("k1", T([[-30.0]]), T([[0.0]])), [[-10.0]])
    close(compute_kl("k2", T([[5.0]]), T([[0.0]])), [[10.0]])        # 12.5 -> 10
    close(compute_kl("k3", T([[-5.0]]), T([[0.0]])), [[10.0]])       # e^5 - 5 - 1 = 142.4 -> 10
    close(fold_kl_into_rewards(T([1.0]), T([[1.0, 1.0]]), -0.5, T([[1, 1]])), [[0.0, 1.0]])  # beta < 0 -> 0


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


# ---- reward-model loss L = -log sigmoid(r_c - r_r - margin), margin per pair -----------------------------------------
# OpenRLHF: openrlhf/models/loss.py PairWiseLoss, openrlhf/datasets/reward_dataset.py (margin)

def test_rm_margin_per_sample():
    chosen, rejected, margin = T([2.0, 2.0]), T([1.0, 1.0]), T([0.0, 1.0])
    close(rm_logsigmoid(chosen, rejected, margin), [-math.log(1 / (1 + math.exp(-1.0))), math.log(2.0)])


def test_rm_margin_column_read_per_pair(tiny_kit, tmp_path):
    from rlhf.data.loading import DataError, load_rows
    from rlhf.models.load import load_tokenizer
    from rlhf.supervised.tasks import RMTask

    cfg = TrainConfig()
    cfg.algorithm.margin_loss = True
    task = make_task(RMTask, cfg, load_tokenizer(tiny_kit, padding_side="right"))
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
    assert make_task(RMTask, cfg, task.tokenizer).margins(samples) == 0.0   # the constant --margin otherwise


# ---- MoE auxiliary loss L = L_policy + aux_loss_coef * aux_loss ------------------------------------------------------
# OpenRLHF: openrlhf/trainer/ray/ppo_actor.py (aux_loss_coef)

def test_moe_aux_loss_is_read_and_added():
    from transformers import MixtralConfig, MixtralForCausalLM

    from rlhf.roles.update_batches import AuxLossTap

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                             num_experts_per_tok=2))
    tap = AuxLossTap(model, True)
    ids = torch.randint(0, 32, (2, 5))
    out = model(input_ids=ids)
    got = tap.take()
    assert got is not None and torch.isfinite(got) and float(got) > 0 and torch.equal(got, out.aux_loss)
    tap.close()
    from transformers import LlamaConfig, LlamaForCausalLM
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.warns(UserWarning, match="--aux_loss_coef is set but the model has no MoE router"):
        AuxLossTap(dense, True)
