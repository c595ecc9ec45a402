"""The teacher: a frozen causal LM (--teacher_pretrain) whose log-probs of the student's sampled tokens each RL
step records (``teacher_logprobs``: on-policy distillation, rlhf.rl.opd), on the actor's ranks (asleep between its
forwards, as the reference) or on ranks of its own (--teacher_num_gpus_per_node); its declaration is in
rlhf.distributed.role_table.  Behind --teacher_url the teacher is a server (rlhf.rl.teacher_client): no local
role, the placement holds none.  A local teacher is built as the reference is (rlhf.roles.registry
``build_frozen_lm``, after OpenRLHF PR #1276 openrlhf/cli/train_opd.py: ``Actor(teacher.model_name_or_path)`` with
the eval DeepSpeed config)."""
from __future__ import annotations

from typing import Optional

from rlhf.distributed import Groups
from rlhf.distributed.role_table import RoleDecl
from rlhf.roles.registry import FrozenLM, build_frozen_lm


def build_teacher(decl: RoleDecl, model, optim, topology, groups: Groups, device, total_steps: int,
                  flags=None) -> Optional[FrozenLM]:
    """The placement's teacher on every rank (None where it has none); ``flags``: the teacher group
    (rlhf.config.teacher_schema.TeacherConfig), ``model`` the model group (--bf16, --flash_attn)."""
    return build_frozen_lm(decl, model, optim, topology, groups, device, total_steps, flags)
