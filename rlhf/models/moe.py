"""Mixture-of-experts routers: find them, record their top-k choices, replay given choices, and the load metrics.

A router is the ``gate`` child of a module that also has an ``experts`` child (transformers 5.x
``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock``); its forward returns
``(router_logits (T, E), router_scores (T, k), router_indices (T, k))`` over the T = rows x columns tokens of the
call, flattened row-major (transformers/models/qwen3_moe/modeling_qwen3_moe.py ``Qwen3MoeTopKRouter``).

Routing replay (veRL ``actor.router_replay.mode`` R2 / R3, verl/utils/megatron/router_replay_patch.py; NeMo-RL
PR #2590): the router's own softmax is kept, only the top-k *selection* is replaced by the given ids, so the
gradient still reaches the router through the chosen experts' probabilities:

    p = softmax(logits)      ids = replay ids (the router's own top-k where a token has none: -1)
    w = p[ids]  (/ sum_j p[ids_j]  where the router normalizes its top-k: norm_topk_prob, Mixtral always)

A routing record is (T, L * k) int64, layer-major (column ``l * k + j`` is layer l's j-th choice), -1 = none.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

NO_ROUTE = -1  # a token with no recorded routing (padding; a response's last token, never fed back)


class RouterState:
    """What the hooks of one model read and write: ``replay`` (T, L*k) ids to use, or None (the router's own);
    ``record``: None, or a list that receives (natural ids (T, k), used ids (T, k)) per router call."""

    def __init__(self, routers: List[torch.nn.Module]):
        self.routers, self.replay, self.record = routers, None, None


def routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's routers in layer order (empty for a dense model)."""
    return [m.gate for m in model.modules() if isinstance(getattr(m, "gate", None), torch.nn.Module)
            and isinstance(getattr(m, "experts", None), torch.nn.Module)]


def top_k(model: torch.nn.Module) -> int:
    """k: experts per token (the first router's ``top_k``)."""
    return int(routers(model)[0].top_k)


def install(model: torch.nn.Module) -> Optional[RouterState]:
    """Hooks on every router (once per model; None for a dense model).  They stay (a gradient-checkpointed
    recompute in backward runs the same routing as its forward)."""
    rs = routers(model)
    if not rs:
        return None
    state = getattr(model, "_rlhf_router_state", None)
    if state is None:
        state = RouterState(rs)
        for layer, r in enumerate(rs):
            r.register_forward_hook(_hook(state, layer))
        model._rlhf_router_state = state
    return state


def _hook(state: RouterState, layer: int):
    def hook(mod, args, out):
        logits, scores, natural = out[0], out[1], out[2]
        used = natural
        if state.replay is not None:
            k = natural.size(-1)
            ids = state.replay[:, layer * k:(layer + 1) * k].to(natural.device)
            if ids.size(0) != natural.size(0):
                raise ValueError(f"router replay: {ids.size(0)} recorded tokens for a forward of {natural.size(0)} "
                                 f"(layer {layer}): the routing record and the forward's token layout differ")
            used = torch.where(ids >= 0, ids, natural)
            probs = torch.softmax(logits.float(), dim=-1)
            w = probs.gather(-1, used)
            if getattr(mod, "norm_topk_prob", True):
                w = w / w.sum(-1, keepdim=True)
            out = (logits, w.to(scores.dtype), used)
        if state.record is not None:
            state.record.append((natural.detach(), used.detach()))
        return out
    return hook


class Routing:
    """``with Routing(model, replay=ids, record=True) as r:`` one forward; ``r.natural`` / ``r.used``: (T, L*k)
    the router's own top-k and the ids it used (equal without replay).  A dense model: does nothing (None)."""

    def __init__(self, model, replay: Optional[torch.Tensor] = None, record: bool = False, keep: bool = False):
        self.state, self.replay, self.rec, self.keep = install(model), replay, record, keep
        self.natural = self.used = None

    def __enter__(self):
        if self.state is not None:
            self.state.replay = self.replay
            self.state.record = [] if self.rec else None
        return self

    def __exit__(self, *exc):
        if self.state is None:
            return
        rec, self.state.record = self.state.record, None
        if not self.keep:  # keep: the update's backward may recompute (gradient checkpointing) with the same ids
            self.state.replay = None
        if rec:
            self.natural = torch.cat([n for n, _ in rec], 1)
            self.used = torch.cat([u for _, u in rec], 1)


def clear(model) -> None:
    """Drop a replay that ``Routing(keep=True)`` left in place."""
    state = getattr(model, "_rlhf_router_state", None)
    if state is not None:
        state.replay = None


def token_rows(routed: torch.Tensor, attention_mask: torch.Tensor, packed: bool) -> torch.Tensor:
    """A batch's (B, T, L*k) routing in the forward's token order: padded ``(B*T, L*k)``, packed (one row of the
    real tokens) ``routed[attention_mask]``."""
    if packed:
        return routed[attention_mask.bool()]
    return routed.reshape(-1, routed.size(-1))


def mismatch(a: torch.Tensor, b: torch.Tensor, k: int, valid: torch.Tensor) -> float:
    """The fraction of ``valid`` tokens (of (T, L*k) records ``a``, ``b``) whose expert set differs in any layer
    (order inside a layer's top-k ignored)."""
    if not bool(valid.any()):
        return 0.0
    L = a.size(-1) // k
    sa = a.view(-1, L, k).sort(-1).values
    sb = b.view(-1, L, k).sort(-1).values
    differ = (sa != sb).any(-1).any(-1)
    return float(differ[valid].float().mean())


def load_metrics(used: torch.Tensor, k: int, num_experts: int, valid: torch.Tensor) -> Dict[str, float]:
    """Per layer l: ``router/load_max_l{l}`` = max_e n_e / mean_e n_e (n_e: valid tokens routed to expert e; 1.0
    is perfectly balanced, E/k the worst), and its mean over layers ``router/load_max``.  HF's experts are dropless
    (no capacity factor): every routed token is computed, so there is no dropped-token count to report."""
    L = used.size(-1) // k
    ids = used[valid].view(-1, L, k)
    out, ratios = {}, []
    for layer in range(L):
        n = torch.bincount(ids[:, layer].reshape(-1), minlength=num_experts).float()
        r = float(n.max() / n.mean()) if n.sum() > 0 else 1.0
        out[f"router/load_max_l{layer}"] = r
        ratios.append(r)
    out["router/load_max"] = sum(ratios) / max(len(ratios), 1)
    return out


def num_experts(model) -> int:
    return int(routers(model)[0].num_experts)


def set_experts(model, implementation: str) -> None:
    """--experts_implementation: transformers' ``set_experts_implementation`` on an MoE model (``auto``, or a dense
    model: nothing).  A wrapper (the critic's ``CriticModel``, an FSDP or LoRA wrapper) is set through its outermost
    transformers model, which dispatches to its sub-models; the experts read it from the shared config."""
    if implementation == "auto" or not routers(model):
        return
    from transformers import PreTrainedModel

    top = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if top is None:
        raise TypeError(f"--experts_implementation {implementation}: {type(model).__name__} holds MoE experts but no "
                        f"transformers model to set them on; use --experts_implementation auto")
    top.set_experts_implementation(implementation)


def checkpoint_layout(named_tensors):
    """transformers 5's stacked expert weights under the per-expert names its checkpoints keep (save_pretrained
    reverses its MoE merge, transformers/conversion_mapping.py) and vLLM's loaders read:
    ``...experts.gate_up_proj`` (E, 2I, H) -> ``...experts.{e}.gate_proj.weight`` = rows [0, I) of expert e and
    ``...experts.{e}.up_proj.weight`` = rows [I, 2I); ``...experts.down_proj`` (E, H, I) ->
    ``...experts.{e}.down_proj.weight``; every other (name, tensor) as it is.  The one mapping of every weight
    path to vLLM: ``rlhf.distributed.expert_names.per_expert``."""
    from rlhf.distributed.expert_names import per_expert

    return per_expert(named_tensors)
