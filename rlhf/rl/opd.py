"""On-policy distillation in the RL step (issue 46): the teacher's log-probs of the student's sampled tokens
(``teacher_logprobs``: the teacher role's declared forward stage, or ``RemoteTeacherStage`` behind --teacher_url)
become a per-token advantage term after the advantage stage (``OPDStage``):

    A_t <- A_t + opd_coef * r_t,   r_t = -(log pi_s(y_t) - log pi_t(y_t))   (rlhf.algorithms.distill),
    A_t <- opd_coef * r_t          with --opd_only (the task reward is logged, not trained on),

with log pi_s the student's behaviour log-probs: those its tokens were sampled with (``rollout_logprobs``, at the
rollout's temperature; under --async_train the policy of one or more steps before, whose ratio to the current one
the policy loss and its IS correction already carry).  As
OpenRLHF PR #1276 (openrlhf/trainer/opd_trainer.py ``compute_opd_loss``: ``surrogate = log_ratio.detach() *
student_log_probs``) each token's term is its own log-ratio, no sum over later tokens; slime
(docs/en/advanced/on-policy-distillation.md) subtracts it from any estimator's advantage the same way.  Under
--async_train these stages run on the trainer ranks (``trainers_only``), as the reference's.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from rlhf.algorithms.distill import opd_token_reward, reverse_kl_per_token
from rlhf.batch import Batch
from rlhf.rl.stages import Stage


class OPDStage(Stage):
    """The OPD term into ``advantages`` (module docstring) and its metrics: ``opd/reverse_kl`` (the sampled
    reverse KL per response token, sum_t m_t (log pi_s - log pi_t) / sum_t m_t) and ``opd/teacher_logprob``."""
    trainers_only = True
    reads = ("teacher_logprobs", "rollout_logprobs", "action_mask", "advantages")
    writes = ("advantages",)

    def __init__(self, coef: float, only: bool):
        # named per object: no row of rlhf.stage_table (no model memory), as the role table's declared forwards
        self.name, self.coef, self.only = "opd", coef, only

    def run(self, batch: Batch, roles) -> None:
        behaviour = batch.rollout_logprobs
        mask = batch.action_mask  # the advantage stage zeroed the rows that train nothing
        term = self.coef * opd_token_reward(behaviour, batch.teacher_logprobs, mask)
        batch.advantages = term if self.only else batch.advantages + term
        m = mask.float()
        batch.metrics.update({
            "opd/reverse_kl": reverse_kl_per_token(behaviour, batch.teacher_logprobs, mask),
            "opd/teacher_logprob": float((batch.teacher_logprobs.float() * m).sum() / m.sum().clamp(min=1.0)),
        })



class RemoteTeacherStage(Stage):
    """``teacher_logprobs`` from a teacher server (--teacher_url, rlhf.rl.teacher_client): every trainer rank asks
    for the whole batch (the answers are the same: every rank then holds the same batch, as after a gather)."""
    trainers_only = True
    reads = ("sequences", "attention_mask", "action_mask")
    writes = ("teacher_logprobs",)

    def __init__(self, client, deadline_s: Optional[float] = None):
        # the local teacher's stage name (its time_teacher), per object as OPDStage's
        self.name, self.client, self.deadline_s = "teacher", client, deadline_s

    def run(self, batch: Batch, roles) -> None:
        lp = self.client.logprobs(batch.sequences, batch.attention_mask, batch.action_mask.size(1))
        batch.teacher_logprobs = lp * batch.action_mask.float()


class TeacherTopkStage(Stage):
    """--opd_topk k: the local teacher's forward in place of its declared one (same name, ``teacher``; one forward,
    rlhf.roles.teacher_topk ``role_topk``): its log-probs of the sampled tokens, its k most likely tokens and their
    log-probs at every response position, and the top-k term's weight for the actor's loss (``opd_topk_coef`` =
    --opd_coef: rlhf.roles.actor, rlhf.algorithms.distill ``topk_forward_kl_at``)."""
    trainers_only = True
    reads = ("sequences", "attention_mask", "action_mask")
    writes = ("teacher_logprobs", "teacher_topk_logprobs", "teacher_topk_ids", "opd_topk_coef")

    def __init__(self, forwards, k: int, coef: float):
        # the teacher's declared forward stage's name, role and memory kind (it stands in for it: rlhf.rl.stages)
        self.name, self.role, self.memory = "teacher", "teacher", "forward"
        self.forwards, self.k, self.coef = forwards, k, coef

    def run(self, batch: Batch, roles) -> None:
        from rlhf.roles.teacher_topk import role_topk

        batch.teacher_logprobs, batch.teacher_topk_logprobs, batch.teacher_topk_ids = role_topk(
            roles.teacher, batch, self.forwards, self.k)
        batch.opd_topk_coef = self.coef


def distill_stages(teacher, deadline_s: Optional[float], forwards=None) -> Tuple[List[Stage], List[Stage]]:
    """(the remote teacher's forward, the OPD term) for ``rlhf.rl.stages.StageParts.distill``; ``teacher``: the
    teacher flag group (rlhf.config.teacher_schema.TeacherConfig).  Without a teacher: none.  A local teacher's
    forward is its role's declared stage (rlhf.distributed.role_table), not one of these; with --opd_topk
    ``TeacherTopkStage`` (``forwards``: rlhf.rl.components.Forwards) stands in for it."""
    if not (teacher.teacher_pretrain or teacher.teacher_url):
        return [], []
    remote: List[Stage] = []
    if teacher.teacher_url:
        from rlhf.rl.teacher_client import TeacherClient

        remote.append(RemoteTeacherStage(TeacherClient(teacher.teacher_url, teacher.teacher_model_name), deadline_s))
    elif teacher.opd_topk > 0:
        remote.append(TeacherTopkStage(forwards, teacher.opd_topk, teacher.opd_coef))
    return remote, [OPDStage(teacher.opd_coef, teacher.opd_only)]
