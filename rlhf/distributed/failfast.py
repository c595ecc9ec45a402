"""Fail fast, loudly: an error on any rank ends the whole job promptly, with that rank's traceback printed once.

Per process:

* ``guarded(main)`` runs a rank's program.  On an exception it prints the
  traceback (rank-prefixed) unless another rank already failed first, marks the
  job aborted in the rendezvous store, and leaves with ``os._exit`` - no cleanup
  path runs a collective (a barrier in a ``finally`` would wait for the ranks
  that are still computing and hide the error).  The abort board and ``die``:
  ``rlhf.distributed.abort``.
* A refusal (bad input whose message says what to change) is one line and exit code 2 before any process group;
  a lost peer or a full disk is named in the one-line summary (``describe``).
* Under torchrun the rank also watches the agent that started it: if it is
  gone (``kill -9`` of torchrun, a node agent that died), the rank is an orphan that
  would go on training, checkpointing and exporting unsupervised, logging store
  errors; it stops at once with one line (``orphaned``).

The per-phase deadlines and the abort poll during the run: ``rlhf.distributed.watchdog.Watchdog``.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Callable, Optional

import click

from rlhf.console import process_rank as _rank
from rlhf.distributed.abort import EXIT_FAILED, die, kill_children, say, world_size
from rlhf.errors import Refusal

EXIT_PREEMPTED = 75  # a stop request checkpointed an incomplete run (rlhf.config.cli.EXIT_PREEMPTED)
EXIT_INPUT = 2  # bad input refused before any process group (click's usage-error code)

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
    say(f"[rank {_rank()}] stopping: the torchrun agent{which} that started this rank is gone (killed, or its node "
         f"lost); no rank goes on unsupervised. Resume from the last checkpoint with --load_checkpoint")
    try:
        sys.stdout.flush()
        kill_children()
    finally:
        os._exit(EXIT_FAILED)


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def is_input_error(e: BaseException) -> bool:
    """A refusal: bad input whose message already says what to change (checked before any process group exists),
    or a reward function's failure that already carries the user code's traceback; our traceback would only bury
    it.  ``rlhf.errors.Refusal`` and click's usage errors (``ConfigUsageError``)."""
    return isinstance(e, (Refusal, click.UsageError))


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
    if world_size() == 1:
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

