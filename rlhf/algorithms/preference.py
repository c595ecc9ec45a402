"""Preference losses (DPO family), pairwise reward-model losses, SFT token loss."""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from rlhf.algorithms.registry import PREFERENCE_LOSSES, REWARD_MODEL_LOSSES

Tensor = torch.Tensor


def _margins(pc, pr, rc, rr):
    return (pc - rc) - (pr - rr)


@PREFERENCE_LOSSES.register("sigmoid")
def dpo_sigmoid(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """DPO / conservative DPO: h = (log pi_c - log ref_c) - (log pi_r - log ref_r);
    l = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)."""
    h = _margins(pc, pr, rc, rr)
    return -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing


@PREFERENCE_LOSSES.register("ipo")
def dpo_ipo(pc, pr, rc, rr, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """IPO (Azar et al. 2023): l = (h - 1 / (2 beta))^2."""
    return (_margins(pc, pr, rc, rr) - 1.0 / (2.0 * beta)) ** 2


@PREFERENCE_LOSSES.register("hinge")
def dpo_hinge(pc, pr, rc, rr, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """SLiC hinge: l = max(0, 1 - beta h)."""
    return torch.relu(1.0 - beta * _margins(pc, pr, rc, rr))


def dpo_loss(loss_type: str, pc, pr, rc, rr, beta: float, label_smoothing: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    """Returns (per-pair losses, chosen rewards beta(pc - rc), rejected rewards beta(pr - rr))."""
    losses = PREFERENCE_LOSSES.get_fn(loss_type)(pc, pr, rc, rr, beta, label_smoothing)
    return losses, (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()


@REWARD_MODEL_LOSSES.register("sigmoid")
def rm_logsigmoid(chosen: Tensor, rejected: Tensor, margin: float = 0.0) -> Tensor:
    """Bradley-Terry: l = -log sigma(r_c - r_r - m)."""
    return -F.logsigmoid(chosen - rejected - margin)


@REWARD_MODEL_LOSSES.register("logexp")
def rm_logexp(chosen: Tensor, rejected: Tensor, margin: float = 0.0) -> Tensor:
    """l = log(1 + exp(r_r - r_c + m))  (= softplus; same optimum as log-sigmoid)."""
    return F.softplus(rejected - chosen + margin)


def sft_token_loss(logp: Tensor, loss_mask: Tensor) -> Tensor:
    """Mean NLL over the supervised tokens:  -sum(logp * m) / sum(m).

    With packing, loss_mask is 0 on prompt tokens and on each sample's first
    label position, so no token is predicted across a sample boundary.
    """
    m = loss_mask.to(logp.dtype)
    return -(logp * m).sum() / m.sum().clamp(min=1.0)
