"""Memory traffic between phases (issue 40 item 12), on CPU where device moves are no-ops: each test makes the move it
checks visible (a stand-in device, a recorded dtype) and fails without its fix.

* FSDP2 wake brings back the weights only; the optimizer state comes back in ``step`` (veRL:
  ``load_fsdp_model_to_gpu`` for every phase, ``load_fsdp_optimizer`` only in ``update_actor``,
  verl/workers/fsdp_workers.py).
* The colocated weight sync all-gathers in the engine's dtype (a DTensor's ``full_tensor`` gathers in the dtype it
  is called on: torch/distributed/tensor/_api.py ``full_tensor`` -> ``redistribute(Replicate)``).
* LoRA under --bf16 keeps its frozen base in bf16 and its adapters (the master weights) in fp32.
"""
from __future__ import annotations

import torch
from helpers.engine_standin import StandInEngine
from helpers.models import tiny_llama


def _train_step(eng):
    x = torch.randint(3, 100, (1, 8))
    eng.backward(eng.model(input_ids=x, labels=x).loss, 0)
    return eng.step()


class FakeDevice:
    """``.to(cuda)`` recorded and answered with the tensor itself (no CUDA here): which tensors a wake or a step
    would have moved onto the GPU."""

    def __init__(self, monkeypatch):
        self.moved, self.modules = [], 0
        ten_to, mod_to, fake = torch.Tensor.to, torch.nn.Module.to, self

        def is_cuda(a, kw):
            dev = kw.get("device", a[0] if a else None)
            return isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cuda"

        def tensor_to(t, *a, **kw):
            if is_cuda(a, kw):
                fake.moved.append(id(t))
                return t
            return ten_to(t, *a, **kw)

        def module_to(mod, *a, **kw):
            if is_cuda(a, kw):
                fake.modules += 1
                return mod
            return mod_to(mod, *a, **kw)

        monkeypatch.setattr(torch.Tensor, "to", tensor_to)
        monkeypatch.setattr(torch.nn.Module, "to", module_to)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)


def test_fsdp2_wake_moves_weights_and_step_moves_the_optimizer_state(one_rank_gloo, monkeypatch):
    """After a sleep, a wake (old log-probs, weight sync: forward-only phases) moves the module and none of Adam's
    state; the update's ``step`` moves every state tensor before the optimizer steps."""
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    eng = FSDP2Engine(tiny_llama(), EngineSpec(lr=1e-3, train_batch_size=1, micro_batch_size=1, total_steps=4))
    _train_step(eng)  # Adam's state exists from here on
    fake = FakeDevice(monkeypatch)
    eng.device = torch.device("cuda", 0)  # as on a GPU: sleep / wake now move (recorded by the fake)
    eng.sleep()
    state = {id(v) for st in eng.optimizer.state.values() for v in st.values() if torch.is_tensor(v)}
    assert state, "no optimizer state after a step"
    fake.moved.clear()
    eng.wake()
    assert fake.modules == 1, "the wake did not bring the weights back"
    early = state & set(fake.moved)
    assert not early, (f"the wake moved {len(early)} of {len(state)} optimizer-state tensors to the device for a "
                       f"phase that may only run forwards: they belong to the update's step")
    fake.moved.clear()
    _train_step(eng)
    assert state <= set(fake.moved), (f"the step ran with {len(state - set(fake.moved))} optimizer-state tensors "
                                      f"left on the host")


def test_colocated_sync_gathers_in_the_engine_dtype(one_rank_gloo, monkeypatch):
    """--bf16 FSDP2 (fp32 sharded masters) and a bf16 sync: every all-gather (``DTensor.full_tensor``) runs on a
    bf16 tensor, so the gathered buffers and the wire are bf16; the synced values are the masters rounded once."""
    from torch.distributed.tensor import DTensor

    from rlhf.distributed.weight_sync import WeightSync
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    model = tiny_llama()
    want = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    eng = FSDP2Engine(model, EngineSpec(lr=1e-3, train_batch_size=1, micro_batch_size=1, total_steps=1, bf16=True))
    assert any(isinstance(p, DTensor) for p in eng.model.parameters()), "--bf16 should shard the model"
    gathered = []
    real = DTensor.full_tensor

    def full_tensor(self, *a, **kw):
        gathered.append(self.dtype)
        return real(self, *a, **kw)

    monkeypatch.setattr(DTensor, "full_tensor", full_tensor)

    class Engine(StandInEngine):
        got = {}

        def load_weights(self, batch):
            self.got.update(batch)

        def reset_prefix_cache(self):
            pass

    rec = Engine()
    total = WeightSync(None, rec, dtype=torch.bfloat16).sync_colocated(eng.model)
    assert gathered and set(gathered) == {torch.bfloat16}, \
        f"the sync all-gathered {sorted(map(str, set(gathered)))} tensors; the engine takes bf16"
    assert total == sum(t.numel() * 2 for t in rec.got.values())
    for k, t in rec.got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[k]), k


def test_lora_base_is_bf16_under_bf16_and_adapters_fp32(tiny_kit, one_rank_gloo):
    """--lora_rank with --bf16: the frozen base loads in bf16 (half its memory; nothing steps it), the adapters are
    fp32 masters, and an FSDP2 step on the mixed-dtype model trains the adapters only."""
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.load import load_causal_lm

    model = load_causal_lm(tiny_kit, bf16=True, lora_rank=4, lora_alpha=8, target_modules="q_proj,v_proj")
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    adapters = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16}, f"LoRA's frozen base is {frozen} under --bf16 (bf16 expected)"
    assert adapters == {torch.float32}, f"LoRA adapters are {adapters} (fp32 masters expected)"
    full = load_causal_lm(tiny_kit, bf16=True)
    assert {p.dtype for p in full.parameters()} == {torch.float32}, "a fully trained model stays fp32"
    eng = FSDP2Engine(model, EngineSpec(lr=1e-2, train_batch_size=1, micro_batch_size=1, total_steps=2, bf16=True))
    before = {n: p.detach().full_tensor().clone() for n, p in eng.model.named_parameters()}
    assert _train_step(eng)["grad_norm"] > 0
    changed = {n for n, p in eng.model.named_parameters() if not torch.equal(p.detach().full_tensor(), before[n])}
    assert changed and all("lora_" in n for n in changed), sorted(changed)[:4]
