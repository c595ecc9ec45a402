"""The loop cadence every trainer uses: log, eval, save, preempt, resume, at step boundaries.

Every decision here (log now? evaluate now? save now? stop now?) is computed from
state all ranks share: the step counter, the config, and one collective that
agrees on a stop request.  So every rank takes the same collectives after every
step.  A trainer provides the ``Steps`` protocol.
"""
from __future__ import annotations

from typing import Dict, Optional, Protocol

from rlhf.distributed import comm
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.preempt import StopSignal


class Steps(Protocol):
    step: int
    total_steps: int

    def evaluate(self) -> Dict[str, float]: ...

    def save(self) -> None: ...

    def resume(self) -> bool: ...

    def finish(self) -> None: ...  # final export (HF model), collective


def planned_steps(per_pass: int, passes: int, max_global_steps: int, pass_flag: str) -> tuple:
    """(steps the run takes, a note or None): ``per_pass`` x ``passes`` steps of data, capped by
    --max_global_steps; a cap above what the data gives is said, with the flag that gives more, never silent."""
    total = per_pass * passes
    if max_global_steps <= 0 or max_global_steps == total:
        return total, None
    if max_global_steps < total:
        return max_global_steps, None
    need = -(-max_global_steps // max(per_pass, 1))
    return total, (f"[data] --max_global_steps {max_global_steps} asks for more than the data gives: {per_pass} steps "
                   f"per pass x {pass_flag} {passes} = {total}; running {total} (e.g. {pass_flag} {need} runs "
                   f"{max_global_steps})")


def log0(msg: str) -> None:
    if comm.rank() == 0:
        print(msg, flush=True)


class Cadence:
    """Step-boundary bookkeeping of one run (see module docstring)."""

    def __init__(self, cfg, logger: MetricsLogger, stop: Optional[StopSignal] = None):
        self.lg, self.ck = cfg.logging, cfg.checkpoint
        self.logger = logger
        self.stop = stop or StopSignal()
        self.last_eval_step = -1
        self.preempted = False

    def start(self, t: Steps) -> None:
        self.stop.install()
        if self.ck.load_checkpoint and t.resume():
            self.logger.resume_at(t.step)  # metrics rows past the checkpoint are trained again: drop them

    def after_step(self, t: Steps, metrics: Dict[str, float]) -> bool:
        """Log / eval / save after step ``t.step``; returns False when the run must stop now (preemption)."""
        if t.step % self.lg.logging_steps == 0 or t.step == t.total_steps:
            self.logger.log(t.step, metrics)
        self.logger.advance()
        if self.lg.eval_steps > 0 and t.step % self.lg.eval_steps == 0:
            self.evaluate(t)
        if self.ck.save_steps > 0 and t.step % self.ck.save_steps == 0:
            t.save()
        if t.step < t.total_steps and self.stop.requested():
            reason = self.stop.reason()
            if not (self.ck.save_steps > 0 and t.step % self.ck.save_steps == 0):
                t.save()
            self.preempted = True
            log0(f"[preempt] {reason}: checkpoint of step {t.step} saved in {self.ck.ckpt_path}; the run is NOT "
                 f"complete ({t.step}/{t.total_steps} steps): resume with --load_checkpoint")
            return False
        return True

    def evaluate(self, t: Steps) -> None:
        metrics = t.evaluate()
        self.last_eval_step = t.step
        if metrics:
            self.logger.log(t.step, metrics, prefix="eval")

    def finish(self, t: Steps) -> None:
        """After the last step: a final eval unless one just ran, the export, closing the logs."""
        if not self.preempted:
            if self.last_eval_step != t.step:
                self.evaluate(t)
            t.finish()
        self.logger.close()
