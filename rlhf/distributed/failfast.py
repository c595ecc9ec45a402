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

The store is the one ``init_process_group`` rendezvoused on (under torchrun: the
agent's store, which outlives any worker).  Store calls from the watchdog thread
use their own client connection.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import traceback
from typing import Callable, Dict, Optional

ABORT_KEY = "rlhf/abort"
PHASE_KEY = "rlhf/phase/{}"
EXIT_FAILED = 1


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


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


def _kill_children() -> None:
    """Processes this rank started (vLLM's engine core on rollout ranks of their own, reward sandboxes) would
    outlive os._exit: end them first."""
    try:
        import psutil
    except ImportError:
        return
    try:
        for child in psutil.Process().children(recursive=True):
            child.kill()
    except Exception:
        pass


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")

# Errors whose message already says what to change (bad input, checked before any process group exists) or
# already carries the user code's traceback (a reward function that raised): our traceback would only bury it.
# Classes are matched by name so this module imports nothing of the rest of the library.
INPUT_ERRORS = ("ConfigError", "TopologyError", "InputError", "DataError", "RewardError", "UsageError")


def describe(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    if any(p in text for p in PEER_LOST):
        return (f"lost a peer rank during a collective ({first[:200]}): that rank died without a traceback (killed, "
                f"out of memory, segfault); torchrun's summary below gives its rank and exit code")
    return f"{type(e).__name__}: {first}"[:500]


def guarded(main: Callable[[], object]):
    """Run a rank's program; any exception ends the whole job (see module docstring).  A job of one process has
    no peer to release: the exception propagates as usual (tests and notebooks see it)."""
    if _world() == 1:
        return main()
    try:
        return main()
    except SystemExit as e:
        if e.code in (0, None):
            raise
        die(f"exited with {e.code}", traceback.format_exc())
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: never run cleanup collectives
        names = {c.__name__ for c in type(e).__mro__}
        if names & set(INPUT_ERRORS):
            import torch.distributed as dist

            started = dist.is_available() and dist.is_initialized()
            die(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500], f"error: {e}",
                code=EXIT_FAILED if started else 2)
        if any(p in str(e) for p in PEER_LOST):  # not this rank's fault: its traceback would mislead
            die(describe(e), f"{describe(e)} (in {type(e).__name__})")
        die(describe(e), traceback.format_exc())


class PhaseTimeout(RuntimeError):
    pass


class Watchdog:
    """Per-phase deadlines and the abort poll (a daemon thread; see module docstring).

    ``deadlines``: phase name -> seconds; ``default_s`` for the others; ``slow_s`` for
    the first time each phase runs (compilation, allocator warm-up, vLLM graphs).
    """

    def __init__(self, default_s: float = 600.0, deadlines: Optional[Dict[str, float]] = None,
                 slow_s: Optional[float] = None, poll_s: float = 1.0, board_: Optional[AbortBoard] = None):
        self.default_s = default_s
        self.deadlines = dict(deadlines or {})
        self.slow_s = slow_s or default_s
        self.poll_s = poll_s
        self.board = board_ or board()
        self.rank, self.world = _rank(), _world()
        self._seen = set()
        self._lock = threading.Lock()
        self._current: Optional[tuple] = None   # (name, start, deadline)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlhf-watchdog", daemon=True)
        self._thread.start()

    def deadline_of(self, name: str) -> float:
        d = self.deadlines.get(name, self.default_s)
        return max(d, self.slow_s) if name not in self._seen else d

    @contextlib.contextmanager
    def phase(self, name: str):
        with self._lock:
            outer = self._current
            self._current = (name, time.monotonic(), self.deadline_of(name))
        self.board.set_phase(self.rank, name)
        try:
            yield
        finally:
            with self._lock:
                self._seen.add(name)
                self._current = outer
            self.board.set_phase(self.rank, outer[0] if outer else "between phases")

    def _loop(self):
        while not self._stop.wait(self.poll_s):
            first = self.board.aborted()
            if first is not None:
                die(first)
            with self._lock:
                cur = self._current
            if cur is not None and time.monotonic() - cur[1] > cur[2]:
                name, t0, limit = cur
                where = self.board.phases(self.world)
                table = "\n".join(f"  rank {r}: {p}" for r, p in sorted(where.items())) or "  (no phase board)"
                die(f"phase '{name}' exceeded its deadline of {limit:.0f}s (a rank is stuck: crashed peer, "
                    f"blocked reward function or collective); phases of every rank:\n{table}\nraise the deadline "
                    f"with --watchdog_timeout_s / --watchdog_slow_timeout_s if this phase is legitimately slow")

    def stop(self):
        self._stop.set()
