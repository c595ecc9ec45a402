"""Direct preference optimisation (sigmoid / ipo / hinge).  torchrun -m rlhf.train_dpo [flags | --config configs/x.yaml]"""
from rlhf.config import main_entry

DEFAULTS = {"learning_rate": 1e-4, "train_batch_size": 32, "micro_train_batch_size": 8}


def run(cfg):
    from rlhf.trainers.supervised import run_supervised
    from rlhf.trainers.tasks import DPOTask

    return run_supervised(cfg, DPOTask, "pref")


if __name__ == "__main__":
    main_entry("dpo", run, DEFAULTS, help="Direct preference optimisation (sigmoid / ipo / hinge).")
