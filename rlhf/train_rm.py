"""Pairwise reward-model training.  torchrun -m rlhf.train_rm [flags | --config configs/x.yaml]"""
from rlhf.config import main_entry

DEFAULTS = {"learning_rate": 1e-3, "train_batch_size": 32, "micro_train_batch_size": 8}


def run(cfg):
    from rlhf.trainers.supervised import run_supervised
    from rlhf.trainers.tasks import RMTask

    return run_supervised(cfg, RMTask, "pref")


if __name__ == "__main__":
    main_entry("rm", run, DEFAULTS, help="Pairwise reward-model training.")
