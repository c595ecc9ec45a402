"""The one interface trainers use for a trainable (or frozen) model, whatever the backend."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch


@dataclass
class EngineSpec:
    """What a backend needs to know, derived from the config by the trainer."""
    lr: float
    train_batch_size: int          # global samples per optimizer step
    micro_batch_size: int          # per-rank samples per forward/backward
    total_steps: int               # optimizer steps in the schedule
    trainable: bool = True
    bf16: bool = False
    zero_stage: int = 3
    max_norm: float = 1.0
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)
    warmup_ratio: float = 0.03
    scheduler: str = "cosine_with_min_lr"
    offload: bool = False          # sleep/wake offloads training state


def lr_lambda(kind: str, total: int, warmup: int, min_ratio: float = 0.1):
    """Linear warmup, then constant / linear / cosine (to 0 or to min_ratio)."""
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cos if kind == "cosine" else min_ratio + (1 - min_ratio) * cos
    return f


def make_optimizer(model: torch.nn.Module, spec: EngineSpec, fused: bool = False):
    """AdamW over the trainable parameters and its warmup + decay schedule (LambdaLR over ``lr_lambda``)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.lr, betas=tuple(spec.betas),
                            weight_decay=spec.weight_decay, fused=fused or None)
    warm = int(spec.warmup_ratio * spec.total_steps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec.scheduler, spec.total_steps, warm))


class TrainEngine:
    """model, micro-batch backward with accumulation, step, checkpoint, full weights, sleep/wake."""

    model: torch.nn.Module
    accum_steps: int

    def backward(self, loss: torch.Tensor, micro_step: int) -> None: ...

    def step(self) -> Dict[str, float]: ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]: ...

    def sleep(self) -> None: ...

    def wake(self, tags=None) -> None: ...


def make_engine(backend: str, model: torch.nn.Module, spec: EngineSpec, group=None, device=None,
                broadcast_from_rank0: bool = False) -> TrainEngine:
    if backend == "fsdp2":
        from .fsdp2 import FSDP2Engine

        return FSDP2Engine(model, spec, group=group, device=device, broadcast_from_rank0=broadcast_from_rank0)
    if backend == "deepspeed":
        from .deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(model, spec, group=group, device=device)
    raise ValueError(f"unknown --backend {backend!r}; choose fsdp2 or deepspeed")
