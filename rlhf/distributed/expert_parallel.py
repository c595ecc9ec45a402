"""Expert parallelism: an MoE layer's experts sharded over the ranks of an ``ep`` group, tokens dispatched to the
rank holding their expert by all-to-all and combined back (issue 45 item 3).

The stacked expert weights of transformers 5.x (``Qwen3MoeExperts`` / ``MixtralExperts``: ``gate_up_proj``
(E, 2I, H), ``down_proj`` (E, H, I)) become DTensors ``Shard(0)`` on a 1-D mesh over the group: rank r keeps
experts ``[r * E/ep, (r + 1) * E/ep)``; ``full_tensor()`` gives the whole stack back (checkpoint, weight sync).
The forward (torchtitan torchtitan/distributed/expert_parallel.py ``ExpertParallel``: ``_token_dispatch`` /
``_token_combine``; dropless, no capacity factor):

    assignments a = (token t, slot j) sorted by expert e = top_k_index[t, j]      (T * k rows)
    send        rows of a to rank e // (E/ep)                                    (comm.all_to_all_v)
    compute     y = down_e( act(gate_e x) * up_e x ) for each local expert e      (the eager loop's math)
    combine     rows back by the reverse all-to-all; out[t] += top_k_weights[t, j] * y

so every token gets the same experts and weights as without EP, and each expert's gradient is the sum over
every rank's tokens (the all-to-all's backward brings them home).  Every rank of the group must call each
layer's forward (the all-to-alls are collectives), as under FSDP.
"""
from __future__ import annotations

import types
from typing import List

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from rlhf.distributed import comm

WEIGHTS = ("gate_up_proj", "down_proj")


def expert_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The ``experts`` children beside a router (rlhf.models.moe.routers' rule), in layer order."""
    return [m.experts for m in model.modules() if isinstance(getattr(m, "gate", None), torch.nn.Module)
            and isinstance(getattr(m, "experts", None), torch.nn.Module)]


def shard_experts(model: torch.nn.Module, mesh) -> int:
    """Shard every experts module of ``model`` over the 1-D DeviceMesh ``mesh`` (its group is the ep group) and
    route its tokens by all-to-all; returns the experts each rank keeps.  E must divide by the mesh size."""
    ep = mesh.size()
    mods = expert_modules(model)
    if not mods:
        raise ValueError("--ep_size: the model has no MoE experts (a module with 'gate' and 'experts' children)")
    per = 0
    for mod in mods:
        E = mod.num_experts
        if E % ep:
            raise ValueError(f"--ep_size {ep}: the model's {E} experts do not split evenly; use a divisor of {E}")
        per = E // ep
        for name in WEIGHTS:
            full = getattr(mod, name).detach()
            setattr(mod, name, torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)])))
        mod.ep_group, mod.ep_rank, mod.local_experts = mesh.get_group(), mesh.get_local_rank(), per
        mod.forward = types.MethodType(ep_forward, mod)
    return per


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def ep_forward(mod, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The experts' forward under EP (module docstring): (T, H) in, (T, H) out."""
    T, k = top_k_index.shape
    n = mod.local_experts
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    token = order // k
    send = torch.bincount(expert // n, minlength=comm.world_size(mod.ep_group))
    x, recv = comm.all_to_all_v(hidden_states[token], send.tolist(), mod.ep_group)
    local_e, _ = comm.all_to_all_v((expert % n).unsqueeze(1), send.tolist(), mod.ep_group)
    local_e = local_e[:, 0]
    gate_up, down = _local(mod.gate_up_proj), _local(mod.down_proj)
    y = torch.zeros_like(x)
    for e in range(n):
        rows = (local_e == e).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        g, u = torch.nn.functional.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = y.index_copy(0, rows, torch.nn.functional.linear(mod.act_fn(g) * u, down[e]))
    back, _ = comm.all_to_all_v(y, recv, mod.ep_group)
    w = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, token, (back * w).to(out.dtype))
