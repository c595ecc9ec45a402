"""Direct preference optimisation (sigmoid / ipo / hinge).  torchrun -m rlhf.train_dpo [flags | --config configs/x.yaml]"""
from rlhf.config import main_entry

# learning rate: OpenRLHF's (openrlhf/cli/train_dpo.py: --learning_rate default 1e-5), so a command that leaves it out
# trains as it does there; the tiny demo sets its own in configs/*_tiny.yaml
DEFAULTS = {"learning_rate": 1e-5, "train_batch_size": 32, "micro_train_batch_size": 8}


def run(cfg):
    from rlhf.supervised.tasks import DPOTask
    from rlhf.supervised.trainer import run_supervised

    return run_supervised(cfg, DPOTask, "pref")


if __name__ == "__main__":
    main_entry("dpo", run, DEFAULTS, help="Direct preference optimisation (sigmoid / ipo / hinge).")
