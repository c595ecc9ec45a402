"""The memory plan as text (``python -m rlhf.plan --memory``, the start-up refusal): the table, the stages that
do not fit, vLLM's share and the flag sets that fit.
"""
from __future__ import annotations

from typing import Dict, List

from rlhf.planning import terms
from rlhf.planning.fixes import flags_text
from rlhf.planning.memory import CUDA_RESERVE
from rlhf.planning.plan_types import MemoryPlan, _ranges
from rlhf.planning.terms import GiB


def vllm_lines(plan: MemoryPlan) -> List[str]:
    """What vLLM's share holds on a rollout rank: its weights and, in the rest, how many full-length sequences'
    KV cache (vLLM refuses to start below one)."""
    j = plan.job
    if j.kind != "rl" or j.rollout_engine != "vllm" or plan.dims is None:
        return []
    d, tp = plan.dims, max(1, j.vllm_tensor_parallel_size)
    share = terms.vllm_share_bytes(j.vllm_gpu_memory_utilization, plan.device_bytes)
    weights = terms.vllm_weight_bytes(d.params, tp)
    per_seq = terms.kv_cache_bytes(d, 1, j.seq, 2) / tp
    seqs = (share - weights) / per_seq
    line = (f"vLLM per rank: share {share / GiB:.1f} GiB = weights {weights / GiB:.1f} GiB + KV cache and "
            f"activations {(share - weights) / GiB:.1f} GiB: about {max(0.0, seqs):.0f} sequences of "
            f"{j.seq} tokens at once")
    if seqs < 1:
        line += (f"; TOO SMALL: vLLM will not start (one sequence needs {per_seq / GiB:.2f} GiB of KV cache): raise "
                 f"--vllm_gpu_memory_utilization or --vllm_tensor_parallel_size")
    return [line]


def report(plan: MemoryPlan, suggestions: List[Dict]) -> str:
    lines = [plan.table()]
    lines += vllm_lines(plan)
    over = plan.overflows()
    if not over:
        g, s = plan.worst()
        lines.append(f"fits: the largest peak is {s.name} on ranks {_ranges(g.ranks)}: {s.total / GiB:.1f} of "
                     f"{plan.device_bytes / GiB:.1f} GiB")
        return "\n".join(lines)
    if plan.device_bytes <= CUDA_RESERVE and any("runtime" in s.parts for g in plan.groups for s in g.stages):
        g, s = plan.worst()
        lines.append(f"the device ({plan.device_bytes / GiB:.2f} GiB per rank) is no larger than the "
                     f"{CUDA_RESERVE / GiB:.1f} GiB runtime reserve every CUDA rank holds before any model; this job's "
                     f"largest stage, {s.name}, needs {s.total / GiB:.2f} GiB at this size (python -m rlhf.train_* "
                     f"names the smallest --gpu_memory_gb that fits)")
        return "\n".join(lines)
    for g, s, by in over:
        lines.append(f"OVERFLOW: {s.name} on ranks {_ranges(g.ranks)} needs {s.total / GiB:.1f} GiB of "
                     f"{plan.device_bytes / GiB:.1f} GiB ({by / GiB:.1f} GiB over)")
    if suggestions:
        for ch in suggestions:
            lines.append(f"fits with: {flags_text(ch)}")
    else:
        lines.append("no flag set found that fits: more ranks (a larger --actor_num_nodes), or a smaller model")
    return "\n".join(lines)



def _gib(x: float) -> str:
    return f"{x / GiB:.1f}" if x >= 10 * GiB else f"{x / GiB:.2f}"
