"""A model role's MoE routing in its forwards (--router_replay, rlhf.models.moe): which ids it replays, what it
records, and its router metrics.

veRL ``actor.router_replay.mode`` (verl/trainer/config/actor/actor.yaml; the Megatron patch
verl/utils/megatron/router_replay_patch.py): R3 replays the rollout engine's routing in every trainer forward
(reference, old log-probs, update); R2 records the old-log-prob forward's routing and replays it in the update;
off replays nothing.  Metrics per forward kind ``<what>`` (``ref``, ``old``, ``update``):

    router/<what>_mismatch      tokens whose experts (any layer) differ from the recorded routing, with replay
    router/<what>_mismatch_own  the same for the router's own top-k: what it would be without replay
    router/load_max[_l<l>]      (update) max_e n_e / mean_e n_e per layer and its mean (rlhf.models.moe.load_metrics)

over the real tokens that have a recorded routing.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Dict, Optional

import torch

from rlhf.models import moe


class RouteLog:
    """The routing of one model role (``mode``: off | R2 | R3; ``actor``: the trained policy) and its metrics."""

    def __init__(self, mode: str, model: torch.nn.Module, actor: bool):
        self.mode, self.model, self.actor = mode, model, actor
        self.k, self.experts = moe.top_k(model), moe.num_experts(model)
        self.logs = defaultdict(list)

    def replays(self, what: str) -> bool:
        """Whether forward ``what`` (ref | old | update) replays the batch's routed_experts."""
        return self.mode == "R3" or (self.mode == "R2" and self.actor and what == "update")

    @contextlib.contextmanager
    def forward(self, what: str, routed: Optional[torch.Tensor], attention_mask: torch.Tensor, packed: bool,
                keep: bool = False):
        """Around one forward of ``attention_mask``'s rows (padded, or ``packed`` into one row); ``routed``: their
        (rows, T, L*k) recorded routing or None.  ``keep``: the replay stays for the backward's recompute."""
        dev = attention_mask.device
        src = None if routed is None else moe.token_rows(routed.to(dev), attention_mask, packed)
        with moe.Routing(self.model, replay=src if self.replays(what) else None, record=True, keep=keep) as r:
            yield r
        real = moe.token_rows(attention_mask.unsqueeze(-1), attention_mask, packed)[:, 0].bool()
        if src is not None:
            valid = real & (src >= 0).all(-1)
            self.logs[f"router/{what}_mismatch"].append(moe.mismatch(r.used, src, self.k, valid))
            self.logs[f"router/{what}_mismatch_own"].append(moe.mismatch(r.natural, src, self.k, valid))
        if what == "update":
            for key, v in moe.load_metrics(r.used, self.k, self.experts, real).items():
                self.logs[key].append(v)

    def take(self) -> Dict[str, float]:
        """The means of the metrics since the last take."""
        out = {k: sum(v) / len(v) for k, v in self.logs.items() if v}
        self.logs.clear()
        return out


def route_log(mode: str, model: torch.nn.Module, actor: bool) -> Optional[RouteLog]:
    """A RouteLog for an MoE model (None for a dense one: nothing to route)."""
    return RouteLog(mode, model, actor) if moe.routers(model) else None


def routed_forward(route: Optional[RouteLog], what: str, batch, rows, attention_mask: torch.Tensor, packed: bool,
                   keep: bool = False):
    """``route.forward`` over ``batch``'s rows ``rows`` (a no-op context for a dense model)."""
    if route is None:
        return contextlib.nullcontext()
    routed = None if batch.routed_experts is None else batch.routed_experts[rows]
    return route.forward(what, routed, attention_mask, packed, keep)


def with_routing(lp: torch.Tensor, r: moe.Routing, attention_mask: torch.Tensor, packed: bool) -> torch.Tensor:
    """R2, in the old-log-prob forward: [log-probs (rows, R) | the routing it used, (rows, T * L*k) as float (ids
    < 2**24 are exact)], -1 off the real tokens, so both travel in the role's one row gather."""
    rows, T = attention_mask.shape
    real = attention_mask.bool()
    if packed:
        full = torch.full((rows, T, r.used.size(-1)), moe.NO_ROUTE, dtype=r.used.dtype, device=r.used.device)
        full[real] = r.used
    else:
        full = r.used.view(rows, T, -1).masked_fill(~real.unsqueeze(-1), moe.NO_ROUTE)
    return torch.cat([lp.float(), full.flatten(1).float().to(lp.device)], 1)


def record_width(role, batch) -> int:
    """The routing columns ``with_routing`` adds, (P + R) * L*k, the same on every rank of the role's gather
    (L*k from its members: one max), or 0 where the role records none."""
    if not role.records_routing:
        return 0
    from rlhf.distributed.sharding import gather_max

    d = role.route.k * len(moe.routers(role.route.model)) if role.route is not None else 0
    role.route_depth = gather_max([d], role.gather_group)[0]
    return batch.sequences.size(1) * role.route_depth


def keep_routing(role, out: torch.Tensor, batch) -> torch.Tensor:
    """The log-probs of ``out``; the routing columns (R2) go to ``role.recorded`` as (B, P + R, L*k) int64."""
    if not role.records_routing:
        return out
    R = batch.num_actions
    role.recorded = out[:, R:].round().long().view(out.size(0), batch.sequences.size(1), role.route_depth)
    return out[:, :R]


def route_metrics(role) -> Dict[str, float]:
    """The role's router metrics since the last call ({} for a role without MoE routing)."""
    return role.route.take() if role is not None and role.route is not None else {}
