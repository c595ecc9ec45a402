"""The reference: a frozen copy of the starting policy (--ref_pretrain, default --pretrain) whose log-probs the KL
terms compare against: RL's KL penalty / KL loss and DPO's implicit reward,

    DPO reward = beta * (log pi(y|x) - log pi_ref(y|x)),

built once, the same way, for both (OpenRLHF ``Actor(ref_pretrain)`` in train_dpo.py and the PPO ref worker): a
frozen engine spec (inference micro-batches, no optimizer state), FSDP2-sharded over the role's group, able to
sleep and wake like every role, with the role's sequence-parallel group attached.
"""
from __future__ import annotations

from typing import Optional

from rlhf.distributed import Groups
from rlhf.models.load import load_causal_lm
from rlhf.roles.base import ModelRole, frozen_spec, model_role


class Reference(ModelRole):
    """The frozen reference policy (no optimizer state: not part of a run's checkpoint)."""

    trains = False


def build_reference(m, optim, topology, groups: Groups, path: str, device, total_steps: int) -> Optional[Reference]:
    """The placement's "ref" role on every rank (None where it has none), from the model (``m``), optim and topology
    groups; ``path``: --pretrain resolved."""
    return model_role(Reference, "ref", groups, topology.backend, device, frozen_spec(m, optim, topology, total_steps),
                      lambda on_meta: load_causal_lm(m.ref_pretrain or path, m.bf16, m.flash_attn, on_meta=on_meta,
                                                     trainable=False))
