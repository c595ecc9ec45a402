"""Messages said once per job: the one rank-0 check and print (a bottom layer: data/ and config/ use it before any
process group exists, the trainers after).

The rank is torch.distributed's global rank once a process group exists, else torchrun's ``RANK`` (0 outside
torchrun); under torchrun the two agree, so a message is said by the same process before and after
``init_process_group``.  As OpenRLHF's ``strategy.print`` (openrlhf/utils/deepspeed/deepspeed.py: ``if
self.is_rank_0(): print(*msg)``), callable before the strategy exists.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, TextIO


def process_rank() -> int:
    """This process's global rank: the process group's once one exists, else ``RANK`` (0 outside torchrun)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_rank0() -> bool:
    return process_rank() == 0


def print0(msg: str, file: Optional[TextIO] = None) -> None:
    """Print ``msg`` (flushed) on global rank 0 only; ``file`` defaults to stdout (read at call time)."""
    if is_rank0():
        print(msg, file=file if file is not None else sys.stdout, flush=True)
