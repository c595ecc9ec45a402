"""The built-in CPU demo as one command:  python -m rlhf.demo [--nproc 2]

1. SFT the random tiny Llama on the arithmetic task   (torchrun -m rlhf.train_sft  --config configs/sft_tiny.yaml)
2. GRPO on it, hybrid engine, 2 ranks                 (torchrun -m rlhf.train_grpo --config configs/grpo_tiny.yaml)
then prints how the reward moved.  Everything is built locally; nothing is downloaded.
"""
from __future__ import annotations

import os
import subprocess
import sys

import click

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(nproc: int, module: str, config: str, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module,
           "--config", os.path.join(ROOT, "configs", config), *extra]
    click.echo("+ " + " ".join(cmd))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1")
    subprocess.run(cmd, check=True, env=env)


@click.command()
@click.option("--nproc", default=2, show_default=True, help="ranks (CPU processes)")
@click.option("--out", default="./output", show_default=True)
def main(nproc, out):
    from rlhf.utils.logging import read_metrics

    _torchrun(nproc, "rlhf.train_sft", "sft_tiny.yaml",
              ["--save_path", f"{out}/tiny_sft", "--ckpt_path", f"{out}/tiny_sft_ckpt", "--log_dir", f"{out}/logs/sft"])
    log = f"{out}/logs/grpo"
    if os.path.exists(f"{log}/metrics.jsonl"):
        os.remove(f"{log}/metrics.jsonl")
    _torchrun(nproc, "rlhf.train_grpo", "grpo_tiny.yaml",
              ["--pretrain", f"{out}/tiny_sft", "--save_path", f"{out}/tiny_grpo", "--ckpt_path",
               f"{out}/tiny_grpo_ckpt", "--log_dir", log])
    rows = read_metrics(f"{log}/metrics.jsonl")
    train = [r for r in rows if r["split"] == "train"]
    k = max(1, len(train) // 4)
    first = sum(r["reward_accuracy"] for r in train[:k]) / k
    last = sum(r["reward_accuracy"] for r in train[-k:]) / k
    secs = sum(r["time_step"] for r in train)
    click.echo(f"\nGRPO on the tiny model, {len(train)} steps in {secs:.0f}s: exact-match accuracy of sampled answers "
               f"{first:.3f} (first {k} steps) -> {last:.3f} (last {k} steps); model saved to {out}/tiny_grpo")


if __name__ == "__main__":
    main()
