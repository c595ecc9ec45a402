"""A memory plan's records: ``RoleModel`` (one role's dimensions and ranks), ``Stage`` (bytes per part at one
stage's peak), ``GroupPlan`` (a rank group's stages) and ``MemoryPlan`` (the groups, the device, its table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from rlhf.planning.dims import ModelDims
from rlhf.planning.job import Job
from rlhf.planning.terms import GiB


@dataclass
class RoleModel:
    """What the plan needs of one role: its dimensions, its parameter count and the ranks its group spans."""
    dims: ModelDims
    ranks: int                  # the role's group size (FSDP / ZeRO shard over it)
    trainable: bool
    lm: bool                    # has an LM head (actor, ref) vs a scalar head (critic, reward)
    adapters: int = 0           # --lora_rank: trainable adapter weights over a frozen base (terms.lora_adapter_params)

    @property
    def n(self) -> int:
        return self.dims.params if self.lm else self.dims.value_params


@dataclass
class Stage:
    name: str
    parts: Dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class GroupPlan:
    ranks: List[int]
    roles: List[str]
    stages: List[Stage]
    host: float                 # host bytes per rank (sleep / offload)
    load_host: float = 0.0      # host bytes of the rank in this group that reads a checkpoint whole (FSDP2 load)


@dataclass
class MemoryPlan:
    job: Job
    device_bytes: float
    groups: List[GroupPlan]
    ranks_per_node: int = 8
    dims: Optional[ModelDims] = None      # the actor's (the rollout engine's model)

    def overflows(self) -> List[Tuple[GroupPlan, Stage, float]]:
        """(group, stage, bytes over) for every stage whose peak exceeds the device."""
        return [(g, s, s.total - self.device_bytes) for g in self.groups for s in g.stages
                if s.total > self.device_bytes]

    @property
    def fits(self) -> bool:
        return not self.overflows()

    def worst(self) -> Tuple[GroupPlan, Stage]:
        return max(((g, s) for g in self.groups for s in g.stages), key=lambda gs: gs[1].total)

    def table(self) -> str:
        cols = ["params", "grads", "optimizer", "gathered", "activations", "logits", "kv/vllm", "other"]
        out = [f"device memory {self.device_bytes / GiB:.1f} GiB per rank; GiB per rank at each stage's peak"]
        for g in self.groups:
            out.append(f"ranks {_ranges(g.ranks)} ({', '.join(g.roles)}); host (sleep/offload) "
                       f"{g.host / GiB:.1f} GiB per rank, {g.host * min(len(g.ranks), self.ranks_per_node) / GiB:.0f} "
                       f"GiB per node" + (f"; at load {g.load_host / GiB:.1f} GiB on the host of the rank that "
                                          f"reads the checkpoint" if g.load_host else ""))
            out.append(f"  {'stage':<14}" + "".join(f"{c:>12}" for c in cols) + f"{'peak':>10}  fits")
            for s in g.stages:
                row = _columns(s.parts)
                ok = "yes" if s.total <= self.device_bytes else f"NO, {(s.total - self.device_bytes) / GiB:.1f} over"
                out.append(f"  {s.name:<14}" + "".join(f"{row[c] / GiB:>12.2f}" for c in cols)
                           + f"{s.total / GiB:>10.2f}  {ok}")
        return "\n".join(out)


_COLUMN = {"params": "params", "grads": "grads", "optimizer": "optimizer", "gathered": "gathered",
           "activations": "activations", "logits": "logits", "kv": "kv/vllm", "vllm": "kv/vllm"}


def _columns(parts: Dict[str, float]) -> Dict[str, float]:
    row = {c: 0.0 for c in ("params", "grads", "optimizer", "gathered", "activations", "logits", "kv/vllm", "other")}
    for k, v in parts.items():
        row[_COLUMN.get(k.split(":")[-1], "other")] += v
    return row


def _ranges(ranks: List[int]) -> str:
    from rlhf.distributed.placement import _ranges as r

    return r(ranks)
