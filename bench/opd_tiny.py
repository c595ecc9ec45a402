"""On-policy distillation on the tiny kit (issue 46 item 1): the teacher is the kit model SFT'd on the arithmetic
task (``configs/sft_tiny.yaml``, as rlhf/demo.py), the student the raw kit model; 30 GRPO steps of OPD alone
(``--opd_only``: advantages = -(log pi_student - log pi_teacher) per sampled token, rlhf.rl.opd); each step 64
prompts x 16 samples at temperature 1, trained in 8 optimizer steps of 128 rows (--train_batch_size 128), lr 3e-3.

    python bench/opd_tiny.py [--work DIR] [--steps 30] [--lr 3e-3] [--seed 42]   # ~3 min on 2 shared CPU cores

Measured: the per-token reverse KL on the student's samples (``opd/reverse_kl``) over the steps, the held-out
exact-match accuracy (the kit's 64 eval prompts, greedy, builtin:arithmetic) of the raw student, of the student
after OPD (and at every --eval_every steps) and of the teacher, and the teacher forward's time per step.  Every run
is the real CLI in one process (``python -m rlhf.train_grpo``, HF rollout engine, the teacher on the actor's rank);
the accuracy of a model that is not trained is its eval after one step at learning rate 0.  Writes
DIR/opd_tiny.json and prints a summary.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import click

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere: the checkout's rlhf


def _run(module: str, args, log_dir: str):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", module, "--log_dir", log_dir, "--no_progress_bar", *map(str, args)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    from rlhf.utils.logging import read_metrics

    rows = read_metrics(os.path.join(log_dir, "metrics.jsonl"))
    return [r for r in rows if r["split"] == "train"], [r for r in rows if r["split"] == "eval"]


def _grpo(kit: str, pretrain: str, teacher: str, work: str, name: str, lr: float, steps: int, eval_every: int,
          seed: int):
    d = os.path.join(kit, "data")
    log = os.path.join(work, "logs", name)
    if os.path.exists(os.path.join(log, "metrics.jsonl")):
        os.remove(os.path.join(log, "metrics.jsonl"))
    return _run("rlhf.train_grpo", [
        "--pretrain", pretrain, "--teacher_pretrain", teacher, "--opd_only", "--prompt_data",
        f"{d}/prompts_train.jsonl", "--eval_dataset", f"{d}/prompts_eval.jsonl", "--remote_rm_url",
        "builtin:arithmetic", "--rollout_engine", "hf", "--rollout_batch_size", 64, "--n_samples_per_prompt", 16,
        "--micro_rollout_batch_size", 1024, "--train_batch_size", 128, "--micro_train_batch_size", 128,
        "--generate_max_len", 6, "--temperature", 1.0, "--eval_temperature", 0, "--eval_n_samples_per_prompt", 1,
        "--actor_learning_rate", lr, "--lr_scheduler", "constant", "--init_kl_coef", 0, "--max_global_steps", steps,
        "--eval_steps", eval_every, "--seed", seed, "--save_path", os.path.join(work, name)], log)


@click.command()
@click.option("--work", default="./output/opd_bench", show_default=True)
@click.option("--steps", default=30, show_default=True)
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--eval_every", default=10, show_default=True)
@click.option("--seed", default=42, show_default=True)
def main(work, steps, lr, eval_every, seed):
    from rlhf.models.load import resolve_pretrain

    work = os.path.abspath(work)
    kit = resolve_pretrain(None)
    teacher = os.path.join(work, "teacher")
    if not os.path.isfile(os.path.join(teacher, "model.safetensors")):
        _run("rlhf.train_sft", ["--config", os.path.join(ROOT, "configs", "sft_tiny.yaml"), "--save_path", teacher,
                                "--ckpt_path", os.path.join(work, "teacher_ckpt")], os.path.join(work, "logs", "sft"))
    acc = {}
    for name, model in (("teacher", teacher), ("student_raw", kit)):  # eval after one step at lr 0: unchanged
        _, ev = _grpo(kit, model, teacher, work, f"eval_{name}", 0.0, 1, 1, seed)
        acc[name] = ev[-1]["reward_accuracy"]
    train, ev = _grpo(kit, kit, teacher, work, "opd", lr, steps, eval_every, seed)
    kl = [r["opd/reverse_kl"] for r in train]
    k = max(1, len(kl) // 6)
    out = {"steps": len(train), "lr": lr, "seed": seed, "reverse_kl": kl,
           "reverse_kl_first": sum(kl[:k]) / k, "reverse_kl_last": sum(kl[-k:]) / k,
           "heldout_accuracy": {"teacher": acc["teacher"], "student_raw": acc["student_raw"],
                                **{f"student_step_{e['step']}": e["reward_accuracy"] for e in ev}},
           "sampled_accuracy": [r["reward_accuracy"] for r in train],
           "time_teacher_s_per_step": sum(r["time_teacher"] for r in train) / len(train),
           "time_step_s": sum(r["time_step"] for r in train) / len(train)}
    with open(os.path.join(work, "opd_tiny.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    h = out["heldout_accuracy"]
    click.echo(f"OPD alone, raw student <- SFT'd teacher, {len(train)} steps (lr {lr}, seed {seed}): reverse KL per "
               f"token {out['reverse_kl_first']:.3f} (first {k} steps) -> {out['reverse_kl_last']:.3f} (last {k}); "
               f"held-out accuracy {h['student_raw']:.3f} -> {ev[-1]['reward_accuracy']:.3f} (teacher "
               f"{h['teacher']:.3f}); teacher forward {out['time_teacher_s_per_step'] * 1000:.0f} ms of "
               f"{out['time_step_s'] * 1000:.0f} ms per step")


if __name__ == "__main__":
    main()
