"""Offline knowledge distillation in SFT (``rlhf.train_sft --teacher_pretrain DIR``): on the data's supervised
tokens,

    loss = (1 - kd_coef) * CE(student) + kd_coef * KL(p_teacher || p_student)   (rlhf.algorithms.distill),

after OpenRLHF openrlhf/cli/train_kd.py + openrlhf/trainer/kd_trainer.py (``loss = gpt_loss * (1 - kd_coef) +
distil_loss * kd_coef``, ``KDLoss`` in openrlhf/models/loss.py: the teacher's soft cross-entropy, the same gradient
as the KL here).  The teacher is frozen on the student's ranks: it takes the reference's place of the supervised
placement (``Task.reference_flags``: the reference loads --teacher_pretrain), built and sharded as DPO's is."""
from __future__ import annotations

from dataclasses import replace

import torch

from rlhf.algorithms import kd_forward_kl, logprobs_from_logits
from rlhf.algorithms.preference import sft_token_loss
from rlhf.supervised.tasks import SFTTask


def _inputs(b: dict) -> dict:
    kw = {"input_ids": b["input_ids"], "use_cache": False}
    if "position_ids" in b:
        kw["position_ids"] = b["position_ids"]
    else:
        kw["attention_mask"] = b["attention_mask"]
    return kw


class KDTask(SFTTask):
    """SFT with a teacher (the module docstring); ``teacher``: the teacher flag group (TeacherConfig), set by
    ``kd_task``."""
    teacher = None

    def needs_reference(self, samples) -> bool:
        return True

    def reference_flags(self, m):
        return replace(m, ref_pretrain=self.teacher.teacher_pretrain)

    def compute(self, model, b):
        logits = model(**_inputs(b)).logits[:, :-1]
        mask = b["loss_mask"][:, 1:]
        ce = sft_token_loss(logprobs_from_logits(logits, b["input_ids"][:, 1:], self.model_config.logprob_chunk_size),
                            mask)
        with torch.no_grad():
            teacher_logits = self.ref.model(**_inputs(b)).logits[:, :-1]
        kd = kd_forward_kl(logits, teacher_logits, mask)
        a = self.teacher.kd_coef
        loss = (1.0 - a) * ce + a * kd
        return loss, {"loss": float(loss.detach()), "ce_loss": float(ce.detach()), "kd_loss": float(kd.detach())}


def kd_task(teacher) -> type:
    """The KDTask class bound to ``teacher`` (the trainer constructs its task from the class)."""
    return type("KDTask", (KDTask,), {"teacher": teacher})
