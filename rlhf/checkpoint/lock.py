"""One run per --ckpt_path: an advisory ``flock`` on ``<ckpt_path>/.lock`` held for the life of the process, and
the removal of saves cut short, which only the lock holder may do.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import socket
import time
from typing import Dict, List, Tuple

from rlhf.checkpoint.errors import CheckpointError

LOCK_FILE = ".lock"


_HELD_LOCKS: Dict[str, object] = {}  # abs ckpt_path -> open lock file (held for the life of the process)


def remove_cut_short_saves(root: str) -> List[Tuple[str, int]]:
    """Remove the ``.tmp-global_step_*`` directories of saves cut short -- only while this process holds the
    folder's lock (without it, a ``.tmp-*`` may be another live run's save in progress; with it, every other
    run that could be writing one is gone).  Returns (name, bytes) of what was removed."""
    if os.path.abspath(root) not in _HELD_LOCKS or not os.path.isdir(root):
        return []
    removed = []
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if name.startswith(".tmp-global_step_") and os.path.isdir(d):
            size = sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(d) for f in fs
                       if os.path.isfile(os.path.join(b, f)))
            shutil.rmtree(d, ignore_errors=True)
            removed.append((name, size))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder_alive(text: str) -> bool:
    """Whether the lock file's holder (``host=.. pid=..``) is a live process on this host (other hosts: assumed)."""
    kv = dict(p.split("=", 1) for p in text.split() if "=" in p)
    if not kv.get("pid"):
        return False
    return kv.get("host") != socket.gethostname() or _pid_alive(int(kv["pid"]))


def acquire_lock(root: str) -> List[str]:
    """Hold --ckpt_path for this process: an advisory ``flock`` on ``root/.lock``, whose text names the holder
    (host, pid, SLURM job id).  Another live run holding it raises CheckpointError naming it; a lock left by a
    dead process (the flock is released when a process dies) is taken over with a notice.  Idempotent."""
    root = os.path.abspath(root)
    if root in _HELD_LOCKS:
        return []
    os.makedirs(root, exist_ok=True)
    fh = open(os.path.join(root, LOCK_FILE), "a+")
    fh.seek(0)
    prev = fh.read().strip()
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        busy = False
    except BlockingIOError:
        busy = True
    except OSError:  # a file system without flock: judge by the holder's pid when it is on this host
        busy = _holder_alive(prev)
    if busy:
        fh.close()
        raise CheckpointError(f"--ckpt_path {root} is in use by another run ({prev or 'holder unknown'}): two runs "
                              f"on one folder overwrite each other's checkpoints. Give this run its own --ckpt_path, "
                              f"or wait for that run to end") from None
    notices = []
    if prev:
        notices.append(f"[ckpt] taking over the stale lock of {root} ({prev}): that process is gone")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID", ""),
          "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    fh.seek(0)
    fh.truncate()
    fh.write(" ".join(f"{k}={v}" for k, v in me.items()))
    fh.flush()
    _HELD_LOCKS[root] = fh
    atexit.register(release_lock, root)
    # the lock proves every earlier run on this folder dead: their cut-short saves go now, before this run's
    # first save needs the space (a disk filled by a save that failed stays full otherwise)
    removed = remove_cut_short_saves(root)
    if removed:
        notices.append(f"[ckpt] removed {len(removed)} save(s) cut short by an earlier run in {root} "
                       f"({', '.join(n for n, _ in removed)}; {sum(b for _, b in removed) / 2 ** 20:.1f} MiB freed)")
    return notices


def release_lock(root: str) -> None:
    """Drop this process's lock on ``root`` (the file is emptied, so the next run sees no stale holder)."""
    fh = _HELD_LOCKS.pop(os.path.abspath(root), None)
    if fh is not None:
        fh.seek(0)
        fh.truncate()
        fh.flush()
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        fh.close()
