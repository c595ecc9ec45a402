"""Rollout engines by name: ``register_engine(name, builder)``, ``build_engine(name, args)``.

As veRL's ``_ROLLOUT_REGISTRY`` (verl/workers/rollout/base.py ``get_rollout_class``, read at volcengine/verl
b178a3c): a name maps to the dotted path of what builds the engine, imported only when that engine is built (vLLM is
never imported for an HF job).  A new engine is one file (a ``RolloutEngine`` and a ``build(args) -> engine``) plus one
``register_engine`` line below; ``--rollout_engine auto`` asks each engine registered with an ``auto`` rule, in
registration order, and falls back to ``hf``.

What every builder gets is ``EngineArgs``: the flags an engine reads and where it runs (``EnginePlace``), resolved
once by the caller (rlhf.roles.build ``build_rollout_engine``), never the whole config.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

FALLBACK = "hf"  # what --rollout_engine auto picks when no engine's auto rule accepts the job


@dataclass
class EnginePlace:
    """Where this rank's engine runs (from the placement)."""
    rank: int                       # this rank (global)
    ranks: List[int]                # the engine's TP ranks (global); the first drives it and reports its rows
    separate: bool = False          # not every rank of the job holds an engine: vLLM runs in processes of its own
    tp_group: Any = None            # the engine's TP ranks' process group (colocated TP > 1)
    gpus_per_node: int = 1          # local device index of rank k: k % gpus_per_node

    @property
    def first(self) -> bool:
        return self.rank == self.ranks[0]


@dataclass
class EngineArgs:
    """What a rollout engine is built from."""
    model_path: str                 # --pretrain, resolved
    device: Any                     # torch.device of this rank
    max_model_len: int              # prompt + response tokens of one sample (rlhf.roles.build.rl_max_len)
    seed: int = 0                   # this engine's seed (OpenRLHF: --seed + engine index)
    bf16: bool = False              # --bf16
    micro_batch_size: int = 8       # --micro_rollout_batch_size (the HF engine's generation chunk)
    tp_size: int = 1                # --vllm_tensor_parallel_size
    gpu_memory_utilization: float = 0.5   # --vllm_gpu_memory_utilization
    enable_sleep: bool = False      # --vllm_enable_sleep
    sleep_level: int = 2            # --vllm_sleep_level
    enforce_eager: bool = False     # --enforce_eager
    lora_rank: int = 0              # --lora_rank under --lora_sync adapter (0: merged weights, no adapter)
    lora_versions: int = 1          # adapter versions an engine keeps (--async_queue_size + 1 under --async_train)
    place: EnginePlace = field(default_factory=lambda: EnginePlace(0, [0]))


_ENGINES: Dict[str, str] = {}                 # name -> "module:builder"
_AUTO: List[Tuple[str, str]] = []             # (name, "module:rule"), in registration order


def register_engine(name: str, builder: str, auto: Optional[str] = None) -> None:
    """``builder``: "package.module:function", ``function(EngineArgs) -> RolloutEngine``.  ``auto``: the dotted path
    of ``rule(model_path, cuda) -> (fits, reason)``, asked by ``--rollout_engine auto``."""
    if name in _ENGINES:
        raise ValueError(f"rollout engine {name!r} is registered already ({_ENGINES[name]})")
    _ENGINES[name] = builder
    if auto is not None:
        _AUTO.append((name, auto))


def engine_kinds() -> Tuple[str, ...]:
    return tuple(_ENGINES)


def _load(path: str) -> Callable:
    module, fn = path.split(":")
    return getattr(importlib.import_module(module), fn)


def auto_engine(model_path: str, cuda: bool) -> Tuple[str, str]:
    """``--rollout_engine auto``: (engine, reason).  The same answer on every rank (config and installed packages
    only), which colocated vLLM needs: every rank builds one or none does."""
    why = "no engine's auto rule applies"
    for name, rule in _AUTO:
        fits, why = _load(rule)(model_path, cuda)
        if fits:
            return name, why
    return FALLBACK, why


def build_engine(kind: str, args: EngineArgs):
    """The engine ``kind`` (a registered name) built from ``args``."""
    if kind not in _ENGINES:
        raise ValueError(f"unknown --rollout_engine {kind!r}: choose one of {', '.join(('auto',) + engine_kinds())}")
    return _load(_ENGINES[kind])(args)


register_engine("hf", "rlhf.engines.hf_engine:build_hf_engine")
register_engine("vllm", "rlhf.engines.vllm_engine:build_vllm_engine", auto="rlhf.engines.vllm_compat:vllm_fits")
