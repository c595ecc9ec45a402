"""Fail fast, loudly: an error on any rank ends the whole job promptly, with that rank's traceback printed once.

Three pieces, all per process:

* ``guarded(main)`` runs a rank's program.  On an exception it prints the
  traceback (rank-prefixed) unless another rank already failed first, marks the
  job aborted in the rendezvous store, and leaves with ``os._exit`` - no cleanup
  path runs a collective (a barrier in a ``finally`` would wait for the ranks
  that are still computing and hide the error).
* ``Watchdog``, a daemon thread, polls the store's abort key (so a rank blocked
  in a collective, or computing without any collective, ends within a second or
  two of another rank's failure, also on NCCL where a dead peer is not noticed)
  and enforces a deadline per phase: a rank stuck in a phase longer than its
  deadline prints every rank's current phase and ends the job.
* Each phase is entered with ``watchdog.phase(name)``; its name and start time
  go to the store, so the report says where every rank was.
* Under torchrun the watchdog also watches the agent that started the rank: if it is
  gone (``kill -9`` of torchrun, a node agent that died), the rank is an orphan that
  would go on training, checkpointing and exporting unsupervised, logging store
  errors; it stops at once with one line (``orphaned``).

Ending a rank also ends the processes it started (vLLM's engine core, reward
sandboxes), found through /proc: no optional package needed.

The store is the one ``init_process_group`` rendezvoused on (under torchrun: the
agent's store, which outlives any worker).  Store calls from the watchdog thread
use their own client connection.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

import click

from rlhf.console import process_rank as _rank
from rlhf.errors import Refusal

ABORT_KEY = "rlhf/abort"
PHASE_KEY = "rlhf/phase/{}"
EXIT_FAILED = 1
EXIT_PREEMPTED = 75  # a stop request checkpointed an incomplete run (rlhf.config.cli.EXIT_PREEMPTED)


def _world() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _say(msg: str) -> None:
    sys.stderr.write(msg if msg.endswith("\n") else msg + "\n")
    sys.stderr.flush()


def _prefixed(text: str, rank: int) -> str:
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))


class AbortBoard:
    """The job-wide abort flag and per-rank phase board, in a c10d store of its own connection.

    Every method swallows store errors: the store may be gone (its host died), and
    reporting must never raise over the error being reported.
    """

    def __init__(self, store=None):
        self.store = store

    @classmethod
    def connect(cls, timeout_s: float = 10.0) -> AbortBoard:
        """A fresh client of the rendezvous store (MASTER_ADDR/PORT, or torchrun's agent store)."""
        import torch.distributed as dist

        if _world() == 1 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return cls(None)
        try:
            tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                                use_libuv=True)
            run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return cls(dist.PrefixStore(f"rlhf/{run}/{restart}/", tcp))
        except Exception as e:  # no store: still fail fast through torchrun / gloo, just without the board
            _say(f"[rank {_rank()}] [failfast] no connection to the rendezvous store ({e}); abort board off")
            return cls(None)

    def claim_abort(self, rank: int, message: str) -> Optional[str]:
        """Mark the job aborted.  Returns None if this rank is the first, else the first failure's message."""
        if self.store is None:
            return None
        try:
            n = self.store.add(ABORT_KEY + "/count", 1)
            if n == 1:
                self.store.set(ABORT_KEY, f"rank {rank}: {message}")
                return None
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                if self.store.check([ABORT_KEY]):
                    return self.store.get(ABORT_KEY).decode(errors="replace")
                time.sleep(0.05)
            return "another rank"
        except Exception:
            return None

    def aborted(self) -> Optional[str]:
        if self.store is None:
            return None
        try:
            if self.store.check([ABORT_KEY]):
                return self.store.get(ABORT_KEY).decode(errors="replace")
        except Exception:
            return None
        return None

    def set_phase(self, rank: int, name: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(PHASE_KEY.format(rank), f"{name}@{time.time():.1f}")
        except Exception:
            pass

    def phases(self, world: int) -> Dict[int, str]:
        out = {}
        if self.store is None:
            return out
        now = time.time()
        for r in range(world):
            try:
                if self.store.check([PHASE_KEY.format(r)]):
                    name, _, t0 = self.store.get(PHASE_KEY.format(r)).decode().rpartition("@")
                    out[r] = f"{name} for {now - float(t0):.0f}s"
                else:
                    out[r] = "not started"
            except Exception:
                out[r] = "unknown"
        return out


_BOARD: Dict[str, AbortBoard] = {}


def board() -> AbortBoard:
    """This process's abort board (connected on first use)."""
    if "b" not in _BOARD:
        _BOARD["b"] = AbortBoard.connect()
    return _BOARD["b"]


def die(reason: str, exc_text: Optional[str] = None, code: int = EXIT_FAILED) -> None:
    """End this process now.  The first rank to fail prints its traceback; later ones print one line."""
    rank = _rank()
    first = board().claim_abort(rank, reason)
    if first is None:
        _say(_prefixed(exc_text or reason, rank))
        _say(f"[rank {rank}] ended the job: {reason}")
    else:
        _say(f"[rank {rank}] stopping: the job was aborted by {first.splitlines()[0][:300]}")
    try:
        sys.stdout.flush()
        _kill_children()
    finally:
        os._exit(code)


def descendants(pid: Optional[int] = None) -> List[int]:
    """Every process below ``pid`` (default: this one), children before grandchildren, read from /proc (Linux;
    ``psutil`` is not a dependency).  [] where /proc cannot be read."""
    pid = os.getpid() if pid is None else pid
    children: Dict[int, List[int]] = {}
    try:
        entries = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    for d in entries:
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
        except OSError:  # exited meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # "pid (comm) state ppid ..."; comm may hold spaces
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def kill_descendants(pid: Optional[int] = None) -> int:
    """SIGKILL every process below ``pid`` (default: this one); returns how many were signalled."""
    n = 0
    for child in reversed(descendants(pid)):
        try:
            os.kill(child, signal.SIGKILL)
            n += 1
        except OSError:
            pass
    return n


def _kill_children() -> None:
    """Processes this rank started (vLLM's engine core on rollout ranks of their own, reward sandboxes) would
    outlive os._exit: end them first."""
    try:
        kill_descendants()
    except Exception:  # exiting anyway
        pass


# The parent when this module was first imported, early in a rank's life: a slow start-up (imports, data, model
# checks) can outlive a killed agent, and a parent read only later would already be the re-parenting init.
_PARENT_AT_IMPORT = os.getppid()
LAUNCHER_MARKERS = ("torch", "accelerate")  # a launcher that is itself PID 1 (a container's entry point)


def launcher_pid() -> Optional[int]:
    """The torchrun agent that started this rank (its parent, read at import), or None outside torchrun."""
    return _PARENT_AT_IMPORT if "TORCHELASTIC_RUN_ID" in os.environ else None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def agent_gone(agent: Optional[int]) -> bool:
    """True when ``agent`` (``launcher_pid()``) no longer is this rank's parent: the rank was re-parented (to init
    or a subreaper).  A parent that is PID 1 already at import counts as gone unless PID 1 is a launcher itself
    (torchrun as a container's entry point)."""
    if agent is None:
        return False
    ppid = os.getppid()
    if ppid != agent:
        return True
    return ppid == 1 and not any(m in _cmdline(1) for m in LAUNCHER_MARKERS)


def check_agent() -> None:
    """Stop now, with the one ``orphaned`` line, if torchrun's agent is already gone (called before
    ``init_process_group``, which would otherwise wait for the dead agent's store)."""
    agent = launcher_pid()
    if agent_gone(agent):
        orphaned(agent)


class OrphanWatch:
    """A daemon thread that stops this rank once its torchrun agent is gone; started by ``guarded`` before the
    rank's program, so it also covers start-up: data loading, model checks and ``init_process_group`` (the
    store connection releases the GIL while it retries)."""

    def __init__(self, poll_s: float = 0.5):
        self.agent = launcher_pid()
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlhf-orphan-watch", daemon=True)
        if self.agent is not None:
            self._thread.start()

    def _loop(self):
        while not self._stop.wait(self.poll_s):
            if agent_gone(self.agent):
                orphaned(self.agent)

    def stop(self):
        self._stop.set()


def orphaned(agent_pid: int) -> None:
    """The agent is gone: stop this rank now, with one line (no store: it lived in the agent)."""
    which = f" (pid {agent_pid})" if agent_pid not in (None, 1) else ""  # 1: it was gone before we looked
    _say(f"[rank {_rank()}] stopping: the torchrun agent{which} that started this rank is gone (killed, or its node "
         f"lost); no rank goes on unsupervised. Resume from the last checkpoint with --load_checkpoint")
    try:
        sys.stdout.flush()
        _kill_children()
    finally:
        os._exit(EXIT_FAILED)


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")

def is_input_error(e: BaseException) -> bool:
    """A refusal: bad input whose message already says what to change (checked before any process group exists),
    or a reward function's failure that already carries the user code's traceback; our traceback would only bury
    it.  ``rlhf.errors.Refusal`` and click's usage errors (``ConfigUsageError``)."""
    return isinstance(e, (Refusal, click.UsageError))


EXIT_INPUT = 2  # bad input refused before any process group (click's usage-error code)


def refusal_code() -> int:
    """Exit code of a refusal: 2 before any process group exists (bad input, nothing started), else 1."""
    import torch.distributed as dist

    return EXIT_FAILED if dist.is_available() and dist.is_initialized() else EXIT_INPUT


# Causes that a wrapper's first line tends to hide (torch.save's "file write failed", DCP's CheckpointException):
# found anywhere in the exception's chain, they lead the one-line summary.
FILESYSTEM_CAUSES = {"No space left on device": "free space, or point --ckpt_path / --save_path at a larger disk",
                     "Disk quota exceeded": "free quota, or point --ckpt_path / --save_path elsewhere",
                     "Read-only file system": "point --ckpt_path / --save_path at a writable folder"}


def chain_text(e: BaseException) -> str:
    """The messages of ``e``, its causes and contexts, and of the per-rank failures a DCP CheckpointException
    carries (``failures``: rank -> (exception, traceback))."""
    out, seen, todo = [], set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(str(x))
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x.__cause__, x.__context__]
    return "\n".join(out)


def describe(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    if any(p in text for p in PEER_LOST):
        return (f"lost a peer rank during a collective ({first[:200]}): that rank died without a traceback (killed, "
                f"out of memory, segfault); torchrun's summary below gives its rank and exit code")
    full = chain_text(e)
    for cause, fix in FILESYSTEM_CAUSES.items():
        if cause in full:
            return f"{cause}: {fix} ({type(e).__name__}: {first[:200]})"[:500]
    return f"{type(e).__name__}: {first}"[:500]


def guarded(main: Callable[[], object]):
    """Run a rank's program; any exception ends the whole job (see module docstring).  A job of one process has
    no peer to release: the exception propagates as usual (tests and notebooks see it; the CLI,
    ``rlhf.config.cli.main_entry``, prints a refusal as one line and exits 2 as here).

    Under torchrun the orphan check starts first, before the program's start-up (see ``OrphanWatch``)."""
    check_agent()
    watch = OrphanWatch()
    try:
        return _guarded(main)
    finally:
        watch.stop()


def _guarded(main: Callable[[], object]):
    if _world() == 1:
        return main()
    try:
        return main()
    except SystemExit as e:
        if e.code in (0, None, EXIT_PREEMPTED):
            raise
        die(f"exited with {e.code}", traceback.format_exc())
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: never run cleanup collectives
        if is_input_error(e):
            die(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500], f"error: {e}",
                code=refusal_code())
        if any(p in str(e) for p in PEER_LOST):  # not this rank's fault: its traceback would mislead
            die(describe(e), f"{describe(e)} (in {type(e).__name__})")
        die(describe(e), traceback.format_exc())


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
        self.rank, self.world = _rank(), _world()
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
            _say(text)
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
