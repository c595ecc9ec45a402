"""Ending the whole job: the job-wide abort board in the rendezvous store, and ``die``, which ends this rank now.

The first rank to fail claims the abort key and prints its traceback (rank-prefixed); a rank that fails or is
told of the abort later prints one line.  Ending a rank also ends the processes it started (vLLM's engine core,
reward sandboxes), found through /proc: no optional package needed.

The store is the one ``init_process_group`` rendezvoused on (under torchrun: the agent's store, which outlives any
worker).  Store calls from the watchdog thread use their own client connection.  ``rlhf.distributed.failfast``
(``guarded``) and ``rlhf.distributed.watchdog`` (``Watchdog``) end the job through here.
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from typing import Dict, List, Optional

from rlhf.console import process_rank as _rank

ABORT_KEY = "rlhf/abort"
PHASE_KEY = "rlhf/phase/{}"
EXIT_FAILED = 1


def world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def say(msg: str) -> None:
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

        if world_size() == 1 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return cls(None)
        try:
            tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                                use_libuv=True)
            run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return cls(dist.PrefixStore(f"rlhf/{run}/{restart}/", tcp))
        except Exception as e:  # no store: still fail fast through torchrun / gloo, just without the board
            say(f"[rank {_rank()}] [failfast] no connection to the rendezvous store ({e}); abort board off")
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
        say(_prefixed(exc_text or reason, rank))
        say(f"[rank {rank}] ended the job: {reason}")
    else:
        say(f"[rank {rank}] stopping: the job was aborted by {first.splitlines()[0][:300]}")
    try:
        sys.stdout.flush()
        kill_children()
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


def kill_children() -> None:
    """Processes this rank started (vLLM's engine core on rollout ranks of their own, reward sandboxes) would
    outlive os._exit: end them first."""
    try:
        kill_descendants()
    except Exception:  # exiting anyway
        pass

