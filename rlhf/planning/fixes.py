"""When a plan does not fit: the flag sets that do (``suggest``: micro-batch, checkpointing, offload, sleep,
sequence parallelism, vLLM's share...), each checked by re-planning; ``plan_with_fixes`` plans a job and finds them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from rlhf.planning.dims import ModelDims
from rlhf.planning.job import DEFAULT_GPU_GB, Job
from rlhf.planning.memory import plan_memory
from rlhf.planning.plan_types import MemoryPlan
from rlhf.planning.terms import GiB


def device_budget(gpu_memory_gb: Optional[float]) -> float:
    """Bytes per rank to plan against: --gpu_memory_gb, else DEFAULT_GPU_GB (an H100)."""
    return (gpu_memory_gb if gpu_memory_gb is not None else DEFAULT_GPU_GB) * GiB


def plan_with_fixes(job: Job, dims: Dict[str, ModelDims], placement=None, world: int = 1,
                    device_bytes: float = DEFAULT_GPU_GB * GiB, on_cuda: bool = True,
                    vllm_installed: bool = True) -> Tuple[MemoryPlan, List[Dict]]:
    """The plan of a job (``job_from_flags``, ``role_dims``) and the flag sets that fit when it does not (each
    checked by re-planning)."""
    job = job.on(on_cuda, vllm_installed)

    def replan(j: Job) -> MemoryPlan:
        return plan_memory(j, dims, placement, world, device_bytes, on_cuda)

    plan = replan(job)
    colocated = bool(placement is not None and placement.colocated)
    group = max(len(r) for r in placement.ranks.values()) if placement is not None else world
    per_node = placement.gpus_per_node if placement is not None else world
    return plan, suggest(plan, replan, colocated, max_sp=_max_sp(group, per_node))


def _max_sp(group: int, per_node: int) -> int:
    """The largest power of two dividing both the role's ranks and the ranks per node (an SP group stays in a
    node), at most 8."""
    sp = 1
    while sp < 8 and group % (sp * 2) == 0 and per_node % (sp * 2) == 0:
        sp *= 2
    return sp


# ---- suggestions -----------------------------------------------------------------------------------------------
def _candidates(job: Job, colocated: bool, max_sp: int, dims: Optional[ModelDims] = None) -> List[Dict]:
    """Single changes that lower some stage's peak, most benign first."""
    out: List[Dict] = []
    if not job.gradient_checkpointing:
        out.append({"gradient_checkpointing": True})
    if colocated and not job.sleeps:
        out.append({"vllm_enable_sleep": True, "deepspeed_enable_sleep": True})
    if job.zero_stage < 3:
        out.append({"zero_stage": 3})
    if job.lm_head_keep_mb > 0:
        out.append({"lm_head_keep_mb": 0})
    m = job.micro_train_batch_size
    while m > 1:
        m //= 2
        out.append({"micro_train_batch_size": m})
    m = job.micro_rollout_batch_size
    while m > 1:
        m //= 2
        out.append({"micro_rollout_batch_size": m})
    if job.rollout_engine == "vllm":
        for u in (0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2):
            if u < job.vllm_gpu_memory_utilization:
                out.append({"vllm_gpu_memory_utilization": u})
    sp = job.ring_attn_size  # Ulysses (rlhf/distributed/sequence_parallel.py check_sp): packed rows, heads and kv
    while sp * 2 <= max_sp and job.kind != "rm":  # heads divisible by the group, not for train_rm
        sp *= 2
        if dims is not None and (dims.heads % sp or dims.kv_heads % sp):
            break
        out.append({"ring_attn_size": sp} if job.packing_samples else {"ring_attn_size": sp, "packing_samples": True})
    if job.fsdp_shard_size:  # HSDP shards over fewer ranks: sharding over all of them holds less per rank
        out.append({"fsdp_shard_size": 0})
    tp = job.tp_size  # --tp_size (rlhf/distributed/tensor_parallel.py): FSDP2, RL trainers, no LoRA, heads divisible
    while tp * 2 * job.ring_attn_size <= max_sp and job.kind == "rl" and job.backend == "fsdp2" and not job.lora_rank:
        tp *= 2
        if dims is not None and (dims.heads % (tp * job.ring_attn_size) or dims.kv_heads % (tp * job.ring_attn_size)):
            break
        out.append({"tp_size": tp})
    if not job.adam_offload:
        out.append({"adam_offload": True})
    return out


def suggest(plan: MemoryPlan, replan, colocated: bool = True, max_sp: int = 8, limit: int = 3) -> List[Dict]:
    """Flag sets that fit, each checked by ``replan(job) -> MemoryPlan``: first the single changes that fit alone,
    else changes accumulated in order (each kept only if it lowers the worst stage) until the plan fits."""
    if plan.fits:
        return []
    job = plan.job
    singles, seen = [], set()
    for ch in _candidates(job, colocated, max_sp, plan.dims):
        key = tuple(sorted(ch))  # one suggestion per flag: the first value that fits is the mildest
        if key in seen:
            continue
        if replan(replace(job, **ch)).fits:
            seen.add(key)
            singles.append(ch)
            if len(singles) >= limit:
                break
    if singles:
        return singles
    acc: Dict = {}
    cur = job
    worst = plan.worst()[1].total
    for ch in _candidates(job, colocated, max_sp, plan.dims):
        trial = replace(cur, **ch)
        p = replan(trial)
        if p.worst()[1].total < worst:
            cur, worst = trial, p.worst()[1].total
            for k in ch:
                acc.pop(k, None)
            acc.update(ch)
            if p.fits:
                return [acc]
    return []


def flags_text(change: Dict) -> str:
    parts = []
    for k, v in change.items():
        parts.append(f"--{k}" if v is True else f"--{k} {v}")
    return " ".join(parts)
