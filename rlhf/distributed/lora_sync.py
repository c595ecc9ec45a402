"""Adapter-only LoRA sync (``--lora_sync adapter``): what the trainer's peft model sends a rollout engine that runs
the LoRA unmerged.

Merged sync sends W' = round_bf16(W + s * B @ A) for every targeted weight at every sync: under bf16 the rounding
moves each weight by up to half an ulp of W, which is larger than most LoRA updates s * B @ A, so the engine
samples from a policy the trainer never had (NVIDIA-NeMo/RL#3696).  Adapter sync sends the base weights once and
then only (A, B) and the scaling s = lora_alpha / r; the engine computes y = x W^T + s * (x A^T) B^T as the trainer
does.  Bytes per sync: sum over targeted layers of r * (in + out) instead of in * out (~100x fewer at r = 16 on a
4096-wide model).

As TRL (PR #7017: ``vllm_generation.py`` sends the peft state dict and a ``LoRARequest`` per version) and veRL
(``lora.merge=False``; verl/utils/vllm/utils.py ``TensorLoRARequest`` and its patched ``_load_adapter`` calling
``LoRAModel.from_lora_tensors``).  The names are peft's saved names (``peft.get_peft_model_state_dict``:
``base_model.model.<module>.lora_A.weight``), which both vLLM (vllm/lora/utils.py ``parse_fine_tuned_lora_name``)
and peft (``set_peft_model_state_dict``) read.

Versions: each sync is a new adapter version 1, 2, ...; an engine keeps the newest ``keep`` of them and generates
with the newest (``AdapterVersions``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch

LORA_PARTS = (".lora_A.default.weight", ".lora_B.default.weight")
PEFT_PREFIX = "base_model.model."


def _engine_name(name: str) -> str:
    """peft's parameter name -> the plain HF model's (what the rollout engine holds)."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def lora_scalings(model) -> Dict[str, float]:
    """{module name: scaling} of every peft LoRA layer of the default adapter (empty: not a LoRA model)."""
    out = {}
    for name, mod in model.named_modules():
        scal = mod.__dict__.get("scaling")
        if isinstance(scal, dict) and "default" in scal and "lora_A" in mod._modules:
            out[name] = float(scal["default"])
    return out


def is_lora_model(model) -> bool:
    return model is not None and bool(lora_scalings(model))


def saved_name(name: str) -> str:
    """Trainer parameter name -> peft's saved name (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def adapter_config(model) -> dict:
    """The adapter's peft config as plain JSON (vLLM ``PEFTHelper.from_dict``, peft ``LoraConfig(**...)``):
    r from lora_A's rows, lora_alpha = s * r (s the layer's scaling), target_modules the targeted leaf names.
    Refused where layers differ in rank or scaling (peft's rank_pattern / alpha_pattern are not sent)."""
    scal = lora_scalings(model)
    ranks, targets = set(), set()
    for name, p in model.named_parameters():
        if name.endswith(LORA_PARTS[0]) and name[: -len(LORA_PARTS[0])] in scal:
            ranks.add(int(_full_shape(p)[0]))
            targets.add(name[: -len(LORA_PARTS[0])].rsplit(".", 1)[-1])
    if len(ranks) != 1 or len(set(scal.values())) != 1:
        raise ValueError(f"--lora_sync adapter needs one rank and one scaling for every LoRA layer, got ranks "
                         f"{sorted(ranks)} and scalings {sorted(set(scal.values()))}: use --lora_sync merged")
    r = ranks.pop()
    alpha = next(iter(scal.values())) * r
    return {"r": r, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
            "target_modules": sorted(targets), "bias": "none", "lora_dropout": 0.0}


def _full_shape(p) -> Tuple[int, ...]:
    from rlhf.distributed.gather import full_shape

    return full_shape(p)


def adapter_meta(model) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    """(saved name, full shape, dtype) of every adapter tensor, in ``named_parameters`` order; local, no collective."""
    return [(n, s, d) for n, s, d, _ in export_adapter(model, materialize=False)]


def export_adapter(model, materialize: bool = True) -> Iterator[tuple]:
    """(saved name, full shape, dtype, full tensor or None) of every lora_A / lora_B; the tensor pass gathers each
    (``weight_sync.full_tensor``: a collective under FSDP2 and ZeRO-3, same order on every rank) and copies it:
    vLLM scales lora_B in place when it loads an adapter (vllm/lora/lora_model.py ``from_lora_tensors`` keeps the
    tensor it is given when device and dtype already match)."""
    from rlhf.distributed.gather import full_tensor

    scal = lora_scalings(model)
    for name, p in model.named_parameters():
        part = next((k for k in LORA_PARTS if name.endswith(k)), None)
        if part is None or name[: -len(part)] not in scal:
            continue
        t = full_tensor(p).detach().clone() if materialize else None
        yield saved_name(name), _full_shape(p), p.dtype, t


def tensor_bytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


@dataclass
class AdapterVersions:
    """The adapter versions an engine holds: ``add(v)`` returns the versions to evict so that the newest ``keep``
    remain (under --async_train, keep = --async_queue_size + 1: every batch in the queue was generated by a version
    still loaded)."""
    keep: int = 1
    held: List[int] = field(default_factory=list)

    def add(self, version: int) -> List[int]:
        if version in self.held:
            self.held.remove(version)
        self.held.append(version)
        drop, self.held = self.held[: -self.keep], self.held[-self.keep:]
        return drop

    @property
    def current(self) -> Optional[int]:
        return self.held[-1] if self.held else None


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (vllm/config/lora.py ``MaxLoRARanks``) that holds ``rank``."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"--lora_rank {rank} exceeds vLLM's largest max_lora_rank 512: use --lora_sync merged")


def sync_metrics(nbytes: int, seconds: float) -> dict:
    """What one sync logs: sync_bytes, sync_s and sync_GBps = bytes / seconds / 1e9."""
    return {"sync_bytes": float(nbytes), "sync_s": seconds, "sync_GBps": nbytes / max(seconds, 1e-9) / 1e9}
