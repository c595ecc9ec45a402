"""GRPO: torchrun -m rlhf.train_grpo [flags | --config configs/x.yaml]

Same trainer as rlhf.train_ppo with GRPO defaults: group_norm advantages, KL as a
k3 loss term, no critic, 4 samples per prompt.
"""
from rlhf.config import main_entry

GRPO_DEFAULTS = {"advantage_estimator": "group_norm", "use_kl_loss": True, "kl_estimator": "k3",
                 "init_kl_coef": 0.001, "n_samples_per_prompt": 4, "train_batch_size": 32}


def run(cfg):
    from rlhf.rl.trainer import run_rl

    return run_rl(cfg, "grpo")


if __name__ == "__main__":
    main_entry("grpo", run, GRPO_DEFAULTS, help="GRPO trainer (group-normalised advantages, k3 KL loss).")
