"""Run the real CLIs under torchrun and read their metrics."""
import os
import subprocess
import sys

from rlhf.utils.logging import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def flags_argv(flags: dict) -> list:
    """{flag: value} -> argv: True -> ``--flag``; False / None left out; a tuple -> ``--flag v1 v2``."""
    out = []
    for k, v in flags.items():
        if v is True:
            out.append(f"--{k}")
        elif v is not False and v is not None:
            out += [f"--{k}", *(map(str, v) if isinstance(v, tuple) else [str(v)])]
    return out


def rl_args(kit, sft, **over) -> list:
    """argv of a short GRPO / PPO run from ``sft`` on ``kit``'s arithmetic prompts (builtin reward), ``over``
    replacing any flag (tests/e2e/test_rl.py, tests/vllm_cpu/test_vllm_e2e.py)."""
    d = os.path.join(kit, "data")
    args = {"pretrain": sft, "prompt_data": f"{d}/prompts_train.jsonl", "eval_dataset": f"{d}/prompts_eval.jsonl",
            "remote_rm_url": "builtin:arithmetic", "generate_max_len": 6, "rollout_batch_size": 8,
            "n_samples_per_prompt": 4, "train_batch_size": 16, "micro_train_batch_size": 8,
            "micro_rollout_batch_size": 32, "eval_temperature": 0.0, "eval_n_samples_per_prompt": 1}
    args.update(over)
    return flags_argv(args)


def torchrun(module: str, nproc: int, args, cwd, log_dir: str, timeout: int = 600):
    """nproc 0: plain ``python -m module`` (one process, no torchrun and none of its environment variables).
    Returns (train rows, eval rows, stdout + stderr)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, "-m", module, "--log_dir", log_dir, "--no_progress_bar", *map(str, args)]
    env = {k: v for k, v in os.environ.items() if nproc or k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env = dict(env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    rows = read_metrics(os.path.join(log_dir, "metrics.jsonl"))
    return [r for r in rows if r["split"] == "train"], [r for r in rows if r["split"] == "eval"], p.stdout + p.stderr
