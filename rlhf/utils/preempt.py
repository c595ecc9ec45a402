"""Stop requests: the stop file ($RLHF_STOP_FILE, touched by the sbatch trap), SIGUSR1, SIGTERM, SIGINT, SIGHUP.

A file works through every layer (sbatch -> srun -> torchrun -> ranks), where a
signal would have to survive torchrun's own handlers.  SIGUSR1 and SIGTERM
delivered to a rank (torchrun forwards SIGTERM to its workers when the scheduler
or an operator stops it, then kills them after its grace period, 30 s by default)
are recorded and acted on at the next step boundary: every rank agrees through one
collective, checkpoints, and exits with a "[preempt] ... NOT complete" line and exit code 75
(``rlhf.config.cli.EXIT_PREEMPTED``).  The bound: the step in progress plus the save must end within
torchrun's grace (30 s after it forwards TERM) and the scheduler's (SLURM's KillWait); longer steps get their
checkpoint from the sbatch scripts' USR1 lead time (``--signal_lead_s``), not from TERM.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

import torch

from rlhf.distributed import comm


class StopSignal:
    """Records stop requests of this process; ``requested()`` is the collective that agrees on one."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # INT (Ctrl-C), HUP: as TERM

    def __init__(self, stop_file: Optional[str] = None):
        self.stop_file = stop_file if stop_file is not None else os.environ.get("RLHF_STOP_FILE")
        self.signal_name: Optional[str] = None
        self._agreed = ""

    def install(self) -> None:
        def handler(signum, frame):
            self.signal_name = signal.Signals(signum).name

        for s in self.SIGNALS:
            try:
                signal.signal(s, handler)
            except ValueError:  # not the main thread
                pass

    def local(self) -> int:
        """0: nothing; 1: stop file; 2: a signal."""
        if self.signal_name:
            return 2
        return 1 if self.stop_file and os.path.exists(self.stop_file) else 0

    def requested(self) -> bool:
        """Collective: True on every rank if any rank saw the stop file or a signal."""
        v = int(comm.all_reduce(torch.tensor([self.local()]), op="max").item())
        self._agreed = {1: f"stop file {self.stop_file}", 2: "stop signal (SIGTERM/SIGUSR1)"}.get(v, "")
        return v > 0

    def reason(self) -> str:
        return self._agreed or "stop requested"
