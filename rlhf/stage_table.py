"""The stages of a step as plain data, declared once: read by the RL loop's stage classes (rlhf.rl.stages: each
class takes its role, share, tags and memory kind from its row here) and by the memory planner
(rlhf.planning.memory ``group_stages``, which plans the rows with a memory kind, in this order).  No imports: the
planner sits below rl/ and reads this without running up a layer.

A row: ``name`` (the stage's name: the watchdog's phase and the plan's column), ``role`` (what the phase scheduler
wakes), ``share`` (the role that stays awake with it), ``tags`` (what of ``role`` wakes; None: everything) and
``memory``, how the planner plans its peak:

    "rollout"       the rollout engine generates (its share or the HF engine's copy, KV cache, logits)
    "forward"       a no-grad forward of ``role`` over the rollout's micro-batches
    "pair_forward"  DPO's reference forward over the chosen + rejected rows of a training micro-batch
    "update"        ``role``'s optimizer steps (forward + backward + optimizer state)
    "sync"          the actor -> rollout engine weight transfer (buckets, the gather's transient)
    None            no model memory of its own (scoring by a function, the advantage assembly, queue steps)

The planner also plans "shard" and "load" (start-up, not steps of the loop).  torchtitan's RL controller declares
its loop the same way, one place saying what each phase holds (torchtitan/experiments/rl/controller.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class StageRow:
    name: str
    role: Optional[str] = None
    share: Optional[str] = None
    tags: Optional[Tuple[str, ...]] = None
    memory: Optional[str] = None


RL_STAGES: Tuple[StageRow, ...] = (
    StageRow("rollout", "rollout", memory="rollout"),
    StageRow("reward", "reward", memory="forward"),  # a reward model's forward (a reward function holds no memory)
    StageRow("rollout_refill"),                      # opens its own phases per round (rollout, reward)
    StageRow("produce"),
    StageRow("ref", "ref", memory="forward"),
    StageRow("values", "critic", memory="forward"),
    # the actor's no-grad forward (skipped for a single on-policy update, but then still run on the first step and
    # every --logprob_gap_interval steps to log the rollout gap): planned always
    StageRow("old_logprobs", "actor", memory="forward"),
    StageRow("logprob_gap"),                         # opens its own phase when due (the actor's forward)
    StageRow("advantages"),
    StageRow("critic_update", "critic", memory="update"),
    StageRow("actor_update", "actor", memory="update"),
    StageRow("reward_ahead"),
    StageRow("weight_sync", "rollout", share="actor", tags=("weights",), memory="sync"),
)

# the supervised loop (SFT / RM / DPO: rlhf.supervised.trainer) as the planner sees it: DPO's reference, the update
SUPERVISED_STAGES: Tuple[StageRow, ...] = (
    StageRow("ref", "ref", memory="pair_forward"),
    StageRow("train", "actor", memory="update"),
)

RL_STAGE: Dict[str, StageRow] = {s.name: s for s in RL_STAGES}


def awake(row: StageRow) -> Tuple[str, ...]:
    """The roles a stage keeps awake: its role and the one it shares with."""
    return tuple(r for r in (row.role, row.share) if r is not None)


def with_declared_forwards(rows: Tuple[StageRow, ...], roles) -> Tuple[StageRow, ...]:
    """``rows`` with a forward row for each role of ``roles`` (the role table's roles that declare a log-prob
    forward, rlhf.distributed.role_table ``RoleDecl.forward``; the stage is named for its role) after the
    reference's, where the RL loop runs them (rlhf.rl.stages ``declared_forwards``)."""
    out = []
    for row in rows:
        out.append(row)
        if row.name == "ref":
            out += [StageRow(r, r, memory="forward") for r in roles]
    return tuple(out)
