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

import os
from typing import List, Optional, Sequence

from rlhf.data.images import multi_modal_data
from rlhf.distributed.lora_sync import vllm_max_lora_rank
from rlhf.distributed.transport import ipc_rows, layer_key, pack, split_last_layer
from rlhf.engines.requests import StepResult
from rlhf.engines.rollout import Batch, RolloutEngine, SamplingParams, batch_from_rows
from rlhf.engines.rollout_registry import EngineArgs
from rlhf.engines.vllm_adapters import VLLMAdapters
from rlhf.engines.vllm_compat import _cap_len, check_vision_deps, check_vllm, on_cuda, sleep_available
from rlhf.engines.vllm_launch import (
    LAUNCHER_ENV,
    _env,
    _launcher_env,
    _tolerant_exit,
    check_free_memory,
    default_dtype,
    engine_kwargs,
    visible_devices,
)
from rlhf.engines.vllm_memory import EngineMemory, empty_device_cache, release_vllm_groups
from rlhf.engines.vllm_requests import step_llm
from rlhf.engines.vllm_worker import WorkerExtension, loader_for_moe
from rlhf.models import moe
from rlhf.models.load import load_tokenizer
from rlhf.models.vision import cut_at_tokens, vision_tokens_of

MODES = ("colocated", "separate")


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



class VLLMEngine(VLLMAdapters, RolloutEngine):
    def __init__(self, model_path: str, tp_size: int = 1, *, mode: str = "colocated", max_model_len: int = 1024,
                 seed: int = 0, pad_token_id: int = 0, eos_token_id: int = 2, dtype: Optional[str] = None,
                 gpu_memory_utilization: float = 0.5, kv_cache_memory_bytes: Optional[int] = None,
                 enable_sleep: bool = False, sleep_level: int = 2, enforce_eager: bool = False,
                 weight_loader: Optional[str] = None, tp_group=None, tp_src: int = 0, driver: bool = True,
                 device_ids: Optional[Sequence[int]] = None, dummy_weights: bool = False, lora_rank: int = 0,
                 lora_versions: int = 1, log=print):
        """``tp_group`` / ``tp_src``: the engine's TP ranks and their first global rank (colocated, TP > 1: the
        prompts are broadcast from it so every TP rank passes identical prompts).  ``driver``: separate mode,
        False on an engine's non-first ranks (they build nothing).  ``device_ids``: separate mode on CUDA,
        the local GPU ids of the engine's ranks (mapped through the parent's CUDA_VISIBLE_DEVICES).
        ``weight_loader``: direct | reload | auto (direct on CUDA,
        reload elsewhere: CPU repacks the linear weights after loading); None reads RLHF_VLLM_WEIGHT_LOADER
        (default auto): ``reload`` on CUDA for models whose layers post-process their weights (e.g. quantised);
        auto also picks reload where vLLM's fused MoE keeps the experts in its own layout (``loader_for_moe``).
        ``seed``: the engine's seed, set once (OpenRLHF: ``LLM(seed=seed + engine index)``); a generate's
        ``params.seed`` resets the sampler's generator once per call, never per request.  ``dtype``: None picks
        bf16 on CUDA, fp32 on CPU (``default_dtype``).  ``sleep_level``: 2 discards the weights where a weight
        sync follows before the next generate (``sync_follows``), 1 always keeps them (``EngineMemory``).
        ``dummy_weights`` (the trainer's colocated engines): build with ``load_format="dummy"`` (vLLM's
        DummyModelLoader, vllm/model_executor/model_loader/dummy_loader.py: random values, no file read); take the
        trainer's weights at the first sync, as veRL's colocated rollout does (``load_format: dummy``): no rank
        reads the checkpoint a second time (a 70B model: 140 GB per rank).  Until that sync ``needs_weights`` is True and a
        generate is refused (``EngineMemory.check_generate``).  ``lora_rank`` > 0 (--lora_sync adapter): vLLM runs
        with LoRA (``enable_lora``, ``max_lora_rank`` the smallest it accepts >= the rank, one adapter per batch,
        ``lora_versions`` kept in host memory); each ``load_adapter`` is a new version the next generates use."""
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
        self.vision_tokens = vision_tokens_of(model_path)  # a VLM's placeholders: cut from responses
        if self.vision_tokens:
            check_vision_deps()
        self.tp_group, self.tp_src = tp_group, tp_src
        self.driver = driver or mode == "colocated"
        self.loader = weight_loader if weight_loader != "auto" else ("direct" if cuda else "reload")
        enable_sleep = bool(enable_sleep)
        if enable_sleep and not sleep_available():
            log("[vllm] sleep mode is not available on this platform: the engine stays resident "
                "(sleep/wake are no-ops)")
            enable_sleep = False
        self.enable_sleep = enable_sleep
        self.memory = EngineMemory(None, sleep_level, enable_sleep, empty_cache=empty_device_cache)
        self._pending: List[tuple] = []
        self.llm = None
        self.lora_rank, self.lora_versions, self._lora = lora_rank, max(1, lora_versions), None
        # the longest sequence (prompt + response) vLLM takes: a partial rollout's continuation prompt must stay below
        # it (vLLM refuses a prompt of max_model_len tokens, vllm/v1/engine/input_processor.py _validate_prompt_len,
        # and caps a generation there, vllm/v1/core/sched/utils.py check_stop: finish_reason "length")
        self.max_model_len = _cap_len(model_path, max_model_len)
        log(f"[vllm] {mode} engine: tensor parallel {tp_size}, max_model_len {self.max_model_len}")
        if not self.driver:
            return
        kw = engine_kwargs(model_path, tp_size=tp_size, max_model_len=self.max_model_len, seed=seed,
                           dtype=dtype or default_dtype(cuda, False), enforce_eager=enforce_eager,
                           enable_sleep=enable_sleep, gpu_memory_utilization=gpu_memory_utilization,
                           kv_cache_memory_bytes=kv_cache_memory_bytes, cuda=cuda)
        if lora_rank > 0:
            kw.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1,
                      max_cpu_loras=self.lora_versions)
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
                # CUDA IPC rows (``_send``) are (function, args) tuples: vLLM's RPC pickles them only with this set,
                # as OpenRLHF sets it for its CUDA IPC weight sync
                env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            if not cuda and tp_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # auto-binding wants a NUMA node per CPU worker
            # vLLM's processes start from this env: without the launcher's variables they rendezvous on their own
            with _env(env, drop=LAUNCHER_ENV):
                self.llm = vllm.LLM(**kw)
        self.memory.llm = self.llm
        # an MoE kernel in another layout than the checkpoint's takes new weights only through the reload
        self.loader = loader_for_moe(self.loader, weight_loader, self.llm.collective_rpc("rlhf_moe_relayout"))
        if self.dummy:
            self.memory.weights_valid = False  # random values until the first weight sync (needs_weights)

    @property
    def needs_weights(self) -> bool:
        """Built on dummy weights and not yet synced: the trainer syncs before the first generate."""
        return not self.memory.weights_valid

    # ---- generation --------------------------------------------------------------------------------------------
    def _same_prompts(self, prompt_ids, params, images=None):
        """Colocated TP > 1: every TP rank generates for the first TP rank's prompts (vLLM's SPMD contract)."""
        if self.mode != "colocated" or self.tp == 1 or self.tp_group is None:
            return prompt_ids, params, images
        from rlhf.distributed import comm

        return comm.broadcast_object((list(map(list, prompt_ids)), params, images), src=self.tp_src,
                                     group=self.tp_group)

    def generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams,
                 images: Optional[list] = None) -> Optional[Batch]:
        prompt_ids, params, images = self._same_prompts(prompt_ids, params, images)
        if not self.driver:
            return None
        return self._generate(prompt_ids, params, images)

    def _generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams, images=None) -> Batch:
        """This rank's part of one generate call, with the prompts every TP rank of the engine agreed on."""
        self._flush()
        self.memory.check_generate()
        if params.seed is not None:  # one reset per call (as the HF engine seeds one generator per call)
            self.llm.collective_rpc("rlhf_reseed", args=(int(params.seed),))
        greedy = params.temperature <= 0
        n = params.n
        images = images or [None] * len(prompt_ids)
        if greedy and n > 1:  # vLLM: "n must be 1 when using greedy sampling"; greedy rows are identical anyway
            prompt_ids, images = [p for p in prompt_ids for _ in range(n)], [i for i in images for _ in range(n)]
            n = 1
        sp = self.vllm.SamplingParams(n=n, temperature=max(params.temperature, 0.0), top_p=params.top_p,
                                      top_k=params.top_k if params.top_k > 0 else -1,
                                      max_tokens=params.max_new_tokens, logprobs=0,
                                      stop_token_ids=list(params.stop_token_ids) or [self.eos], detokenize=False)
        prompts = [{"prompt_token_ids": list(p), **multi_modal_data(i)} for p, i in zip(prompt_ids, images)]
        lora = {} if self._lora is None else {"lora_request": self._lora}  # the current adapter version (LoRA only)
        outs = self.llm.generate(prompts, sp, use_tqdm=False, **lora)
        return self._to_batch(outs)

    def step_requests(self, admit, abort=()) -> Optional[StepResult]:
        """One step of vLLM's running batch (``vllm_requests.step_llm``).  Colocated TP > 1: the first rank's
        admitted and aborted requests go to the other TP ranks first (they run the same step in ``serve``), so
        every rank's engine sees the same requests in the same order.  None on a rank that is not the driver."""
        if self._tp_spmd():
            from rlhf.distributed import comm

            comm.broadcast_object(("step", list(admit), list(abort)), src=self.tp_src, group=self.tp_group)
        return self._step(admit, abort)

    def _step(self, admit, abort) -> Optional[StepResult]:
        if not self.driver:
            return None
        if admit:
            self._flush()
            self.memory.check_generate()
        return step_llm(self.llm, self.vllm, admit, abort, self.eos, self._lora)

    def _to_batch(self, outs) -> Batch:
        rows = [(list(o.prompt_token_ids), c) for o in outs for c in o.outputs]
        b = batch_from_rows([p for p, _ in rows], [list(c.token_ids) for _, c in rows],
                            [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for _, c in rows],
                            [c.finish_reason == "length" for _, c in rows], self.pad)
        return cut_at_tokens(b, self.vision_tokens, self.pad)  # a VLM's sampled placeholders (rlhf.models.vision)

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
        named_tensors = moe.checkpoint_layout(named_tensors)  # MoE experts under the checkpoint's per-expert names
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
        else:  # own processes on the actor's ranks (fed by the colocated gather): CUDA IPC handles on the trainer's
            # GPU (no copy; transport.ipc_rows), host bytes elsewhere (transport.pack)
            cuda = items[0][1].device.type == "cuda"
            if cuda:
                import torch

                torch.cuda.synchronize()  # the gathered tensors are written before another process reads them
            self.llm.collective_rpc("rlhf_load_weights", args=(ipc_rows(items) if cuda else pack(items), self.loader))

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
        """A weight sync comes before this engine's next generate: its next sleep may discard the weights.  Not
        with LoRA adapters: the base was sent once and the next syncs carry the adapter only."""
        if not self.lora_adapters:
            self.memory.sync_follows()

    def memory_state(self) -> str:
        """``full`` | ``weights`` | ``asleep`` (``EngineMemory.state``; without sleep mode nothing is released, the
        state only records what a wake must bring back first)."""
        return self.memory.state

    # ---- agents on colocated TP > 1 engines ----------------------------------------------------------------------
    def _tp_spmd(self) -> bool:
        return self.mode == "colocated" and self.tp > 1 and self.tp_group is not None

    def serve(self) -> None:
        """A non-first TP rank of a colocated engine while its first rank runs an agent (a data-dependent number of
        generate or step_requests calls): take part in every call the first rank makes, until it calls ``end_requests``.  vLLM's
        external launcher runs the TP ranks in lock-step with identical inputs.  Elsewhere: returns at once."""
        if not self._tp_spmd():
            return
        from rlhf.distributed import comm

        while True:
            req = comm.broadcast_object(None, src=self.tp_src, group=self.tp_group)
            if req is None:
                return
            if req[0] == "step":  # the first rank's step_requests: the same admitted / aborted requests
                self._step(req[1], req[2])
            else:  # its generate: the same prompts and params
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
        llm.llm_engine.engine_core.shutdown()  # vllm/v1/engine/core_client.py: every EngineCoreClient has it


def build_vllm_engine(args: EngineArgs) -> VLLMEngine:
    """The registry's ``vllm`` engine.  In the trainer's process when every rank of the job holds an engine (hybrid
    engine), else in vLLM's own processes, started by the engine's first rank (its other ranks lend their devices
    and build nothing).  bf16 on CUDA whatever --bf16 says (vLLM's flash-attention backends take no fp32), fp32 on
    CPU unless --bf16; colocated engines start on dummy weights (the actor's arrive at the first sync)."""
    p, cpu = args.place, args.device.type == "cpu"
    tok = load_tokenizer(args.model_path)
    return VLLMEngine(args.model_path, args.tp_size, mode="separate" if p.separate else "colocated",
                      max_model_len=args.max_model_len, seed=args.seed,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      dtype="bfloat16" if args.bf16 or args.device.type == "cuda" else "float32",
                      gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep=args.enable_sleep,
                      sleep_level=args.sleep_level, enforce_eager=args.enforce_eager or cpu,
                      tp_group=p.tp_group, tp_src=p.ranks[0], driver=p.first,
                      device_ids=[k % p.gpus_per_node for k in p.ranks], dummy_weights=not p.separate,
                      lora_rank=args.lora_rank, lora_versions=args.lora_versions,
                      log=print if p.first else (lambda *_: None))
