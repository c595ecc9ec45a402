"""Actor -> rollout weight sync.

Colocated: every rank gathers full parameters from its actor shards and loads
them into its own engine, bucket by bucket (no extra copy of the whole model).
Separate rollout ranks: actor rank 0 packs each bucket into one flat tensor and
broadcasts it over the sync group (actor rank 0 + rollout ranks); receivers
split and load it.  Both sides derive the same bucket plan from the parameter
metadata, which is broadcast once.  Every wait has a timeout.
"""
from __future__ import annotations

import datetime
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

Meta = Tuple[str, Tuple[int, ...], torch.dtype]


class WeightSyncTimeout(RuntimeError):
    pass


def zero3_param(p: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter: its ``shape`` is the local partition's (``[0]`` outside a gather), ``ds_shape``
    the full one (deepspeed/runtime/zero/partition_parameters.py sets ``ds_id``/``ds_shape`` on conversion)."""
    return hasattr(p, "ds_id")


def full_shape(p: torch.Tensor) -> Tuple[int, ...]:
    """The full (unsharded) shape, without any collective: ZeRO-3 ``ds_shape``, a DTensor's global shape, or the
    plain tensor's."""
    return tuple(p.ds_shape) if zero3_param(p) else tuple(p.shape)


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter; a collective for sharded ones, so every rank of the shard group calls it for
    the same parameters in the same order.

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
            return p.data.detach().clone()
    t = p.data if isinstance(p, torch.nn.Parameter) else p
    return t.full_tensor() if hasattr(t, "full_tensor") else t


PEFT_PREFIX = "base_model.model."


def _engine_name(name: str) -> str:
    """peft's parameter name -> the plain HF model's (what the rollout engine holds)."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def _lora_scalings(model) -> dict:
    return {name: mod.scaling["default"] for name, mod in model.named_modules()
            if hasattr(mod, "lora_A") and hasattr(mod, "scaling") and "default" in getattr(mod, "scaling", {})}


def _export(model, materialize: bool):
    """(engine name, full shape, dtype, tensor or None) for every weight the engine receives, in one fixed order
    (``named_parameters``, the same on every rank).

    LoRA layers are merged: W = W_base + scaling * B @ A, emitted where lora_B appears,
    so the metadata pass (materialize=False, no collectives: shapes from ``full_shape``) and the tensor pass
    agree.  The tensor pass gathers every parameter (``full_tensor``), a collective under FSDP2 and ZeRO-3.
    """
    scal = _lora_scalings(model)
    pending = {}
    for name, p in model.named_parameters():
        mod = None
        for key in (".base_layer.weight", ".lora_A.default.weight", ".lora_B.default.weight"):
            if name.endswith(key) and name[: -len(key)] in scal:
                mod, part = name[: -len(key)], key
        t = full_tensor(p) if materialize else None
        if mod is None:
            yield _engine_name(name), full_shape(p), p.dtype, t
            continue
        slot = pending.setdefault(mod, {})
        slot[part] = t if materialize else p
        if part == ".lora_B.default.weight":
            base = slot[".base_layer.weight"]
            merged = None
            if materialize:
                merged = base + scal[mod] * (slot[".lora_B.default.weight"].float() @
                                             slot[".lora_A.default.weight"].float()).to(base.dtype)
            yield _engine_name(mod + ".weight"), full_shape(base), base.dtype, merged
            del pending[mod]


def param_meta(model: torch.nn.Module) -> List[Meta]:
    """(engine name, full shape, dtype) of every weight the engine receives; local, no collective."""
    return [(n, shape, dt) for n, shape, dt, _ in _export(model, materialize=False)]


def bucket_plan(meta: List[Meta], bucket_bytes: int, dtype: Optional[torch.dtype] = None) -> List[List[int]]:
    """Group parameter indices into buckets of at most bucket_bytes (a larger tensor gets its own bucket)."""
    buckets, cur, size = [], [], 0
    for i, (_, shape, dt) in enumerate(meta):
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype or dt).element_size()
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def _wait(work, timeout_s: float, what: str):
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # gloo raises on timeout
        raise WeightSyncTimeout(f"weight sync timed out after {timeout_s}s during {what}: a rank of the sync group "
                                f"did not join (crashed, or is stuck in another phase). Cause: {e}") from None
    if ok is False:
        raise WeightSyncTimeout(f"weight sync timed out after {timeout_s}s during {what}")


class WeightSync:
    def __init__(self, groups, engine=None, bucket_mb: float = 256, dtype: Optional[torch.dtype] = None,
                 timeout_s: float = 600, device: Optional[torch.device] = None):
        self.groups = groups
        self.engine = engine
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self._meta: Optional[List[Meta]] = None

    # ---- colocated -------------------------------------------------------------------------------------------
    def _named_full(self, model) -> Iterator[Tuple[str, torch.Tensor]]:
        """Full (unsharded, LoRA-merged) weights under the engine's names; collective over the actor group."""
        for name, _, _, t in _export(model, materialize=True):
            yield name, (t.to(self.dtype) if self.dtype is not None else t)

    def sync_colocated(self, model) -> int:
        """Gather and load bucket by bucket; returns bytes loaded."""
        meta = param_meta(model)
        it = self._named_full(model)
        total = 0
        for bucket in bucket_plan(meta, self.bucket_bytes, self.dtype):
            batch = [next(it) for _ in bucket]
            total += sum(t.numel() * t.element_size() for _, t in batch)
            if self.engine is not None:
                self.engine.load_weights(batch)
        if self.engine is not None:
            self.engine.reset_prefix_cache()
        return total

    # ---- separate rollout ranks --------------------------------------------------------------------------------
    def sync_broadcast(self, model=None) -> int:
        """Called on all actor ranks and all rollout ranks.  Non-zero actor ranks only help unshard."""
        plan = self.groups.plan
        rank = self.groups.rank
        src = plan.sync_ranks[0]
        in_sync = rank in plan.sync_ranks
        is_actor = model is not None
        if self._meta is None and in_sync:
            box = [param_meta(model) if rank == src else None]
            dist.broadcast_object_list(box, src=src, group=self.groups.sync)
            self._meta = box[0]
        if not in_sync:  # other actor ranks: take part in unsharding only
            for _ in self._named_full(model):
                pass
            return 0
        meta = self._meta
        dtype_of = (lambda dt: self.dtype or dt)
        it = self._named_full(model) if is_actor else None
        total = 0
        for bucket in bucket_plan(meta, self.bucket_bytes, self.dtype):
            by_dtype = {}
            for i in bucket:
                by_dtype.setdefault(dtype_of(meta[i][2]), []).append(i)
            tensors = dict(next(it) for _ in bucket) if is_actor else {}
            loaded = []
            for dt, idxs in by_dtype.items():
                numels = [int(torch.Size(meta[i][1]).numel()) for i in idxs]
                if rank == src:
                    flat = torch.cat([tensors[meta[i][0]].reshape(-1).to(dt) for i in idxs]).to(self.device)
                else:
                    flat = torch.empty(sum(numels), dtype=dt, device=self.device)
                work = dist.broadcast(flat, src=src, group=self.groups.sync, async_op=True)
                _wait(work, self.timeout_s, f"bucket of {len(idxs)} tensors")
                total += flat.numel() * flat.element_size()
                if not is_actor:
                    for i, piece in zip(idxs, torch.split(flat, numels)):
                        loaded.append((meta[i][0], piece.view(meta[i][1])))
            if loaded and self.engine is not None:
                self.engine.load_weights(loaded)
        if not is_actor and self.engine is not None:
            self.engine.reset_prefix_cache()
        return total

    def sync(self, model=None) -> int:
        if self.groups.plan.separate_rollout:
            return self.sync_broadcast(model)
        return self.sync_colocated(model)
