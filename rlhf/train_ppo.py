"""PPO (and every other estimator): torchrun -m rlhf.train_ppo [flags | --config configs/x.yaml]"""
from rlhf.config import main_entry

PPO_DEFAULTS = {"advantage_estimator": "gae"}


def run(cfg):
    from rlhf.rl.trainer import run_rl

    return run_rl(cfg, "ppo")


if __name__ == "__main__":
    main_entry("ppo", run, PPO_DEFAULTS, help="PPO / REINFORCE++ / RLOO / GRPO trainer (set --advantage_estimator).")
