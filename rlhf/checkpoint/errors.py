"""The checkpoint errors every part raises (rlhf/checkpoint/)."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (damaged, or saved by a different run); the message names it and a fix."""
