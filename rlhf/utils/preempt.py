"""Preemption: the sbatch trap (or anyone) touches $RLHF_STOP_FILE; the trainers checkpoint and exit cleanly.

A file works through every layer (sbatch -> srun -> torchrun -> ranks), where a
signal would have to survive torchrun's own handlers.  Also reacts to SIGUSR1
delivered to a rank directly.
"""
from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

_flag = {"signal": False}


def install_signal_handler() -> None:
    def handler(signum, frame):
        _flag["signal"] = True

    try:
        signal.signal(signal.SIGUSR1, handler)
    except ValueError:  # not the main thread
        pass


def stop_requested() -> bool:
    """Collective: True on every rank if any rank saw the stop file or a SIGUSR1."""
    path = os.environ.get("RLHF_STOP_FILE")
    local = _flag["signal"] or bool(path and os.path.exists(path))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    t = torch.tensor([int(local)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
