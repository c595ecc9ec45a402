"""Rank-0 progress bar with ETA, one metrics line per step, JSONL always (metrics.jsonl; eval samples in
generations.jsonl), wandb / TensorBoard on request."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def tensorboard_dir(use_tensorboard, log_dir: str) -> Optional[str]:
    """--use_tensorboard alone (True / "True") -> log_dir/tensorboard; --use_tensorboard DIR -> DIR; unset -> None."""
    if use_tensorboard in (None, False, "", "False", "false", "0"):
        return None
    if use_tensorboard in (True, "True", "true", "1"):
        return os.path.join(log_dir, "tensorboard")
    return os.path.expanduser(str(use_tensorboard))


class MetricsLogger:
    def __init__(self, rank: int, log_dir: str, total_steps: int, run_name: str = "run", use_wandb: Optional[str] = None,
                 wandb_project: str = "rlhf", wandb_org: Optional[str] = None, use_tensorboard=None,
                 progress_bar: bool = True, config: Optional[dict] = None, initial_step: int = 0):
        self.rank = rank
        self.active = rank == 0
        self.jsonl = None
        self.bar = None
        self.wandb = None
        self.tb = None
        self.generations_table = None
        self.t0 = time.time()
        if not self.active:
            return
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self.jsonl = open(self.path, "a", buffering=1)
        self.generations_path = os.path.join(log_dir, "generations.jsonl")
        if progress_bar and sys.stderr.isatty():  # in batch logs the per-step metrics lines are the progress
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc=run_name, dynamic_ncols=True,
                            mininterval=0.5)
        if use_wandb:
            try:  # optional: imported only when asked for (the GPU image has no wandb)
                import wandb
            except ImportError:
                raise ImportError("--use_wandb needs the wandb package: pip install wandb, or drop --use_wandb "
                                  "(metrics.jsonl and --use_tensorboard log without it)") from None

            if use_wandb not in ("True", "true", "1") and os.environ.get("WANDB_MODE") != "offline":
                wandb.login(key=use_wandb)
            self.wandb = wandb.init(project=wandb_project, entity=wandb_org, name=run_name, config=config,
                                    dir=log_dir, reinit=True)
        tb_dir = tensorboard_dir(use_tensorboard, log_dir)
        if tb_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tb_dir)

    def log(self, step: int, metrics: Dict[str, float], prefix: str = "train") -> None:
        if not self.active:
            return
        row = {"step": step, "split": prefix, "time_s": round(time.time() - self.t0, 3), **metrics}
        self.jsonl.write(json.dumps(row) + "\n")
        line = f"[{prefix} {step}] " + " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in metrics.items()}, step=step)
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{prefix}/{k}", v, step)

    GENERATION_COLUMNS = ("step", "prompt", "response", "label", "reward")

    def log_generations(self, step: int, rows: List[dict]) -> None:
        """Eval samples ({prompt, response, label, reward}) of ``step``: appended to ``generations.jsonl`` beside
        metrics.jsonl, one JSON object per sample with its step; with wandb, the ``eval/generations`` table, one
        row per sample, holding every eval so far.  A wandb.Table logged twice under one key shows the first
        version only, so each eval logs a new Table with the old rows plus the new ones (the workaround veRL's
        ValidationGenerationsLogger and OpenRLHF's WandbLogger use, wandb issue 2981)."""
        if not self.active or not rows:
            return
        cols = self.GENERATION_COLUMNS
        with open(self.generations_path, "a") as fh:
            for r in rows:
                fh.write(json.dumps({"step": step, **{c: r.get(c) for c in cols[1:]}}) + "\n")
        if self.wandb is not None:
            import wandb

            old = [] if self.generations_table is None else self.generations_table.data
            table = wandb.Table(columns=list(cols), data=[list(x) for x in old])
            for r in rows:
                table.add_data(step, *(r.get(c) for c in cols[1:]))
            self.generations_table = table
            self.wandb.log({"eval/generations": table}, step=step)

    def resume_at(self, step: int) -> None:
        """After loading a checkpoint of ``step``: drop metrics rows past it (the crashed run's steps that will be
        trained again) and keep one row per (split, step), the newest; move the progress bar."""
        self.advance(step)
        if not self.active:
            return
        self.jsonl.close()
        rows = []
        with open(self.path) as fh:
            for line in fh:
                try:
                    rows.append(json.loads(line))
                except ValueError:  # a line cut by the crash
                    pass
        latest = {}
        for i, r in enumerate(rows):
            if r.get("step", 0) <= step:
                latest[(r.get("split"), r.get("step"))] = i
        keep = sorted(latest.values())
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            for i in keep:
                fh.write(json.dumps(rows[i]) + "\n")
        os.replace(tmp, self.path)
        self.jsonl = open(self.path, "a", buffering=1)
        if len(keep) < len(rows):
            print(f"[resume] {self.path}: removed {len(rows) - len(keep)} rows past step {step} or repeated",
                  flush=True)
        if os.path.isfile(self.generations_path):  # the samples of evals past the checkpoint are drawn again
            with open(self.generations_path) as fh:
                gen = [line for line in fh if _step_of(line) <= step]
            with open(tmp, "w") as fh:
                fh.writelines(gen)
            os.replace(tmp, self.generations_path)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        if self.jsonl:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()


def _step_of(line: str) -> float:
    """A generations.jsonl line's step; a line cut by a crash counts as past every step (dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def read_metrics(path: str):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
