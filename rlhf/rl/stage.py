"""The base of every RL stage (rlhf.rl.stages): what a stage declares (its role, share, tags, reads, writes, memory
kind, deadline) and ``run(batch, roles)``; the role, share, tags and memory kind come from the stage's row of
rlhf.stage_table, the one declaration the memory planner plans from."""
from __future__ import annotations

from typing import List, Optional, Tuple

from rlhf.batch import Batch
from rlhf.stage_table import RL_STAGE


class Stage:
    """A stage of the RL step (see the module docstring); subclasses set ``name``, the fields and ``run``; the
    declared ``role``, ``share``, ``tags`` and ``memory`` come from the stage's row of rlhf.stage_table (the one
    declaration the memory planner plans from), set when the class (or, for ``UpdateStage``, the object) names it."""
    name: str = ""
    role: Optional[str] = None        # the role the phase scheduler wakes (None: no model, or its own phase)
    share: Optional[str] = None       # the role that stays awake with it (same device)
    tags: Optional[List[str]] = None  # what of ``role`` wakes (None: everything)
    reads: Tuple[str, ...] = ()
    writes: Tuple[str, ...] = ()
    # the rollout ranks of their own skip it under --async_train (they generate meanwhile): its collectives run
    # over the model roles' ranks only (Groups.trainers); from the placement, so the same on every rank of a kind
    trainers_only: bool = False
    deadline_s: Optional[float] = None
    # how the memory planner plans it (rlhf.stage_table: "rollout", "forward", "update", "sync"; None: nothing)
    memory: Optional[str] = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "name" in vars(cls):
            cls._declare(cls, cls.name)

    @staticmethod
    def _declare(target, name: str) -> None:
        """``target`` (a Stage class or object) takes the declared fields of the stage ``name``."""
        row = RL_STAGE[name]
        target.name, target.role, target.share, target.memory = row.name, row.role, row.share, row.memory
        target.tags = list(row.tags) if row.tags is not None else None

    def run(self, batch: Batch, roles) -> None:
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}({self.name}, role={self.role})"
