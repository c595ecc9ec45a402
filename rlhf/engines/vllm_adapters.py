"""The vLLM engine's LoRA adapter versions (--lora_sync adapter): each sync registers the adapter from memory on
every worker (``vllm_worker.add_adapter``, as vLLM's own ``_load_adapter`` does from a folder with
``LoRAModel.from_lora_tensors``; veRL's TensorLoRARequest, TRL PR #7017) and generation uses the newest version's
``LoRARequest``.  A mixin of ``VLLMEngine``: it reads the engine's ``llm``, ``driver``, ``mode``, ``lora_rank``,
``lora_versions`` and sets ``_lora``."""
from __future__ import annotations

from rlhf.distributed.transport import pack


class VLLMAdapters:
    @property
    def lora_adapters(self) -> bool:
        return self.lora_rank > 0

    def load_adapter(self, version: int, named_tensors, config: dict, keep: int = 1) -> None:
        """Every worker registers the version from memory (``vllm_worker.add_adapter``): in this process the tensors
        as they are, in vLLM's own processes ``pack``'s host bytes (an adapter is small)."""
        if not self.driver:
            return
        rows = [list(t) for t in named_tensors] if self.mode == "colocated" else pack(named_tensors)
        self.llm.collective_rpc("rlhf_add_adapter", args=(version, rows, config, min(keep, self.lora_versions)))
        self._use_adapter(version)

    def receive_adapter(self, version: int, pieces, config: dict, keep: int = 1) -> None:
        """The workers receive the version over the weight-transfer group and register it."""
        self.llm.collective_rpc("rlhf_receive_adapter", args=(version, pieces, config,
                                                              min(keep, self.lora_versions)))
        self._use_adapter(version)

    def _use_adapter(self, version: int) -> None:
        """Generate with ``version`` from now on: a ``LoRARequest`` whose id is registered already, so its path
        (required non-empty by vllm/lora/request.py) is never read."""
        from vllm.lora.request import LoRARequest

        self._lora = LoRARequest(f"rlhf-v{version}", version, f"rlhf://in-memory/v{version}")

