"""The trainers' start-up memory check (rlhf/config/preflight.py ``memory_notices``): the job planned against this
rank's free GPU memory (or --gpu_memory_gb) before any model loads; a stage that cannot fit is refused
(``MemoryPlanError``) naming the stage, the numbers and the flags that fit, unless --skip_memory_check.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from rlhf.errors import MemoryPlanError
from rlhf.planning.fixes import flags_text, plan_with_fixes
from rlhf.planning.job import Job
from rlhf.planning.memory import CUDA_RESERVE, plan_memory, role_dims
from rlhf.planning.plan_types import _ranges
from rlhf.planning.report import _gib
from rlhf.planning.terms import GiB


def free_device_bytes() -> Tuple[float, float, int]:
    """(free bytes, total bytes, index) of this rank's GPU (LOCAL_RANK, as comm picks it) at start-up:
    ``torch.cuda.mem_get_info``, which creates this process's CUDA context on that device first, so the context
    is already out of the free figure."""
    import os

    import torch

    local = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
    free, total = torch.cuda.mem_get_info(local)
    return float(free), float(total), local


def smallest_device(plan_at, start: float) -> float:
    """The smallest device size (bytes, a multiple of 0.1 GiB) whose plan fits, ``plan_at(bytes) -> MemoryPlan``:
    vLLM's share grows with the device (--vllm_gpu_memory_utilization x memory), so the size is iterated from
    ``start`` (the worst stage at the current size) until the plan at that size fits."""
    import math

    def up(x: float) -> float:
        return math.ceil(x / GiB * 10 - 1e-9) / 10 * GiB

    dev = up(start)
    for _ in range(200):
        need = plan_at(dev).worst()[1].total
        if need <= dev:
            return dev
        dev = max(up(need), dev + 0.1 * GiB)
    return dev


def below_reserve(device_bytes: float, budget: str, stage: str, need: float, fits_at: float, given: bool) -> str:
    """The refusal when the device (or the given budget) is no larger than the runtime reserve alone."""
    fix = (f"--gpu_memory_gb {fits_at / GiB:.1f} or more fits (or leave --gpu_memory_gb unset: the GPU's free memory)"
           if given else f"a GPU with {fits_at / GiB:.1f} GiB free fits: free this one (another process holds it) or "
                         f"run on a larger one")
    return (f"memory plan: {budget} is {_gib(device_bytes)} GiB per rank, no more than the {_gib(CUDA_RESERVE)} GiB "
            f"every CUDA rank holds before any model (context, cuBLAS workspace, NCCL buffers: the planner's runtime "
            f"reserve); this job's largest stage, {stage}, needs {_gib(need)} GiB at this budget: {fix}. "
            f"See python -m rlhf.plan --memory with the same flags; --skip_memory_check starts anyway")


def startup_check(job: Job, model, topology, world: int, placement=None, on_cuda: Optional[bool] = None,
                  device_bytes: Optional[float] = None, groups: Optional[dict] = None) -> List[str]:
    """Run before any process group (rlhf/config/preflight.py ``memory_notices``): plan the job and refuse a layout
    with a stage that cannot fit, naming the stage, the numbers and flag sets that fit, unless --skip_memory_check.

    ``job`` comes from ``job_from_flags``; ``model`` (the --model flag group) names the models whose config.json
    give their dimensions; ``topology`` (the --topology group) gives --gpu_memory_gb and --skip_memory_check;
    ``placement`` is RL's (None: a supervised job over ``world`` ranks).
    On CUDA the device is the GPU's free memory at start-up (``free_device_bytes``; what other processes hold is
    not ours to plan with), or --gpu_memory_gb.  Without CUDA the check does nothing unless --gpu_memory_gb is
    given (CPU runs are not planned for).  A model whose config.json cannot be read is left to the checks that
    report those."""
    gb = topology.gpu_memory_gb
    if on_cuda is None:
        import torch

        on_cuda = torch.cuda.is_available()
    budget = "the given budget (--gpu_memory_gb)"
    if device_bytes is None:
        if gb is not None:
            device_bytes = float(gb) * GiB
        elif on_cuda:
            device_bytes, total, index = free_device_bytes()
            budget = (f"GPU {index}'s free memory ({_gib(device_bytes)} of {_gib(total)} GiB; other processes hold "
                      f"the rest)")
        else:
            return []
    import importlib.util

    vllm = importlib.util.find_spec("vllm") is not None
    job = job.on(on_cuda, vllm)
    try:
        dims = role_dims(model, **(groups or {}))  # groups: the flag groups a declared role reads
        plan, fits = plan_with_fixes(job, dims, placement, world, device_bytes, on_cuda, vllm)
    except (OSError, ValueError) as e:
        return [f"[memory] plan skipped: a model's config.json could not be read ({e})"]
    g, s = plan.worst()

    def fitting() -> float:
        return smallest_device(lambda dev: plan_memory(job, dims, placement, world, dev, on_cuda), s.total)

    if on_cuda and device_bytes <= CUDA_RESERVE:
        msg = below_reserve(device_bytes, budget, s.name, s.total, fitting(), gb is not None)
        if topology.skip_memory_check:
            return [f"[memory] WARNING (--skip_memory_check): {msg}"]
        raise MemoryPlanError(msg)
    if plan.fits:
        return [f"[memory] plan: the largest peak is {s.name} on ranks {_ranges(g.ranks)}, {_gib(s.total)} of "
                f"{_gib(device_bytes)} GiB (python -m rlhf.plan --memory shows every stage)"]
    over = plan.overflows()
    worst_g, worst_s, by = max(over, key=lambda o: o[2])
    msg = (f"memory plan: {worst_s.name} on ranks {_ranges(worst_g.ranks)} needs {_gib(worst_s.total)} GiB of "
           f"{_gib(device_bytes)} GiB ({_gib(by)} GiB over"
           + (f"; {len(over) - 1} more stage(s) over" if len(over) > 1 else "") + "). "
           + (f"Fits with: {' | '.join(flags_text(f) for f in fits)}. " if fits else
              f"No flag set found that fits: more ranks, a smaller model, or a device with at least "
              f"{fitting() / GiB:.1f} GiB per rank. ")
           + "See python -m rlhf.plan --memory with the same flags; --skip_memory_check starts anyway")
    if topology.skip_memory_check:
        return [f"[memory] WARNING (--skip_memory_check): {msg}"]
    raise MemoryPlanError(msg)
