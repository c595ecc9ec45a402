"""FSDP2 load on the source rank (issue 40 item 1): what it still references while it fills the shards.

On CPU ``fully_shard``'s device move is a no-op, so these tests make it real: ``_move_states_to_device``
(torch/distributed/fsdp/_fully_shard/_fsdp_init.py) swaps each managed tensor's ``.data`` for a copy on the mesh's
device (``tensor.data = tensor.to(device)``); the stand-in swaps it for a fresh copy on the host and keeps a weak
reference to that copy's storage, which plays the GPU copy.  Then, after each FSDP unit is filled, the test counts
the bytes still alive of (a) those "device" copies and (b) the source rank's full host tensors (storage weakrefs,
torch.multiprocessing.reductions.StorageWeakRef), and asserts that the device holds at most one unit's full tensors and that the
host copy falls unit by unit to nothing (veRL keeps a detached ``state_dict()`` before ``apply_fsdp2``:
verl/workers/fsdp_workers.py, verl/utils/fsdp_utils.py ``fsdp2_load_full_state_dict``).
"""
from __future__ import annotations

import functools

import torch
from helpers.models import tiny_llama
from torch.multiprocessing.reductions import StorageWeakRef


class Refs:
    """Weak references to storages, with their bytes: how many of those bytes something still holds."""

    def __init__(self):
        self.refs = []

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        self.refs.append((StorageWeakRef(s), s.nbytes()))

    def alive(self) -> int:
        return sum(n for r, n in self.refs if not r.expired())


def _emulate_device_move(monkeypatch, device_copies: Refs):
    """``_move_states_to_device`` as it acts on a GPU: every managed tensor's ``.data`` becomes a new storage."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init

    def move(params, buffers, device):
        for t in list(params) + list(buffers):
            if t.device.type == "meta":
                continue
            t.data = t.data.clone()
            device_copies.add(t)

    monkeypatch.setattr(_fsdp_init, "_move_states_to_device", move)


def test_source_rank_frees_full_tensors_unit_by_unit(one_rank_gloo, monkeypatch):
    """After each unit the source rank's "device" holds at most that unit's full tensors (the old code kept the
    live Parameters, whose .data fully_shard had moved: the whole model stayed on the device until the end), and
    its host full tensors fall by exactly the unit just filled, to zero; the loaded weights equal the source's."""
    from rlhf.engines import fsdp2
    from rlhf.engines.train import EngineSpec

    model = tiny_llama(4)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    host, device_copies = Refs(), Refs()
    sizes = {}
    for name, t in model.named_parameters():  # not the buffers: the model keeps its own copy of inv_freq
        host.add(t)
        sizes[name] = t.untyped_storage().nbytes()
    total = sum(sizes.values())
    _emulate_device_move(monkeypatch, device_copies)
    seen = []

    def probe(unit):
        seen.append((sum(sizes.get(n, 0) for n in unit), host.alive(), device_copies.alive()))

    monkeypatch.setattr(fsdp2, "fill_from_first", functools.partial(fsdp2.fill_from_first, after_unit=probe))
    spec = EngineSpec(lr=1e-3, train_batch_size=1, micro_batch_size=1, total_steps=1, bf16=True)
    eng = fsdp2.FSDP2Engine(model, spec, load_on_first=True)
    del model
    assert len(seen) == 5, f"expected 4 decoder blocks + the root unit filled in turn, got {len(seen)} units"
    largest = max(u for u, _, _ in seen)
    assert not device_copies.refs, f"fully_shard moved {len(device_copies.refs)} full tensors of the source rank"
    left = total
    for i, (unit, h, d) in enumerate(seen):
        left -= unit
        assert d == 0, (f"unit {i}: {d} bytes of full tensors fully_shard moved to the device are still "
                        f"referenced (model {total}, largest unit {largest}): the source rank's full blocks reached "
                        f"its GPU (all of them, where it keeps the moved Parameters)")
        assert h == left, (f"unit {i}: the source rank still references {h} bytes of full host tensors, "
                           f"{left} expected (model {total}): the host copy must fall unit by unit")
    assert seen[-1][1] == 0
    got = eng.full_state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k} differs after the load"


def test_fill_units_cover_every_tensor_once():
    """Every parameter and buffer is filled exactly once, the decoder blocks first, each in its own unit."""
    from rlhf.engines.fsdp2 import fill_units, model_tensors

    model = tiny_llama(layers=3)
    names = list(model_tensors(model))
    units = fill_units(model, names)
    flat = [n for u in units for n in u]
    assert sorted(flat) == sorted(names) and len(flat) == len(set(flat))
    assert [u[0].split(".")[2] for u in units[:3]] == ["0", "1", "2"], units
    assert "model.embed_tokens.weight" in units[-1] and "lm_head.weight" in units[-1]
