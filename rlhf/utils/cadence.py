"""The loop cadence every trainer uses: log, eval, save, preempt, resume, at step boundaries.

Every decision here (log now? evaluate now? save now? stop now?) is computed from
state all ranks share: the step counter, the config, and one collective that
agrees on a stop request.  So every rank takes the same collectives after every
step.  A trainer provides the ``Steps`` protocol.
"""
from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Callable, Dict, Optional, Protocol

from rlhf.console import print0
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.preempt import StopSignal

if TYPE_CHECKING:  # annotations only: utils sits below config
    from rlhf.config.schema import CheckpointConfig, LoggingConfig


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


class StreakGuard:
    """Counts bad steps in a row: a warning for each, an error once ``threshold`` of them (0: never) came in a
    row; a good step resets the count.  The error names ``flag`` and ``fix``.  Decided from values every rank
    shares, so every rank stops at the same step."""

    flag = ""
    fix = ""

    def __init__(self, threshold: int):
        self.threshold, self.streak = int(threshold), 0

    def record(self, message: Optional[Callable[[int], str]], stacklevel: int) -> None:
        """``message(streak)`` for a bad step, None for a good one."""
        if message is None:
            self.streak = 0
            return
        self.streak += 1
        msg = message(self.streak)
        if self.threshold > 0 and self.streak >= self.threshold:
            raise RuntimeError(f"{msg}; stopping after {self.flag} {self.threshold}. {self.fix}, or raise "
                               f"{self.flag} (0 = never stop)")
        warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel + 1)


class NonFiniteGuard(StreakGuard):
    """Steps in a row whose grad norm (any ``*grad_norm`` metric, reduced so every rank sees the same value) is
    NaN/inf -- the engine skipped the optimizer step."""

    flag = "--max_nonfinite_steps"
    fix = ("Lower the learning rate, check the data for empty/degenerate batches, resume from an earlier "
           "checkpoint")

    def check(self, step: int, metrics: Dict[str, float]) -> None:
        bad = sorted(k for k, v in metrics.items()
                     if k.endswith("grad_norm") and isinstance(v, (int, float)) and not math.isfinite(v))
        self.record((lambda n: f"step {step}: {', '.join(bad)} is not finite: the optimizer step was skipped ({n} "
                                f"such step(s) in a row)") if bad else None, stacklevel=2)


class Cadence:
    """Step-boundary bookkeeping of one run (see module docstring), built from its own flag groups:
    ``--logging_steps`` / ``--eval_steps`` (``LoggingConfig``) and ``--save_steps`` / ``--ckpt_path`` /
    ``--load_checkpoint`` / ``--max_nonfinite_steps`` (``CheckpointConfig``), plus the runtime objects (the logger,
    the stop signal) as arguments, as torchtitan's components take their own ``Config`` and runtime objects
    (torchtitan/config/configurable.py ``Config.build(**kwargs)``)."""

    def __init__(self, logging: LoggingConfig, checkpoint: CheckpointConfig, logger: MetricsLogger,
                 stop: Optional[StopSignal] = None):
        self.lg, self.ck = logging, checkpoint
        self.logger = logger
        self.stop = stop or StopSignal()
        self.last_eval_step = -1
        self.preempted = False
        self.nonfinite = NonFiniteGuard(self.ck.max_nonfinite_steps)

    def start(self, t: Steps) -> None:
        self.stop.install()
        if self.ck.load_checkpoint and t.resume():
            self.logger.resume_at(t.step)  # metrics rows past the checkpoint are trained again: drop them

    def after_step(self, t: Steps, metrics: Dict[str, float]) -> bool:
        """Log / eval / save after step ``t.step``; returns False when the run must stop now (preemption)."""
        if t.step % self.lg.logging_steps == 0 or t.step == t.total_steps:
            self.logger.log(t.step, metrics)
        self.logger.advance()
        self.nonfinite.check(t.step, metrics)
        if self.lg.eval_steps > 0 and t.step % self.lg.eval_steps == 0:
            self.evaluate(t)
        if self.ck.save_steps > 0 and t.step % self.ck.save_steps == 0:
            t.save()
        if t.step < t.total_steps and self.stop.requested():
            reason = self.stop.reason()
            if not (self.ck.save_steps > 0 and t.step % self.ck.save_steps == 0):
                t.save()
            self.preempted = True
            print0(f"[preempt] {reason}: checkpoint of step {t.step} saved in {self.ck.ckpt_path}; the run is NOT "
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
