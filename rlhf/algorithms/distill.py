"""Distillation from a frozen teacher: on-policy (OPD, the student's own samples) and offline (KD, the data tokens).

On-policy distillation (Qwen3; Thinking Machines "On-Policy Distillation"; OpenRLHF PR #1276
openrlhf/trainer/opd_trainer.py ``compute_opd_loss``; veRL verl/trainer/distillation/; TRL DistillationTrainer):
the student samples y ~ pi_s, the teacher scores every sampled token, and each token's reward is the negative
per-token reverse KL on the student's own sample,

    r_t = -(log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t)),   masked by the response mask,

with pi_s the student's behaviour log-probs (those the tokens were sampled with).  OpenRLHF PR #1276 trains it
as a per-token loss whose gradient is  sg(log pi_s - log pi_t) * grad log pi_s  (``surrogate = log_ratio.detach()
* student_log_probs``): a token's own log-ratio, no sum over later tokens.  Here the same term enters the policy
loss as a per-token advantage, A_t += coef * r_t (rlhf.rl.opd): at the on-policy ratio 1 the policy gradient
-A_t grad log pi_s is PR #1276's gradient, and PPO's clip and the RL reward's advantage compose with it.

The top-k term (issue 46's ``--opd_topk k``: a loss term of the actor's update, weight --opd_coef, rlhf.roles.actor)
is the forward KL restricted to the teacher's k most likely tokens at each response position, the mass outside
them one tail bucket.  OpenRLHF PR #1276 (openrlhf/trainer/opd_trainer.py ``compute_topk_token_kl``) takes the
reverse KL over the student's current top k with the same tail bucket, which needs the teacher's logits inside the
student's update; here the teacher scores once per step before the update (its stage; on ranks of its own too),
so its top k is recorded then and the student's log-probs of those ids come from the update's forward:

    KL_k(p_t || p_s) = sum_{v in topk(p_t)} p_t(v) (log p_t(v) - log p_s(v)) + p_t(tail) (log p_t(tail) - log p_s(tail)),
    p(tail) = 1 - sum_{v in topk(p_t)} p(v)  (clamped to [1e-7, 1]).

Offline KD (OpenRLHF openrlhf/cli/train_kd.py with openrlhf/models/loss.py ``KDLoss``, kd_trainer.py
``loss = gpt_loss * (1 - kd_coef) + distil_loss * kd_coef``): on the data tokens,

    KL(p_t || p_s) = sum_v p_t(v) (log p_t(v) - log p_s(v)),   averaged over the supervised tokens.

OpenRLHF's ``KDLoss`` is the cross-entropy  -sum_v p_t(v) log p_s(v): the same gradient, larger by the teacher's
entropy (a constant); the KL here is 0 when the student matches the teacher, so it reads as a divergence.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rlhf.algorithms.registry import DISTILLATION

TAIL_FLOOR = 1e-7


@DISTILLATION.register("opd_reward")
def opd_token_reward(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """r_t = -(log pi_s(y_t) - log pi_t(y_t)) * m_t, float32, (B, R): the negative per-token reverse KL."""
    return -(student_logprobs.float() - teacher_logprobs.float()) * mask.float()


def reverse_kl_per_token(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> float:
    """sum_t m_t (log pi_s(y_t) - log pi_t(y_t)) / sum_t m_t: the sampled estimate of KL(pi_s || pi_t) per token
    (``opd/reverse_kl``)."""
    m = mask.float()
    return float(((student_logprobs.float() - teacher_logprobs.float()) * m).sum() / m.sum().clamp(min=1.0))


@DISTILLATION.register("topk_forward_kl")
def topk_forward_kl(student_logits: Tensor, teacher_topk_logprobs: Tensor, teacher_topk_ids: Tensor,
                    temperature: float = 1.0) -> Tensor:
    """Per position KL_k(p_t || p_s) over the teacher's top-k tokens plus the tail bucket (module docstring):
    ``student_logits`` (..., V), the teacher's top-k log-probs and token ids (..., k) -> (...) float32, with a
    gradient to the student's logits."""
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1).gather(-1, teacher_topk_ids)
    return topk_forward_kl_at(log_s, teacher_topk_logprobs)


@DISTILLATION.register("topk_forward_kl_at")
def topk_forward_kl_at(student_topk_logprobs: Tensor, teacher_topk_logprobs: Tensor) -> Tensor:
    """KL_k(p_t || p_s) (module docstring) from the student's log-probs of the teacher's top-k ids and the
    teacher's own, both (..., k) -> (...) float32 (what the fused head gives: the student's full logits never
    exist at once)."""
    log_s = student_topk_logprobs.float()
    log_t = teacher_topk_logprobs.float()
    p_t = log_t.exp()
    kl = (p_t * (log_t - log_s)).sum(-1)
    tail_t = (1.0 - p_t.sum(-1)).clamp(TAIL_FLOOR, 1.0)
    tail_s = (1.0 - log_s.exp().sum(-1)).clamp(TAIL_FLOOR, 1.0)
    return kl + tail_t * (tail_t.log() - tail_s.log())


@DISTILLATION.register("kd_forward_kl")
def kd_forward_kl(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
    """Mean over the supervised tokens (``mask``) of KL(p_t || p_s) = sum_v p_t (log p_t - log p_s); logits
    (..., V), mask (...) -> scalar; no gradient to the teacher."""
    log_s = torch.log_softmax(student_logits.float(), dim=-1)
    log_t = torch.log_softmax(teacher_logits.detach().float(), dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)
    m = mask.float()
    return (kl * m).sum() / m.sum().clamp(min=1.0)
