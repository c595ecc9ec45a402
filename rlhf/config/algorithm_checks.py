"""Parse-time checks of the parity flags (IS band, penalties, SAPO, scale_rewards, KL options), before any
process group.  Called from validate._validate_rl; each failure names the flag and a value that works."""
from __future__ import annotations

from rlhf.errors import ConfigError


def validate_algorithm(cfg) -> None:
    a = cfg.algorithm
    lo, hi = a.is_truncated_threshold_low, a.is_truncated_threshold
    if a.enable_is_correction and not (0 <= lo < hi):
        raise ConfigError("is_truncated_threshold", f"the importance-weight band needs 0 <= "
                          f"--is_truncated_threshold_low < --is_truncated_threshold, got {lo} and {hi} "
                          f"(OpenRLHF's default: 0.5 and 5.0)")
    c = a.stop_properly_penalty_coef
    if c is not None and c > 1:
        raise ConfigError("stop_properly_penalty_coef", f"--stop_properly_penalty_coef {c}: use a factor in [0, 1] "
                          f"(scales truncated rewards) or a negative value (sets them), e.g. 0.5 or -0.5")
    if a.policy_loss_type == "sapo" and (a.sapo_tau_pos <= 0 or a.sapo_tau_neg <= 0):
        raise ConfigError("sapo_tau_pos", f"--sapo_tau_pos and --sapo_tau_neg must be > 0, got {a.sapo_tau_pos} "
                          f"and {a.sapo_tau_neg} (veRL's defaults: 1.0 and 1.05)")
    if a.scale_rewards != "group" and a.advantage_estimator != "group_norm":
        raise ConfigError("scale_rewards", f"--scale_rewards {a.scale_rewards} changes group_norm's std only; with "
                          f"--advantage_estimator {a.advantage_estimator} drop it (or use group_norm)")
    if a.kl_unbiased_gradient and not a.use_kl_loss:
        raise ConfigError("kl_unbiased_gradient", "--kl_unbiased_gradient changes the gradient of the KL loss: it "
                          "needs --use_kl_loss (with KL in the reward there is no KL gradient)")
    if a.aux_loss_coef < 0:
        raise ConfigError("aux_loss_coef", f"--aux_loss_coef must be >= 0, got {a.aux_loss_coef}")
    if a.max_invalid_reward_batches < 0:
        raise ConfigError("max_invalid_reward_batches", "--max_invalid_reward_batches must be >= 0 (0 = never stop)")
