"""Full tensors of sharded parameters: what the weight sync sends (``rlhf.distributed.weight_sync``) and the
checkpoint export gathers (FSDP2 DTensors, DeepSpeed ZeRO-3 partitions, plain tensors)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def zero3_param(p: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter: its ``shape`` is the local partition's (``[0]`` outside a gather), ``ds_shape``
    the full one (deepspeed/runtime/zero/partition_parameters.py sets ``ds_id``/``ds_shape`` on conversion)."""
    return hasattr(p, "ds_id")


def full_shape(p: torch.Tensor) -> Tuple[int, ...]:
    """The full (unsharded) shape, without any collective: ZeRO-3 ``ds_shape``, a DTensor's global shape, or the
    plain tensor's."""
    return tuple(p.ds_shape) if zero3_param(p) else tuple(p.shape)


def full_tensor(p: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The full tensor of a parameter; a collective for sharded ones, so every rank of the shard group calls it for
    the same parameters in the same order.  ``dtype``: the tensor comes back in it, and a sharded one is gathered
    in it (each rank casts its shard first): a bf16 engine's sync all-gathers half the bytes of the fp32 masters
    and holds a bf16 buffer, not an fp32 one (veRL gathers the FSDP actor's weights for vLLM in the rollout's
    dtype, verl/workers/sharding_manager/fsdp_vllm.py: ``param.to(device, non_blocking=True).full_tensor()`` of
    the bf16 state dict; OpenRLHF gathers ZeRO-3's bf16 module parameters).

    * FSDP2 DTensor: ``full_tensor()`` (all-gather over its mesh).
    * DeepSpeed ZeRO-3: gathered one parameter at a time inside ``deepspeed.zero.GatheredParameters([p])``
      (all-gather over ``p.ds_process_group``), as OpenRLHF's ``_broadcast_to_vllm`` does
      (openrlhf/trainer/ray/ppo_actor.py: ``GatheredParameters([param], enabled=zero_stage == 3)``); the gathered
      data is copied out before the context re-partitions the parameter on exit.
    * anything else passes through (no copy).
    """
    if zero3_param(p):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.data.detach().to(dtype or p.dtype, copy=True)
    t = p.data if isinstance(p, torch.nn.Parameter) else p
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)  # a DTensor casts its local shard: no communication
    return t.full_tensor() if hasattr(t, "full_tensor") else t
