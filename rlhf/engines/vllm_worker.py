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
    with _quiet():
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

    def rlhf_param_names(self) -> List[str]:
        return [n for n, _ in self.model_runner.get_model().named_parameters()]
