"""The checkpoint errors every part raises (rlhf/checkpoint/)."""
from __future__ import annotations

from rlhf.errors import CheckpointError

__all__ = ["CheckpointError"]
