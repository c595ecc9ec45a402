"""Supervised fine-tuning (loss on response tokens).  torchrun -m rlhf.train_sft [flags | --config configs/x.yaml]"""
from rlhf.config import main_entry

# learning rate: OpenRLHF's (openrlhf/cli/train_sft.py: --learning_rate default 5e-6), so a command that leaves it out
# trains as it does there; the tiny demo sets its own in configs/*_tiny.yaml
# --input_template: OpenRLHF's SFT default (openrlhf/cli/train_sft.py, 0.10.1 --input_template and 0.11
# --data.input_template: "User: {}\nAssistant: "), applied when no chat template is (openrlhf/datasets/sft_dataset.py
# preprocess_data); --input_template "" trains on the bare input
# --max_epochs: OpenRLHF's SFT default is 2 (openrlhf/cli/train_sft.py --max_epochs / --train.max_epochs), so an SFT
# command that leaves it out trains two epochs here too (RM, DPO and RL keep 1, as OpenRLHF's do)
DEFAULTS = {"learning_rate": 5e-6, "train_batch_size": 32, "micro_train_batch_size": 8,
            "input_template": "User: {}\nAssistant: ", "max_epochs": 2}


def run(cfg):
    from rlhf.supervised.tasks import SFTTask
    from rlhf.supervised.trainer import run_supervised

    if cfg.teacher.teacher_pretrain:  # offline KD from a frozen teacher (rlhf.supervised.kd)
        from rlhf.supervised.kd import kd_task

        return run_supervised(cfg, kd_task(cfg.teacher), "sft")
    return run_supervised(cfg, SFTTask, "sft")


if __name__ == "__main__":
    main_entry("sft", run, DEFAULTS, help="Supervised fine-tuning (loss on response tokens).")
