"""Runs inside vLLM's worker (``worker_extension_cls``): loads the weights the trainer sends.

The same methods serve both engine modes: colocated (the worker lives in the trainer's
process; tensors arrive as tensors) and separate (the worker lives in vLLM's own engine
process; tensors arrive as ``[name, dtype, shape, bytes]`` rows, because vLLM's RPC
serialises untyped arguments as plain msgpack).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from typing import List, Sequence

import torch

# the in-place reloader warns once per layer that a bucket did not contain: expected with bucketed loading
_NOISY_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                  "vllm.model_executor.model_loader.reload.inplace")


def pack(named_tensors) -> List[list]:
    """(name, tensor) -> [name, dtype, shape, bytes]: what vLLM's engine-core RPC can carry."""
    rows = []
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        rows.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()])
    return rows


def unpack(rows: Sequence) -> List[tuple]:
    out = []
    for row in rows:
        if isinstance(row[1], torch.Tensor):  # in-process: already a tensor
            out.append((row[0], row[1]))
            continue
        name, dtype, shape, data = row
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out.append((name, flat.view(getattr(torch, dtype)).reshape(shape)))
    return out


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


class WorkerExtension:
    """Mixed into vLLM's Worker; called by name through ``LLM.collective_rpc``."""

    def rlhf_load_weights(self, rows, mode: str = "reload") -> int:
        return load_into(self, unpack(rows), mode)

    def rlhf_param_names(self) -> List[str]:
        return [n for n, _ in self.model_runner.get_model().named_parameters()]
