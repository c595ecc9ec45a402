"""Pairwise reward-model training.  torchrun -m rlhf.train_rm [flags | --config configs/x.yaml]"""
from rlhf.config import main_entry

# learning rate: OpenRLHF's (openrlhf/cli/train_rm.py: --learning_rate default 9e-6), so a command that leaves it out
# trains as it does there; the tiny demo sets its own in configs/*_tiny.yaml
DEFAULTS = {"learning_rate": 9e-6, "train_batch_size": 32, "micro_train_batch_size": 8}


def run(cfg):
    from rlhf.supervised.tasks import RMTask
    from rlhf.supervised.trainer import run_supervised

    return run_supervised(cfg, RMTask, "pref")


if __name__ == "__main__":
    main_entry("rm", run, DEFAULTS, help="Pairwise reward-model training.")
