"""How a vLLM engine is started and stopped: the ``vllm.LLM`` arguments, the devices and memory budget it is
given, the launcher environment it sees (in the trainer's process, or in processes of its own), and its teardown.
Pure functions, tested without vLLM (tests/test_sleep_protocol.py)."""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Optional, Sequence

CPU_KV_CACHE_BYTES = 256 << 20
# env a torchrun / SLURM launch sets; vLLM's own processes must not see them in separate mode
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


@contextlib.contextmanager
def _env(set_: dict, drop: Sequence[str] = ()):
    saved = {k: os.environ.get(k) for k in list(set_) + list(drop)}
    for k in drop:
        os.environ.pop(k, None)
    os.environ.update({k: str(v) for k, v in set_.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launcher_env() -> dict:
    """What vLLM's external launcher reads (RANK, LOCAL_RANK) and a plain ``python -m rlhf.train_grpo``
    without torchrun does not set: taken from the process group the trainer already made (vLLM reuses it)."""
    from rlhf.distributed import comm

    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        return {}
    rank, world = comm.rank(), comm.world_size()
    return {"RANK": rank, "LOCAL_RANK": os.environ.get("LOCAL_RANK", rank), "WORLD_SIZE": world}


def _shutdown_if_world(core):
    from rlhf.distributed import comm

    if comm.initialized():  # vLLM's teardown destroys its groups: only while they still exist
        try:
            core.shutdown()
        except Exception:  # exiting anyway
            pass


def _tolerant_exit(llm):
    """In-process vLLM shuts down at exit and destroys its process groups; the trainer has usually destroyed the
    default group by then, and vLLM's teardown would raise.  Replace its exit hook with one that checks first."""
    client = llm.llm_engine.engine_core  # vllm/v1/engine/llm_engine.py (every vLLM >= 0.30): an EngineCoreClient
    # only the in-process client (vllm/v1/engine/core_client.py InprocClient, colocated mode) holds the engine core
    # and a finalizer that shuts it down; the multi-process clients' finalizers free their own resources
    fin, core = vars(client).get("_finalizer"), vars(client).get("engine_core")
    if fin is not None and core is not None and fin.detach() is not None:
        client._finalizer = weakref.finalize(client, _shutdown_if_world, core)


# ---- devices, memory budget, engine arguments (pure: tested without vLLM) ----------------------------------------
WORKER_EXTENSION = "rlhf.engines.vllm_engine.RolloutWorkerExtension"  # mixed into vLLM's workers
MAX_NUM_BATCHED_TOKENS = 4096  # TRL's value (trl 1.16 trl/generation/vllm_generation.py, colocate LLM(...):
# "Latest vLLM v1 memory profiler is misled by the high default value (i.e., 32768) - thinking there's not enough
# memory"; read in the 1.16.0 wheel)


def visible_devices(local_ids: Sequence[int], parent: Optional[str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for vLLM's own processes: the engine's local GPU indices mapped through the
    parent's mask (a job given ``4,5,6,7`` whose engine holds local GPUs 0-1 must hand vLLM ``4,5``, not ``0,1``)."""
    if not parent:
        return ",".join(map(str, local_ids))
    mask = [d.strip() for d in parent.split(",") if d.strip()]
    bad = [k for k in local_ids if not 0 <= k < len(mask)]
    if bad:
        raise RuntimeError(f"rollout engine wants local GPUs {list(local_ids)} but CUDA_VISIBLE_DEVICES={parent} "
                           f"holds {len(mask)}: give the job more GPUs or lower --vllm_tensor_parallel_size / "
                           f"--vllm_num_engines")
    return ",".join(mask[k] for k in local_ids)


def check_free_memory(utilization: float, free: int, total: int) -> None:
    """vLLM v1 asks for ``ceil(total * gpu_memory_utilization)`` bytes and refuses to start when less is free
    (vllm/v1/worker/utils.py ``request_memory``); say so before it does, with a value that fits."""
    want = utilization * total
    if free >= want:
        return
    fits = max(0.0, int((free / total - 0.02) * 100) / 100)
    raise RuntimeError(f"vLLM needs --vllm_gpu_memory_utilization {utilization} x {total / 2**30:.1f} GiB = "
                       f"{want / 2**30:.1f} GiB free on this GPU, but the training models already hold all but "
                       f"{free / 2**30:.1f} GiB: use --vllm_gpu_memory_utilization {fits} (or less), or free the "
                       f"GPU (--colocate_all_models with --vllm_enable_sleep, fewer roles per GPU)")


def default_dtype(cuda: bool, bf16: bool) -> str:
    """vLLM's dtype when the user names none: bf16 on CUDA whatever --bf16 says (vLLM's flash-attention backends
    take fp16/bf16 only; OpenRLHF always passes ``dtype="bfloat16"`` and ``seed=seed + i`` per engine,
    openrlhf/trainer/ray/vllm_engine.py ``create_vllm_engines``); fp32 on CPU unless --bf16 (the CPU tests compare
    log-probs with fp32 HF models)."""
    return "bfloat16" if cuda or bf16 else "float32"


def engine_kwargs(model_path: str, *, tp_size: int, max_model_len: int, seed: int, dtype: str, enforce_eager: bool,
                  enable_sleep: bool, gpu_memory_utilization: float, kv_cache_memory_bytes: Optional[int],
                  cuda: bool) -> dict:
    """``vllm.LLM`` keyword arguments shared by both modes (the executor backend is added by the mode)."""
    kw = dict(model=model_path, tensor_parallel_size=tp_size, max_model_len=max_model_len, seed=seed, dtype=dtype,
              enforce_eager=enforce_eager, enable_prefix_caching=True, enable_sleep_mode=enable_sleep,
              logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
              gpu_memory_utilization=gpu_memory_utilization)
    if cuda:  # at least one full sequence per step (chunked prefill splits longer prompts)
        kw["max_num_batched_tokens"] = max(MAX_NUM_BATCHED_TOKENS, max_model_len)
    if kv_cache_memory_bytes is None and not cuda and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        kv_cache_memory_bytes = CPU_KV_CACHE_BYTES  # CPU: gpu_memory_utilization is a share of the node's RAM
    if kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    return kw
