"""The roles the role table declares a builder for (rlhf.distributed.role_table ``RoleDecl.builder``, a
``"module:function"`` path imported only when built, as rlhf.engines.rollout_registry), built by ``build_roles``
after the built-in ones; and ``build_frozen_lm``, the builder of a frozen causal LM read from a model flag
(``RoleDecl.pretrain``: a teacher, ...), built as the reference is (rlhf.roles.reference)."""
from __future__ import annotations

import importlib
from typing import Dict, Optional

from rlhf.distributed import Groups
from rlhf.distributed.role_table import ROLE_TABLE, RoleDecl
from rlhf.engines.train import spec_from_config
from rlhf.models.load import load_causal_lm
from rlhf.roles.base import ModelRole, Role, model_role


def declared_roles(model, optim, topology, groups: Groups, device, total_steps: int,
                   **flags) -> Dict[str, Optional[Role]]:
    """name -> the role (None where the placement has none) of every declaration with a builder, in table order;
    a builder is called as ``(decl, model, optim, topology, groups, device, total_steps)`` (the sub-configs), and
    with ``flags=`` the flag group it declares where that is not ``model`` (``flags``: name -> group)."""
    out: Dict[str, Optional[Role]] = {}
    for decl in ROLE_TABLE.values():
        if decl.builder:
            module, _, fn = decl.builder.partition(":")
            own = {} if decl.flags == "model" else {"flags": flags[decl.flags]}
            out[decl.name] = getattr(importlib.import_module(module), fn)(decl, model, optim, topology, groups, device,
                                                                              total_steps, **own)
    return out


class FrozenLM(ModelRole):
    """A frozen causal LM (no optimizer state: not part of a run's checkpoint); ``logprobs`` is its forward."""

    trains = False


def build_frozen_lm(decl: RoleDecl, model, optim, topology, groups: Groups, device,
                    total_steps: int, flags=None) -> Optional[FrozenLM]:
    """``decl``'s role on every rank (None where the placement has none): the model at the flag ``decl.pretrain``
    names (a field of the model config, or of ``flags``, the group the role declares), a frozen engine spec (as
    ``frozen_spec``) sharded over the role's group."""
    path = getattr(model if flags is None else flags, decl.pretrain)

    def spec(role):
        return spec_from_config(model, optim, topology, 0.0, total_steps, trainable=False, group_size=role.size)

    return model_role(FrozenLM, decl.name, groups, topology.backend, device, spec,
                      lambda on_meta: load_causal_lm(path, model.bf16, model.flash_attn, on_meta=on_meta,
                                                     trainable=False))
