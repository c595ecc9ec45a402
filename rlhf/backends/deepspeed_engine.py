"""DeepSpeed ZeRO engine (``--backend deepspeed``), config generated from the same flags.

Needs the [deepspeed] extra.  ``--deepspeed_enable_sleep`` uses DeepSpeed's
offload_states / reload_states (ZeRO-3).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from .base import EngineSpec, TrainEngine, make_optimizer


def deepspeed_config(spec: EngineSpec, dp: int, offload_optimizer: bool = False) -> dict:
    """The ds_config dict for a ZeRO stage, batch sizes and precision."""
    accum = spec.train_batch_size // (spec.micro_batch_size * dp)
    zero = {"stage": spec.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 5e8, "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e8,
            "stage3_gather_16bit_weights_on_model_save": True}
    if spec.zero_stage < 3:
        for k in [k for k in zero if k.startswith("stage3")]:
            del zero[k]
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": spec.train_batch_size,
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": spec.max_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(spec.bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine(TrainEngine):
    def __init__(self, model: torch.nn.Module, spec: EngineSpec, group=None, device=None):
        try:
            import deepspeed
        except ImportError as e:
            raise RuntimeError("--backend deepspeed needs DeepSpeed: pip install 'rlhf[deepspeed]'") from e
        self.spec = spec
        self.group = group if group is not None else dist.group.WORLD
        dp = dist.get_world_size(self.group)
        self.accum_steps = spec.train_batch_size // (spec.micro_batch_size * dp)
        cfg = deepspeed_config(spec, dp)
        if spec.trainable:
            opt, sched = make_optimizer(model, spec)
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
        else:
            cfg.pop("gradient_clipping")
            self.ds = deepspeed.init_inference(model) if spec.zero_stage < 3 else deepspeed.initialize(
                model=model, config=cfg)[0]
            self.optimizer = self.scheduler = None
        self.model = self.ds.module if hasattr(self.ds, "module") else self.ds

    def backward(self, loss, micro_step: int) -> None:
        """DeepSpeed scales by 1/accum itself and wants step() after every micro batch."""
        self.ds.backward(loss)
        if (micro_step + 1) % self.accum_steps:
            self.ds.step()

    def step(self) -> Dict[str, float]:
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else 0.0, "lr": self.scheduler.get_last_lr()[0]}

    def save_checkpoint(self, path: str) -> None:
        self.ds.save_checkpoint(path, tag="ds")

    def load_checkpoint(self, path: str) -> None:
        self.ds.load_checkpoint(path, tag="ds")

    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        if self.spec.zero_stage == 3:
            sd = self.ds._zero3_consolidated_16bit_state_dict()
        else:
            sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        return sd if dist.get_rank(self.group) == 0 else None

    def sleep(self) -> None:
        if torch.cuda.is_available() and hasattr(self.ds, "offload_states"):
            self.ds.offload_states()
            torch.cuda.empty_cache()

    def wake(self, tags=None) -> None:
        if torch.cuda.is_available() and hasattr(self.ds, "reload_states"):
            self.ds.reload_states()
