"""A frozen teacher role and on-policy / offline distillation (issue 46).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``teacher:``), as in schema.py;
OpenRLHF PR #1276's dotted names (openrlhf/cli/train_opd.py: ``--teacher.model_name_or_path``, ``--opd.topk``) map
onto them in rlhf/config/hierarchical.py.  Its ranks of its own are topology flags (``--teacher_num_gpus_per_node``,
rlhf.config.schema.TopologyConfig) because the placement reads only the topology group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhf.config.fields import opt


@dataclass
class TeacherConfig:
    """The ``teacher`` flag group (see docs/FLAGS.md)."""
    teacher_pretrain: Optional[str] = opt(None, "HF dir of a frozen teacher (OpenRLHF --teacher.model_name_or_path): "
                                                "RL records its log-probs of the sampled tokens (on-policy "
                                                "distillation); SFT distills its distribution (--kd_coef). Its "
                                                "tokenizer must match --pretrain's")
    teacher_url: Optional[str] = opt(None, "a vLLM / OpenAI-compatible server of the teacher (http://host:port): "
                                           "the sampled tokens' log-probs come from its /v1/completions "
                                           "prompt_logprobs instead of a local model (RL only)")
    teacher_model_name: Optional[str] = opt(None, "the model name sent to --teacher_url (default: the server's "
                                                  "first /v1/models entry)")
    opd_coef: float = opt(1.0, "weight of the on-policy distillation term: advantage_t += opd_coef * "
                               "-(log pi_student(y_t) - log pi_teacher(y_t)) on every sampled token (0: the "
                               "teacher's log-probs are logged only); also the weight of the --opd_topk loss term")
    opd_only: bool = opt(False, "on-policy distillation alone: the advantages are the OPD term only (the task "
                                "reward is still computed and logged, not trained on)")
    opd_topk: int = opt(0, "OpenRLHF --opd.topk: k > 0 adds opd_coef * KL_k(teacher || student) over the "
                           "teacher's k most likely tokens at each response position (plus a tail bucket) to the "
                           "actor's loss (OpenRLHF: a reverse KL over the student's top k); 0: none")
    kd_coef: float = opt(0.5, "SFT with --teacher_pretrain: loss = (1 - kd_coef) * CE + kd_coef * KL(teacher || "
                              "student) over the data tokens (OpenRLHF train_kd.py's --kd_coef)")
