"""The one interface trainers use for a trainable (or frozen) model, whatever the backend."""
from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

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
    adam_offload: bool = False     # optimizer state (fsdp2: also sharded params and grads) in host memory all along
    dynamic_batch: bool = False    # token-budget micro-batches: their count varies from step to step
    accum_no_sync: bool = False    # fsdp2: reduce-scatter gradients on the last micro-batch only (full grads kept)


def spec_from_config(model, optim, topology, lr: float, total_steps: int, trainable: bool = True,
                     group_size: int = 1) -> EngineSpec:
    """The engine spec of one model from the three flag groups it reads (every trainer builds its engines' specs
    here): ``model`` (--bf16), ``optim`` (batch sizes, clipping, AdamW, schedule, --use_dynamic_batch) and
    ``topology`` (--zero_stage, --adam_offload, --grad_accum_no_sync, --ring_attn_size), the ``ModelConfig`` /
    ``OptimConfig`` / ``TopologyConfig`` of rlhf.config.schema.  A frozen model (trainable=False) runs inference
    micro-batches only: its batch is one micro-batch per rank."""
    m, o, t = model, optim, topology
    spec = EngineSpec(lr=lr if trainable else 0.0, train_batch_size=o.train_batch_size,
                      micro_batch_size=o.micro_train_batch_size, total_steps=max(1, total_steps), trainable=trainable,
                      bf16=m.bf16, zero_stage=t.zero_stage, max_norm=o.max_norm, weight_decay=o.weight_decay,
                      betas=o.adam_betas, warmup_ratio=o.lr_warmup_ratio, scheduler=o.lr_scheduler,
                      accum_no_sync=t.grad_accum_no_sync,
                      adam_offload=t.adam_offload and trainable, dynamic_batch=o.use_dynamic_batch and trainable)
    if not trainable:
        spec.train_batch_size = spec.micro_batch_size * group_size
    else:  # --ring_attn_size N: the N ranks of a sequence-parallel group run the same micro-batches, so the engine
        spec.train_batch_size *= max(1, t.ring_attn_size)  # (over all ranks) sees N x the batch per step
    return spec


def loads_on_first(backend: str, group) -> bool:
    """FSDP2 over more than one rank: only the group's first rank reads the weights (host memory); the others
    build the model on the meta device, and every rank receives its shards by broadcast (FSDP2Engine).  The
    checkpoint is read once per role group, and no rank holds the whole model on its device."""
    from rlhf.distributed import comm

    return backend == "fsdp2" and comm.world_size(group) > 1


def reads_weights(backend: str, group) -> bool:
    """Whether this rank loads real weights (False: it builds the model on the meta device)."""
    from rlhf.distributed import comm

    return not loads_on_first(backend, group) or comm.rank() == comm.global_rank(group, 0)


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


def is_last(micro_step: int, accum_steps: int, last: Optional[bool]) -> bool:
    """The optimizer step's last micro-batch: ``last`` when the caller says, else the fixed-size rule."""
    return bool(last) if last is not None else (micro_step + 1) % accum_steps == 0


def make_optimizer(model: torch.nn.Module, spec: EngineSpec, fused: bool = False):
    """AdamW over the trainable parameters and its warmup + decay schedule (LambdaLR over ``lr_lambda``)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.lr, betas=tuple(spec.betas),
                            weight_decay=spec.weight_decay, fused=fused or None)
    warm = int(spec.warmup_ratio * spec.total_steps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec.scheduler, spec.total_steps, warm))


class TrainEngine(abc.ABC):
    """model, micro-batch backward with accumulation, step, checkpoint, full weights, sleep/wake.

    An abstract base: a backend that leaves a method out fails when it is built, not later with a silent None."""

    model: torch.nn.Module
    accum_steps: int
    mesh: Any  # the role's rlhf.distributed.mesh.RoleMesh: its process group, its SP group

    @property
    def compute_device(self) -> torch.device:
        """Where a forward's inputs, labels, masks and loss terms go: the device the engine computes and runs its
        collectives on (``cuda:<local>`` on GPU jobs), never read from the parameters.  Under --adam_offload FSDP2's
        ``CPUOffloadPolicy`` keeps the sharded parameters in host memory and copies each unit to this device for its
        all-gather (torch/distributed/fsdp/_fully_shard/_fsdp_api.py ``CPUOffloadPolicy``), so
        ``next(model.parameters()).device`` is the CPU there while the forward runs on the GPU.  An engine's
        ``device`` attribute when it has one, else the collective device (``comm.device()``)."""
        dev = getattr(self, "device", None)
        if dev is not None:
            return torch.device(dev)
        from rlhf.distributed import comm

        return comm.device()

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, micro_step: int, last: Optional[bool] = None) -> None:
        """Accumulate the gradient of one micro-batch's loss (already scaled by the caller's normalisation).
        ``last``: whether this is the optimizer step's last micro-batch; None means every step has ``accum_steps``
        micro-batches (fixed size), so the last is ``micro_step + 1 == accum_steps``.  Token-budget micro-batches
        (--use_dynamic_batch) vary in number from step to step and pass it.  The engine divides the loss by
        ``accum_steps`` whatever the count (the caller's scale undoes it)."""

    @abc.abstractmethod
    def step(self) -> Dict[str, float]:
        """Clip, step the optimizer and the schedule, zero the gradients; returns grad_norm and lr."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Collective over the engine's group: model and optimizer shards, scheduler."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Collective: the inverse of save_checkpoint."""

    @abc.abstractmethod
    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """Collective: the full weights on the group's first rank (None elsewhere)."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release device memory (offload parameters / optimizer state) until wake."""

    @abc.abstractmethod
    def wake(self, tags=None) -> None:
        """Bring back what sleep released, as far as a forward needs it: an engine may leave its optimizer state on
        the host until ``step`` (FSDP2 does)."""

    _offloaded: bool = False  # True from sleep to wake (on CPU too, where nothing moves)

    def memory_state(self) -> str:
        """``full`` | ``asleep``, what the phase scheduler asks (rlhf.distributed.phases): a train engine has no
        partial state (its optimizer state coming back in ``step`` is not one a phase asks for)."""
        return "asleep" if self._offloaded else "full"
