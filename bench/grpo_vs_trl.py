"""GRPO step throughput: rlhf.train_grpo vs TRL's GRPOTrainer, same tiny model, data, reward, batch, lengths.

    pip install -e ".[bench]" && python bench/grpo_vs_trl.py [--steps 30 --prompts 8 --n 8 --max_new 16 --rounds 3]

Both sides run single-process on the CPU over the same HF model, no vLLM (TRL: ``model.generate``;
rlhf: its HF engine's KV-cached decode loop, rlhf/rollout/sampling.py), KL as a k3
loss (beta 0.001) against a frozen reference, token-mean loss, group-normalised
advantages, one optimizer step per generation batch.  Prints a table; writes
bench/results/grpo_vs_trl.json.
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


def reward_trl(prompts, completions, label, **kwargs):
    from rlhf.data.tasks import arithmetic_score

    return [arithmetic_score(c, l) for c, l in zip(completions, label)]


def side_trl(path, steps, prompts, n, max_new, lr):
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    ds = load_dataset("json", data_files=os.path.join(path, "data", "prompts_train.jsonl"), split="train")
    ds = ds.rename_column("input", "prompt")
    tok = AutoTokenizer.from_pretrained(path)
    times, tokens = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    out = tempfile.mkdtemp()
    cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=prompts * n, num_generations=n,
                     max_completion_length=max_new, learning_rate=lr, max_steps=steps, logging_steps=1, beta=0.001,
                     use_cpu=True, report_to="none", save_strategy="no", temperature=1.0, loss_type="dapo",
                     gradient_accumulation_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    tr = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=reward_trl, args=cfg,
                     train_dataset=ds, processing_class=tok, callbacks=[Timer()])
    tr.train()
    for h in tr.state.log_history:
        if "completions/mean_length" in h:
            prompt_tok = 4.0  # "a+b=" prompts are 4 tokens in this tokenizer
            tokens.append(prompts * n * (h["completions/mean_length"] + prompt_tok))
    return summarize(times, tokens[:len(times)], warmup=WARMUP)


def side_rlhf(path, steps, prompts, n, max_new, lr):
    from rlhf.config import parse
    from rlhf.train_grpo import GRPO_DEFAULTS
    from rlhf.trainers.rl_trainer import run_rl
    from rlhf.utils.logging import read_metrics

    log = tempfile.mkdtemp()
    d = os.path.join(path, "data")
    cfg = parse("grpo", ["--pretrain", path, "--prompt_data", f"{d}/prompts_train.jsonl", "--remote_rm_url",
                         "builtin:arithmetic", "--rollout_batch_size", str(prompts), "--n_samples_per_prompt", str(n),
                         "--train_batch_size", str(prompts * n), "--micro_train_batch_size", str(prompts * n),
                         "--micro_rollout_batch_size", str(prompts), "--generate_max_len", str(max_new),
                         "--max_global_steps", str(steps), "--actor_learning_rate", str(lr), "--eval_steps", "0",
                         "--log_dir", log, "--save_path", os.path.join(log, "m"), "--no_progress_bar",
                         "--init_kl_coef", "0.001", "--lr_warmup_ratio", "0"], GRPO_DEFAULTS)
    cfg.logging.eval_steps = 0
    run_rl(cfg, "grpo")
    rows = [r for r in read_metrics(os.path.join(log, "metrics.jsonl")) if r["split"] == "train"]
    return summarize([r["time_step"] for r in rows], [r["tokens_per_s"] * r["time_step"] for r in rows],
                     warmup=WARMUP)


@click.command()
@click.option("--side", type=click.Choice(["both", "trl", "rlhf"]), default="both")
@click.option("--steps", default=30)
@click.option("--prompts", default=8)
@click.option("--n", default=8)
@click.option("--max_new", default=16)
@click.option("--lr", default=1e-5)
@click.option("--rounds", default=3, help="runs of each side, alternating order; medians are reported")
@click.option("--kit_dir", default=os.path.join(tempfile.gettempdir(), "rlhf-bench-kit"))
def main(side, steps, prompts, n, max_new, lr, rounds, kit_dir):
    path = kit(kit_dir)
    args = ["--steps", str(steps), "--prompts", str(prompts), "--n", str(n), "--max_new", str(max_new), "--lr",
            str(lr), "--kit_dir", kit_dir]
    if side != "both":
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        fn = side_trl if side == "trl" else side_rlhf
        print("RESULT " + json.dumps(fn(path, steps, prompts, n, max_new, lr)))
        return
    rows, ratios = run_rounds(__file__, args, rounds)
    settings = {"model": "qwen2 2L h64", "prompts": prompts, "n": n, "max_new_tokens": max_new, "steps": steps,
                "threads": os.environ.get("OMP_NUM_THREADS", "2"), "rounds": rounds}
    print(table("GRPO step", rows, settings, ratios))
    print("wrote", save("grpo_vs_trl", rows, settings, ratios))


if __name__ == "__main__":
    main()
