"""DeepSpeed at 70B (issue 40 item 8): no rank puts the whole model on its device.

ZeRO-3: the engine partitions the parameters one at a time as they are placed (``deepspeed.zero.Init(module=...)``,
deepspeed/runtime/zero/partition_parameters.py ``_convert_to_zero_parameters``), so ``deepspeed.initialize`` sees
a ZeRO-Init model and skips its ``module.to(device)`` (deepspeed/runtime/engine.py ``_configure_distributed_model``:
``if not (self.dont_change_device or is_zero_init_model): self.module.to(self.device)``).  On CPU that move is a
no-op, so the test records every ``Module.to`` / ``Tensor.to`` onto the engine's device with its bytes.
ZeRO-1/2 keep the whole module on every device by design: a model whose parameters exceed the free memory is
refused with the numbers and the fix.
"""
from __future__ import annotations

import pytest
import torch
from helpers.models import tiny_llama

deepspeed = pytest.importorskip("deepspeed")


class Moves:
    """The largest single ``Module.to(device)`` (its parameters' bytes) and ``Tensor.to(device)`` (until
    ``tensors_on`` is cleared: the optimizer's own buffers come later) while active (a context manager)."""

    def __init__(self, device="cpu"):
        self.device, self.module, self.tensor, self.tensors_on = torch.device(device), [0], [0], True

    def __enter__(self):
        meter = self
        self._mod_to, self._ten_to = mod_to, ten_to = torch.nn.Module.to, torch.Tensor.to

        def module_to(mod, *a, **kw):
            dev = kw.get("device", a[0] if a else None)
            if dev is not None and not isinstance(dev, torch.dtype) and torch.device(dev) == meter.device:
                meter.module.append(sum(p.numel() * p.element_size() for p in mod.parameters()))
            return mod_to(mod, *a, **kw)

        def tensor_to(t, *a, **kw):
            dev = kw.get("device", a[0] if a else None)
            if meter.tensors_on and isinstance(dev, (str, torch.device)) and torch.device(dev) == meter.device:
                meter.tensor.append(t.numel() * t.element_size())
            return ten_to(t, *a, **kw)

        torch.nn.Module.to, torch.Tensor.to = module_to, tensor_to
        return self

    def __exit__(self, *exc):
        torch.nn.Module.to, torch.Tensor.to = self._mod_to, self._ten_to


@pytest.mark.parametrize("trainable", [True, False])
def test_zero3_places_one_parameter_at_a_time(one_rank_gloo, monkeypatch, trainable):
    """ZeRO-3 (trainable and the frozen eval config): the whole model never goes to the device in one move; the
    module is a ZeRO-Init model when ``deepspeed.initialize`` gets it; a step still trains (parameters change)."""
    from rlhf.engines.deepspeed_engine import DeepSpeedEngine
    from rlhf.engines.train import EngineSpec

    model = tiny_llama()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    seen = {}
    real_init = deepspeed.initialize

    def initialize(*a, **kw):
        moves.tensors_on = False  # placement is done; what follows is DeepSpeed's optimizer set-up
        seen["zero_init"] = all(hasattr(p, "ds_id") for p in kw["model"].parameters())
        return real_init(*a, **kw)

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    spec = EngineSpec(lr=1e-2, train_batch_size=1, micro_batch_size=1, total_steps=2, zero_stage=3,
                      trainable=trainable, scheduler="constant", warmup_ratio=0.0)
    with Moves() as moves:
        eng = DeepSpeedEngine(model, spec)
    assert seen.get("zero_init"), "deepspeed.initialize got a model that is not ZeRO-partitioned: it moves the " \
                                  "whole module to the device (engine.py _configure_distributed_model)"
    assert max(moves.module) < total, (f"a Module.to(device) moved {max(moves.module)} bytes, the whole model is "
                                       f"{total}: every rank would hold the whole model on its GPU")
    assert max(moves.tensor) <= largest, \
        f"placing the parameters, a single move of {max(moves.tensor)} bytes > the largest parameter {largest}"
    if trainable:
        x = torch.randint(3, 100, (1, 8))
        before = eng.full_state_dict()
        eng.backward(eng.model(input_ids=x, labels=x).loss, 0)
        assert eng.step()["grad_norm"] > 0
        after = eng.full_state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before), "the step changed no parameter"


def test_zero_below_3_refuses_a_model_larger_than_the_free_memory():
    from rlhf.engines.deepspeed_engine import check_whole_module_fits, module_bytes

    n70b = 70_553_706_496
    gib = 2 ** 30
    with pytest.raises(ValueError, match=r"--zero_stage 2 keeps the whole model.*131\.4 GiB.*79\.0 GiB free.*"
                                         r"--zero_stage 3.*--backend fsdp2"):
        check_whole_module_fits(2 * n70b, 79 * gib, 2, "cuda:0")
    check_whole_module_fits(2 * n70b, 79 * gib, 3)  # ZeRO-3 partitions as it places: no whole-module check
    check_whole_module_fits(2 * 7_615_616_512, 79 * gib, 2)  # 7B in bf16 fits
    m = tiny_llama()
    n = sum(p.numel() for p in m.parameters())
    assert module_bytes(m, bf16=True) == 2 * n and module_bytes(m, bf16=False) == 4 * n
