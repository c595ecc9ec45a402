"""Supervised fine-tuning (loss on response tokens).  torchrun -m rlhf.train_sft [flags | --config configs/x.yaml]"""
from rlhf.config import main_entry

DEFAULTS = {"learning_rate": 1e-3, "train_batch_size": 32, "micro_train_batch_size": 8}


def run(cfg):
    from rlhf.trainers.supervised import run_supervised
    from rlhf.trainers.tasks import SFTTask

    return run_supervised(cfg, SFTTask, "sft")


if __name__ == "__main__":
    main_entry("sft", run, DEFAULTS, help="Supervised fine-tuning (loss on response tokens).")
