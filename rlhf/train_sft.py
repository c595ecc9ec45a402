"""Supervised fine-tuning (loss on response tokens).  torchrun -m rlhf.train_sft [flags | --config configs/x.yaml]"""
from rlhf.config import main_entry

# learning rate: OpenRLHF's (openrlhf/cli/train_sft.py: --learning_rate default 5e-6), so a command that leaves it out
# trains as it does there; the tiny demo sets its own in configs/*_tiny.yaml
DEFAULTS = {"learning_rate": 5e-6, "train_batch_size": 32, "micro_train_batch_size": 8}


def run(cfg):
    from rlhf.trainers.supervised import run_supervised
    from rlhf.trainers.tasks import SFTTask

    return run_supervised(cfg, SFTTask, "sft")


if __name__ == "__main__":
    main_entry("sft", run, DEFAULTS, help="Supervised fine-tuning (loss on response tokens).")
