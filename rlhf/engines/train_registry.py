"""Train engines by ``--backend`` name.  A registry apart from base.py, so the interface (base.py) imports no
implementation and each implementation imports only the interface: factory -> {fsdp2, deepspeed_engine} -> base.
A new backend is one file plus one entry here (veRL keeps its engines the same way: verl/workers/engine/base.py
``EngineRegistry``)."""
from __future__ import annotations

from typing import Callable, Dict

import torch

from rlhf.engines.deepspeed_engine import DeepSpeedEngine
from rlhf.engines.fsdp2 import FSDP2Engine
from rlhf.engines.train import EngineSpec, TrainEngine, loads_on_first


def _fsdp2(model: torch.nn.Module, spec: EngineSpec, mesh, device) -> TrainEngine:
    return FSDP2Engine(model, spec, mesh=mesh, device=device, load_on_first=loads_on_first("fsdp2", mesh.group))


def _deepspeed(model: torch.nn.Module, spec: EngineSpec, mesh, device) -> TrainEngine:
    return DeepSpeedEngine(model, spec, device=device, mesh=mesh)


TRAIN_ENGINES: Dict[str, Callable[..., TrainEngine]] = {"fsdp2": _fsdp2, "deepspeed": _deepspeed}


def make_engine(backend: str, model: torch.nn.Module, spec: EngineSpec, mesh=None, device=None) -> TrainEngine:
    """The engine over ``mesh`` (a role's ``rlhf.distributed.mesh.RoleMesh``; default every rank); ``model`` as
    built by ``reads_weights`` (real weights or the meta device)."""
    from rlhf.distributed.mesh import world_mesh

    if backend not in TRAIN_ENGINES:
        raise ValueError(f"unknown --backend {backend!r}; choose {' or '.join(TRAIN_ENGINES)}")
    return TRAIN_ENGINES[backend](model, spec, mesh if mesh is not None else world_mesh(), device)
