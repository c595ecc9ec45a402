"""Tensor parallelism (--tp_size) and hybrid sharding (--fsdp_shard_size) of a model role: its DeviceMesh, the
TP plan per architecture, and the gradient clipping over parameters that live on different sub-meshes.

A model role's ranks are ``dp x tp x sp`` (``Placement.dims``; ``sp`` innermost so an SP group stays consecutive
ranks).  FSDP2 shards over the ranks that share a ``tp`` coordinate (``dp x sp`` flattened, torchtitan's
``dp_shard_cp``), split into ``dp_replicate x dp_shard`` with --fsdp_shard_size (HSDP: shard inside a group,
replicate across, veRL's ``fsdp_size``).  The role's DeviceMesh is ``(dp_replicate?, dp_shard, tp?)``, built with
``DeviceMesh.from_group`` over process groups every rank created in one order (``build_dim_groups``), as
torchtitan's ``ParallelDims.build_mesh`` (torchtitan/distributed/parallel_dims.py) builds it with
``init_device_mesh`` over the whole world (a role here is a sub-range of the world).

The plan follows torchtitan/models/llama3/parallelize.py ``apply_tp``: q/k/v and gate/up ``ColwiseParallel``,
o/down ``RowwiseParallel``, the embedding ``RowwiseParallel(input_layouts=Replicate())``, the LM head
``ColwiseParallel(output_layouts=Replicate())`` (its own forward gathers the logits; the fused head of
rlhf.models.vocab_parallel reads its vocabulary shard instead).  Which projections split comes from the model
config's own ``base_model_tp_plan`` (transformers' per-architecture plan: "colwise" / "rowwise" /
"replicated_with_grad_allreduce" for Qwen3's per-head q/k norms), mapped onto torch's ParallelStyles.  Norms stay
replicated and compute on the replicated hidden states (no Megatron sequence-parallel norms: activations are
split by Ulysses, --ring_attn_size, which composes with TP by splitting the rank's local heads).  Attention reads
its head count from the projection's output shape (transformers' ``view(*shape, -1, head_dim)``), so a rank runs
its ``heads / tp`` local heads.  MoE experts (Qwen3-MoE's ``mlp.experts``) stay whole on every TP rank (expert
parallelism is --ep_size's); their attention and dense MLPs follow the plan.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from rlhf.distributed import comm
from rlhf.errors import TopologyError

TP_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")  # model_type values with a tested plan
PARTIAL = "replicated_with_grad_allreduce"  # transformers' style: replicated weight, per-rank partial gradient


# ---- the placement: sizes and the DeviceMesh's ranks -----------------------------------------------------------
def with_tp(plan, tp: int, shard: int):
    """``plan`` with --tp_size / --fsdp_shard_size checked against every model role's ranks (TopologyError naming
    the flag and a value that works).  TP groups stay inside a node; FSDP ranks per TP coordinate = ranks/(tp)."""
    from rlhf.distributed.role_table import sp_role_names

    tp, shard = int(tp or 1), int(shard or 0)
    gpn = plan.gpus_per_node
    if tp < 1 or gpn % tp:
        ok = max(k for k in range(1, gpn + 1) if gpn % k == 0 and k <= max(tp, 1))
        raise TopologyError(f"--tp_size {tp} must divide the ranks per node ({gpn}): a TP group stays inside a node; "
                            f"use --tp_size {ok}")
    for role in sp_role_names():
        n = len(plan.ranks.get(role) or [])
        sp = plan.sp_size if role in plan.sp_groups else 1
        if n and n % (tp * sp):
            raise TopologyError(f"--tp_size {tp} x --ring_attn_size {sp} must divide the {role}'s {n} ranks; use "
                                f"--tp_size {max(k for k in range(1, tp + 1) if n % (k * sp) == 0)}")
        fsdp = n // (tp * sp) * sp
        if n and shard and (shard < 1 or fsdp % shard):
            ok = [k for k in range(1, fsdp + 1) if fsdp % k == 0]
            raise TopologyError(f"--fsdp_shard_size {shard} must divide the {role}'s {fsdp} FSDP ranks ({n} ranks / "
                                f"--tp_size {tp}); use one of {ok} (0: shard over all of them)")
    plan.tp_size, plan.fsdp_shard_size = tp, shard
    return plan


def mesh_ranks(mesh) -> Optional[torch.Tensor]:
    """The global ranks of ``mesh`` (a RoleMesh of dims dp[, tp], sp) as a (dp_replicate, dp_shard, tp) tensor, or
    None where neither TP nor HSDP applies (FSDP2 then shards over the role's group, as before).

        fsdp index f = dp * sp_size + sp;  f = replicate * shard_size + shard;  member index = (dp*tp + tp)*sp + sp"""
    tp = mesh.size_of("tp")
    fsdp = mesh.size // tp
    shard = mesh.shard_size if 0 < mesh.shard_size < fsdp else fsdp
    if tp == 1 and shard == fsdp:
        return None
    sp = mesh.size_of("sp")
    out = torch.empty((fsdp // shard, shard, tp), dtype=torch.long)
    for f in range(fsdp):
        for t in range(tp):
            out[f // shard, f % shard, t] = mesh.ranks[((f // sp) * tp + t) * sp + f % sp]
    return out


def dim_names(ranks: torch.Tensor) -> List[str]:
    """The DeviceMesh's dimensions: dp_replicate (HSDP only), dp_shard, tp (TP only)."""
    names = ["dp_replicate", "dp_shard", "tp"]
    return [n for i, n in enumerate(names) if ranks.size(i) > 1 or n == "dp_shard"]


def _lines(ranks: torch.Tensor, dim: int) -> List[List[int]]:
    """Every group of ranks that differ only along ``dim`` of the (rep, shard, tp) tensor."""
    moved = ranks.movedim(dim, -1).reshape(-1, ranks.size(dim))
    return [row.tolist() for row in moved]


def build_dim_groups(mesh, make) -> None:
    """The process groups of ``mesh``'s DeviceMesh dimensions (``make(ranks)``: collective, every rank, one order),
    kept in ``mesh.dim_groups`` under the dimension's name on its members."""
    ranks = mesh_ranks(mesh)
    if ranks is None:
        return
    for name in dim_names(ranks):
        for line in _lines(ranks, ["dp_replicate", "dp_shard", "tp"].index(name)):
            grp = make(line)
            if mesh.rank in line:
                mesh.dim_groups[name] = grp


def role_device_mesh(mesh, device_type: str):
    """``mesh``'s DeviceMesh (dims ``dim_names``) over the groups ``build_dim_groups`` made, or None (no TP, no
    HSDP).  ``DeviceMesh.from_group`` with one group per dimension (torch/distributed/device_mesh.py)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh_ranks(mesh)
    if ranks is None:
        return None
    names = dim_names(ranks)
    keep = [i for i, n in enumerate(["dp_replicate", "dp_shard", "tp"]) if n in names]
    shaped = ranks.reshape([ranks.size(i) for i in keep])
    return DeviceMesh.from_group([mesh.dim_groups[n] for n in names], device_type, mesh=shaped,
                                 mesh_dim_names=tuple(names))


def fsdp_submesh(dm):
    """The (dp_replicate, dp_shard) or (dp_shard) sub-mesh FSDP2 shards over (2-D: HSDP)."""
    names = dm.mesh_dim_names
    return dm["dp_replicate", "dp_shard"] if "dp_replicate" in names else dm["dp_shard"]


# ---- the plan ------------------------------------------------------------------------------------------------
def with_config(model):
    """The transformers model that carries the config: ``model``, or a critic's ``backbone``
    (rlhf.models.critic.CriticModel: backbone + value head)."""
    return model if hasattr(model, "config") else model.backbone


def model_type(model) -> str:
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return str(getattr(cfg, "model_type", type(model).__name__))


def layer_plan(model) -> Dict[str, str]:
    """The decoder layer's submodule -> style ("colwise", "rowwise", PARTIAL) from the config's
    ``base_model_tp_plan`` ("layers.*.self_attn.q_proj": "colwise"); expert entries are left out (experts stay
    whole).  Raises ValueError naming the architecture where it has no plan here."""
    model = with_config(model)
    kind = model_type(model)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    plan = dict(getattr(cfg, "base_model_tp_plan", None) or {})
    if kind not in TP_FAMILIES or not plan:
        raise ValueError(f"--tp_size: no tensor-parallel plan for the {kind!r} architecture (plans: "
                         f"{', '.join(TP_FAMILIES)}); use --tp_size 1")
    out = {}
    for key, style in plan.items():
        if not key.startswith("layers.*.") or ".experts" in key:
            continue
        if style not in ("colwise", "rowwise", PARTIAL):
            raise ValueError(f"--tp_size: {kind} plan entry {key}={style!r} has no torch ParallelStyle here; "
                             f"use --tp_size 1")
        out[key[len("layers.*."):]] = style
    return out


def check_heads(heads: int, kv_heads: int, tp: int, sp: int = 1) -> None:
    """Every TP rank runs heads/tp query and kv_heads/tp key/value heads, which Ulysses splits again by sp."""
    if heads % (tp * sp) or kv_heads % (tp * sp):
        ok = max(k for k in range(1, tp + 1) if heads % (k * sp) == 0 and kv_heads % (k * sp) == 0)
        raise ValueError(f"--tp_size {tp} (x --ring_attn_size {sp}) must divide the model's attention heads ({heads}) "
                         f"and key/value heads ({kv_heads}); use --tp_size {ok}")


def apply_tp(model: torch.nn.Module, tp_mesh, layers, sp: int = 1) -> List[str]:
    """Parallelize ``model`` in place over the 1-D ``tp_mesh`` (``parallelize_module``): each decoder layer of
    ``layers`` by ``layer_plan``, the input embedding row-wise, the LM head (if any) column-wise with gathered
    logits; a tied head is tied again to the sharded embedding.  Returns the names of the parameters whose
    gradients are per-rank partial sums (PARTIAL: all-reduced over TP before the step, ``tp_partial_grads``)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = {id(m): n for n, m in model.named_modules()}  # the engine's names (a critic's: "backbone. ...")
    model = with_config(model)  # a critic: its backbone (the value head stays replicated: replicated hidden states)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    check_heads(int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None) or
                                                  cfg.num_attention_heads), tp_mesh.size(), sp)
    plan = layer_plan(model)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    partial = []
    for layer in layers:
        for rel, style in plan.items():
            try:
                sub = layer.get_submodule(rel)
            except AttributeError:  # e.g. Qwen3-MoE's dense gate/up/down on a sparse layer
                continue
            if style == PARTIAL:
                partial += [f"{names[id(sub)]}.{p}" for p, _ in sub.named_parameters()]
            else:
                parallelize_module(sub, tp_mesh, styles[style]())
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is emb.weight
    parallelize_module(emb, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if head is not None:
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
        if tied:
            head.weight = emb.weight
    return partial


# ---- the step ------------------------------------------------------------------------------------------------
def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if hasattr(g, "to_local") else g


def tp_partial_grads(model: torch.nn.Module, names: List[str], tp_group) -> None:
    """Sum the PARTIAL parameters' gradients over the TP group (each rank's holds its own heads' share)."""
    params = dict(model.named_parameters())
    for n in names:
        g = params[n].grad
        if g is not None:
            comm.all_reduce(_local(g), group=tp_group)


def clip_grad_norm(params: List[torch.Tensor], max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ over gradients on different meshes (TP's 2-D (dp_shard, tp) DTensors, the
    replicated parameters' 1-D dp_shard ones): the norm of each mesh's group (``get_total_norm``, a DTensor
    reduced by ``full_tensor``), combined as sqrt(sum of squares); then every gradient times
    min(1, max_norm / (norm + 1e-6)).  Returns the total norm."""
    groups: Dict[object, List[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = getattr(p.grad, "device_mesh", None)
            groups.setdefault((id(mesh), getattr(p.grad, "placements", None)), []).append(p.grad)
    sq = 0.0
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        n = n.full_tensor() if hasattr(n, "full_tensor") else n
        sq += float(n) ** 2
    total = sq ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1.0 and total == total:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total
