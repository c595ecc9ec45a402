"""The watchdog: a deadline per phase, the job-wide abort poll, and the stop notice (a daemon thread per rank).

* ``Watchdog`` polls the store's abort key (so a rank blocked in a collective, or computing without any
  collective, ends within a second or two of another rank's failure, also on NCCL where a dead peer is not
  noticed) and enforces a deadline per phase: a rank stuck in a phase longer than its deadline prints every
  rank's current phase, leaves PyTorch's flight-recorder dump, and ends the job (``rlhf.distributed.abort.die``).
* Each phase is entered with ``watchdog.phase(name)``; its name and start time go to the store, so the report
  says where every rank was.
* Under torchrun it also watches the agent that started the rank (``rlhf.distributed.failfast.agent_gone``): an
  orphaned rank stops at once with one line.
* A stop signal is announced when it arrives (``stop_notice``), not after the step, which may be too late.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Dict, Optional

from rlhf.console import process_rank as _rank
from rlhf.distributed.abort import AbortBoard, board, die, say, world_size
from rlhf.distributed.failfast import agent_gone, launcher_pid, orphaned

GRACE_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's --shutdown_timeout (torch/distributed/launcher/api.py)


def torchrun_grace_s() -> int:
    """Seconds torchrun waits after forwarding a stop signal before it SIGKILLs the ranks: its --shutdown_timeout,
    read from TORCH_ELASTIC_SHUTDOWN_TIMEOUT when that is how it was set (the sbatch scripts), else torch's 30."""
    try:
        return int(os.environ.get(GRACE_ENV, "30"))
    except ValueError:
        return 30


def stop_notice(signal_name: str, phase: Optional[str], running_s: float, cut_phases=()) -> str:
    """What a stop signal will do, said when it arrives (not after the step, which may be too late)."""
    where = f"during '{phase}' ({running_s:.0f}s in)" if phase else "between phases"
    if phase in cut_phases:
        plan = (f"the step is cut when this phase ends ({', '.join(cut_phases)} are cut) and the last completed "
                f"step is saved")
    else:
        plan = "the checkpoint is written when this step ends"
    grace = torchrun_grace_s()
    return (f"[preempt] {signal_name} received {where}: {plan}; torchrun kills the ranks {grace}s after it forwards "
            f"the signal (torchrun --shutdown_timeout / {GRACE_ENV}; under SLURM also KillWait): if the rest of "
            f"this phase or step plus the save takes longer, nothing is saved. Raise that timeout, or stop with "
            f"the stop file ($RLHF_STOP_FILE) or SIGUSR1, which have no deadline")


FR_DUMP_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # new name first (torch >= 2.9)


def dump_flight_recorder(rank: int) -> Optional[str]:
    """Write PyTorch's flight-recorder ring buffer (the last collectives of every group on this rank) to
    ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` before the watchdog ends a stuck job; returns the path, or None.

    NCCL's own watchdog dumps only when *its* collective timeout (``--dist_timeout_s``) fires first
    (``TORCH_NCCL_DUMP_ON_TIMEOUT``); our phase deadline is usually shorter, so without this a phase timeout
    would leave no trace.  Reads the dump with ``torch._C._distributed_c10d._dump_fr_trace`` (torch >= 2.6; older:
    ``_dump_nccl_trace``), the call torch's own dump-on-timeout makes.  Never raises."""
    prefix = next((os.environ[k] for k in FR_DUMP_ENV if os.environ.get(k)), None)
    if not prefix:
        return None
    try:
        import torch._C._distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
        if dump is None:
            return None
        data = dump()
        path = f"{prefix}{rank}"
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data if isinstance(data, bytes) else str(data).encode())
        return path
    except Exception:  # reporting must never raise over the hang being reported
        return None


def refill_deadlines(default_s: float, slow_s: float, max_rounds: int) -> tuple:
    """(one round, the whole stage) deadlines of a dynamic-filtering refill: a round generates (a slow phase) and
    scores (an ordinary one); the stage runs up to ``max_rounds + 1`` rounds (--dynamic_filtering_max_rounds)."""
    round_s = slow_s + default_s
    return round_s, round_s * (max_rounds + 1)


class Watchdog:
    """Per-phase deadlines and the abort poll (a daemon thread; see module docstring).

    ``deadlines``: phase name -> seconds; ``default_s`` for the others; ``slow_s`` for
    the first time each phase runs (compilation, allocator warm-up, vLLM graphs).

    Waiting for another role: in a placement with ranks of their own per role, a rank that is not a member of
    a stage's role only waits (in the stage's gather, or, where the stage has no collective for it, in the next
    one it takes part in).  ``phase(name, waits_for=role)`` says so: the board reads ``waiting for <role>
    (<name>)`` and the phase is held to ``name``'s own deadline.  Its deadline is *owed* onward: the next
    top-level phase this rank enters gets its own deadline plus what the waiting phases before it owed, because
    the members may still be working through those phases while this rank already waits in the next collective.
    The members themselves keep the tight deadline of what they run; a waiting rank never trips before them.
    A top-level phase entered without ``waits_for`` (this rank's own work) clears what was owed when it ends.

    ``deadline_s`` overrides one phase's deadline (a refill round).  ``start=False`` runs no thread (tests call
    ``overdue()``)."""

    def __init__(self, default_s: float = 600.0, deadlines: Optional[Dict[str, float]] = None,
                 slow_s: Optional[float] = None, poll_s: float = 1.0, board_: Optional[AbortBoard] = None,
                 start: bool = True):
        self.default_s = default_s
        self.deadlines = dict(deadlines or {})
        self.slow_s = slow_s or default_s
        self.poll_s = poll_s
        self.board = board_ or board()
        self.rank, self.world = _rank(), world_size()
        self._seen = set()
        self._owed = 0.0                        # deadlines of waiting phases not yet matched by own work
        self._lock = threading.Lock()
        self._current: Optional[tuple] = None   # (label, start, deadline)
        self._stop = threading.Event()
        self._agent = launcher_pid()            # torchrun's agent: a rank whose agent died stops (orphaned)
        self._stop_source = None                # an object whose ``signal_name`` a stop signal sets (StopSignal)
        self._top: Optional[tuple] = None       # (name, start) of the top-level phase (a stage)
        self._cut_phases: tuple = ()
        self._announced = False
        self._thread = threading.Thread(target=self._loop, name="rlhf-watchdog", daemon=True)
        if start:
            self._thread.start()

    def deadline_of(self, name: str) -> float:
        d = self.deadlines.get(name, self.default_s)
        return max(d, self.slow_s) if name not in self._seen else d

    @staticmethod
    def label(name: str, waits_for: Optional[str]) -> str:
        """What the board shows for a phase: ``name``, or ``waiting for <role> (<name>)``."""
        return f"waiting for {waits_for} ({name})" if waits_for else name

    @contextlib.contextmanager
    def phase(self, name: str, waits_for: Optional[str] = None, deadline_s: Optional[float] = None):
        """Enter phase ``name`` (see the class docstring for ``waits_for`` and ``deadline_s``)."""
        label = self.label(name, waits_for)
        with self._lock:
            outer = self._current
            own = deadline_s if deadline_s is not None else self.deadline_of(name)
            top = outer is None
            self._current = (label, time.monotonic(), own + (self._owed if top else 0.0))
            if top:
                self._top = (name, self._current[1])
        self.board.set_phase(self.rank, label)
        try:
            yield
        finally:
            with self._lock:
                self._seen.add(name)
                self._current = outer
                if top:
                    self._top = None
                if top:
                    self._owed = self._owed + own if waits_for else 0.0
            self.board.set_phase(self.rank, outer[0] if outer else "between phases")

    def overdue(self) -> Optional[str]:
        """The report if the current phase ran past its deadline, else None (the watchdog thread dies with it)."""
        with self._lock:
            cur = self._current
        if cur is None or time.monotonic() - cur[1] <= cur[2]:
            return None
        label, t0, limit = cur
        where = self.board.phases(self.world)
        table = "\n".join(f"  rank {r}: {p}" for r, p in sorted(where.items())) or "  (no phase board)"
        who = ("the ranks of that role are stuck or slower than the deadline; their own report names the phase"
               if label.startswith("waiting for ") else
               "a rank is stuck: crashed peer, blocked reward function or collective")
        return (f"phase '{label}' exceeded its deadline of {limit:.0f}s ({who}); phases of every rank:\n{table}\n"
                f"raise the deadline with --watchdog_timeout_s / --watchdog_slow_timeout_s if this phase is "
                f"legitimately slow")

    def current(self) -> Optional[tuple]:
        """(label, deadline in seconds) of the phase this rank is in, or None between phases."""
        with self._lock:
            return None if self._current is None else (self._current[0], self._current[2])

    def announce_stops(self, source, cut_phases=()) -> None:
        """Say at once (within a poll), on rank 0, when a stop signal arrives: where the rank is, when the checkpoint
        comes, and how long torchrun waits (``stop_notice``).  ``source.signal_name`` is set by the signal handler
        (rlhf.utils.preempt.StopSignal); ``cut_phases``: the phases the trainer cuts short on a stop."""
        self._stop_source, self._cut_phases = source, tuple(cut_phases)

    def announce(self) -> Optional[str]:
        """The stop notice, once, when a signal is pending (printed on rank 0; returned on every rank)."""
        name = getattr(self._stop_source, "signal_name", None) if self._stop_source is not None else None
        if not name or self._announced:
            return None
        self._announced = True
        with self._lock:
            top = self._top
        text = stop_notice(name, top[0] if top else None, time.monotonic() - top[1] if top else 0.0, self._cut_phases)
        if self.rank == 0:
            say(text)
        return text

    def _loop(self):
        while not self._stop.wait(self.poll_s):
            self.announce()
            if agent_gone(self._agent):  # re-parented: the agent is gone
                orphaned(self._agent)
            first = self.board.aborted()
            if first is not None:
                die(first)
            report = self.overdue()
            if report is not None:
                path = dump_flight_recorder(self.rank)
                die(report + (f"\nflight recorder of rank {self.rank}: {path} (read it with "
                              f"`python -m torch.distributed.flight_recorder.fr_trace`)" if path else ""))

    def stop(self):
        self._stop.set()
