"""DPO step throughput: rlhf.train_dpo vs TRL's DPOTrainer, same tiny model, pairs, batch, lengths.

    pip install -e ".[bench]" && python bench/dpo_vs_trl.py [--steps 40 --batch 32 --rounds 3]

Single process on the CPU, sigmoid loss, beta 0.1, frozen reference model
computed on the fly on both sides.  Writes bench/results/dpo_vs_trl.json.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import click

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import kit, run_rounds, save, summarize, table  # noqa: E402

WARMUP = 5  # steps left out of the timing on both sides (a CPU here needs ~1 s of load to reach full speed)
TOKENS_PER_PAIR = 2 * 7.0  # chosen + rejected, each prompt (4) + answer (1-2) + eos; same data both sides


def side_trl(path, steps, batch, lr):
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    ds = load_dataset("json", data_files=os.path.join(path, "data", "pref_train.jsonl"), split="train")
    ds = ds.rename_column("input", "prompt").remove_columns(["label"])
    tok = AutoTokenizer.from_pretrained(path)
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    cfg = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=steps,
                    learning_rate=lr, beta=0.1, loss_type=["sigmoid"], use_cpu=True, report_to="none",
                    save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, max_length=64,
                    dataloader_num_workers=0)
    tr = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), ref_model=AutoModelForCausalLM.from_pretrained(path),
                    args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Timer()])
    tr.train()
    return summarize(times, [batch * TOKENS_PER_PAIR] * len(times), warmup=WARMUP)


def side_rlhf(path, steps, batch, lr):
    from rlhf.config import parse
    from rlhf.trainers.supervised import run_supervised
    from rlhf.trainers.tasks import DPOTask
    from rlhf.utils.logging import read_metrics

    log = tempfile.mkdtemp()
    d = os.path.join(path, "data")
    cfg = parse("dpo", ["--pretrain", path, "--dataset", f"{d}/pref_train.jsonl", "--eval_split", "0",
                        "--train_batch_size", str(batch), "--micro_train_batch_size", str(batch),
                        "--max_global_steps", str(steps), "--learning_rate", str(lr), "--beta", "0.1",
                        "--log_dir", log, "--save_path", os.path.join(log, "m"), "--no_progress_bar",
                        "--max_len", "64"])
    run_supervised(cfg, DPOTask, "pref")
    rows = [r for r in read_metrics(os.path.join(log, "metrics.jsonl")) if r["split"] == "train"]
    times = [b["time_s"] - a["time_s"] for a, b in zip(rows, rows[1:])]
    # times are differences of log stamps, so the first is step 2's: one fewer to leave out
    return summarize(times, [batch * TOKENS_PER_PAIR] * len(times), warmup=WARMUP - 1)


@click.command()
@click.option("--side", type=click.Choice(["both", "trl", "rlhf"]), default="both")
@click.option("--steps", default=40)
@click.option("--batch", default=32)
@click.option("--lr", default=5e-5)
@click.option("--rounds", default=3, help="runs of each side, alternating order; medians are reported")
@click.option("--kit_dir", default=os.path.join(tempfile.gettempdir(), "rlhf-bench-kit"))
def main(side, steps, batch, lr, rounds, kit_dir):
    path = kit(kit_dir)
    args = ["--steps", str(steps), "--batch", str(batch), "--lr", str(lr), "--kit_dir", kit_dir]
    if side != "both":
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        fn = side_trl if side == "trl" else side_rlhf
        print("RESULT " + json.dumps(fn(path, steps, batch, lr)))
        return
    rows, ratios = run_rounds(__file__, args, rounds)
    settings = {"model": "qwen2 2L h64", "pairs_per_step": batch, "steps": steps,
                "threads": os.environ.get("OMP_NUM_THREADS", "2"), "rounds": rounds}
    print(table("DPO step", rows, settings, ratios))
    print("wrote", save("dpo_vs_trl", rows, settings, ratios))


if __name__ == "__main__":
    main()
