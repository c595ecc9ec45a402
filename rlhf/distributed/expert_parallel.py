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
from typing import List, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlhf.distributed import comm

WEIGHTS = ("gate_up_proj", "down_proj")


def expert_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The ``experts`` children beside a router (rlhf.models.moe.routers' rule), in layer order."""
    return [m.experts for m in model.modules() if isinstance(getattr(m, "gate", None), torch.nn.Module)
            and isinstance(getattr(m, "experts", None), torch.nn.Module)]


def shard_experts(model: torch.nn.Module, mesh) -> int:
    """Shard every experts module of ``model`` over the DeviceMesh ``mesh`` and route its tokens by all-to-all;
    returns the experts each rank keeps.  ``mesh``: 1-D (the ep group) or 2-D ``(dp_mod_ep, ep)`` (``ep_device_mesh``:
    placements ``(Replicate, Shard(0))``, the shard replicated over the dp_mod_ep ranks, so ``full_tensor`` and the
    shard weight sync see every block once).  E must divide by the ep size.  Each rank keeps its slice of the
    stack it holds (replicated or on meta): no communication."""
    ep_mesh = mesh[mesh.mesh_dim_names[-1]] if mesh.ndim > 1 else mesh
    ep, me = ep_mesh.size(), ep_mesh.get_local_rank()
    places = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
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
            old = getattr(mod, name)
            full = old.detach()
            local = DTensor.from_local(full[me * per:(me + 1) * per].clone(), mesh, places, run_check=False,
                                       shape=full.shape, stride=full.stride())
            setattr(mod, name, torch.nn.Parameter(local, requires_grad=old.requires_grad))
        mod.ep_group, mod.ep_rank, mod.local_experts = ep_mesh.get_group(), me, per
        mod.forward = types.MethodType(ep_forward, mod)
    return per


def ep_device_mesh(mesh, device_type: str):
    """The ``(dp_mod_ep, ep)`` DeviceMesh of a RoleMesh with ``ep_size > 1`` over the groups ``build_ep_groups``
    made (torchtitan's ``dp_shard_mod_ep`` x ``ep``, torchtitan/distributed/parallel_dims.py)."""
    from torch.distributed.device_mesh import DeviceMesh

    ep = mesh.ep_size
    ranks = torch.tensor(mesh.ranks, dtype=torch.long).reshape(-1, ep)
    return DeviceMesh.from_group([mesh.dim_groups["dp_mod_ep"], mesh.dim_groups["ep"]], device_type, mesh=ranks,
                                 mesh_dim_names=("dp_mod_ep", "ep"))


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
    gate_up, down = _local(mod.gate_up_proj).to(x.dtype), _local(mod.down_proj).to(x.dtype)  # FSDP2 bf16 compute
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


# ---- the role's ep dimension (--ep_size): groups, gradients ---------------------------------------------------
EP_ROLES = ("actor", "ref")  # the roles --ep_size shards (the policy's MoE and its frozen copy)


def ep_of(plan, role: str) -> int:
    """``role``'s expert-parallel size in ``plan`` (1: not an EP role)."""
    return int(plan.ep_size) if role in EP_ROLES else 1


def with_ep(plan, ep: int):
    """``plan`` with --ep_size checked against the EP roles' ranks (TopologyError naming a value that works): the
    ep ranks are consecutive FSDP ranks of the role (torchtitan's ``dp_shard_in_ep``), so ep divides them."""
    from rlhf.errors import TopologyError

    ep = int(ep or 1)
    for role in EP_ROLES:
        n = len(plan.ranks.get(role) or [])
        if n and (ep < 1 or n % ep):
            ok = [k for k in range(1, n + 1) if n % k == 0]
            raise TopologyError(f"--ep_size {ep} must divide the {role}'s {n} ranks; use one of {ok}")
    plan.ep_size = ep
    return plan


def ep_lines(members: List[int], ep: int) -> Tuple[List[List[int]], List[List[int]]]:
    """The ``ep`` groups (consecutive chunks of ``ep`` of the role's FSDP ranks ``members``: torchtitan's
    ``dp_shard_in_ep``, innermost) and the ``dp_mod_ep`` groups (members with the same ep coordinate: torchtitan's
    ``dp_shard_mod_ep``, over which an expert shard is replicated), as lists of global ranks."""
    n = len(members)
    return ([members[i:i + ep] for i in range(0, n, ep)], [members[j::ep] for j in range(ep)])


def build_ep_groups(mesh, make) -> None:
    """``mesh.dim_groups["ep"]`` / ``["dp_mod_ep"]`` where ``mesh.ep_size > 1`` (``make(ranks)``: collective, every
    rank, one order, as tensor_parallel.build_dim_groups)."""
    if getattr(mesh, "ep_size", 1) <= 1:
        return
    ep, mod = ep_lines(mesh.ranks, mesh.ep_size)
    for name, lines in (("ep", ep), ("dp_mod_ep", mod)):
        for line in lines:
            grp = make(line)
            if mesh.rank in line:
                mesh.dim_groups[name] = grp


def expert_params(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The stacked expert weights (``WEIGHTS`` of every experts module): FSDP2's ``ignored_params`` under EP."""
    return [getattr(m, n) for m in expert_modules(model) for n in WEIGHTS]


def reduce_expert_grads(params: List[torch.nn.Parameter], mod_group, dp: int) -> None:
    """Expert gradients to the data-parallel mean, as FSDP2 leaves the dense ones (torchtitan sets the experts'
    FSDP ``gradient_divide_factor`` to the whole dp size, torchtitan/models/llama4/infra/parallelize.py):

        g_e = (sum over the dp_mod_ep ranks of the local g_e) / dp

    where the all-to-all's backward already summed every ep rank's tokens into the local g_e."""
    for p in params:
        if p.grad is None:
            continue
        g = _local(p.grad)
        if mod_group is not None and comm.world_size(mod_group) > 1:
            comm.all_reduce(g, group=mod_group)
        g.div_(dp)
