"""FSDP2 memory and precision checks, run on 2 gloo ranks inside tests/multiprocess/test_distributed.py's FSDP2 launch.

Each check measures what a GPU run would hold, in a way that does not depend on the device being a GPU:
* load: the bytes the engine puts on its device while it loads (every ``Module.to`` / ``to_empty`` to the
  engine's device, counted as the parameters' local bytes at that moment, plus the largest tensor one
  ``comm.broadcast`` carries), as a fraction of the model's bytes;
* accumulation: the gradient bytes a rank holds between micro-batches (sharded grads plus FSDP2's unsharded
  accumulated grads);
* precision: parameter and optimizer-state dtypes after a step under --bf16, with and without --flash_attn;
* the fused LM head on the sharded head equals the plain logits path, values and gradients.
"""
from __future__ import annotations

import os

import torch


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def model_bytes(model) -> int:
    return sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())


class DeviceLoadMeter:
    """Counts what an engine materialises on ``device`` while it is built (see the module docstring)."""

    def __init__(self, device):
        self.device, self.moved, self.broadcast = torch.device(device), [], [0]

    def __enter__(self):
        from rlhf.distributed import comm

        meter = self
        self._to, self._empty, self._bc = torch.nn.Module.to, torch.nn.Module.to_empty, comm.broadcast

        def to(mod, *a, **kw):
            dev = kw.get("device", a[0] if a else None)
            if dev is not None and not isinstance(dev, torch.dtype) and torch.device(dev) == meter.device:
                meter.moved.append(model_bytes(mod))
            return meter._to(mod, *a, **kw)

        def to_empty(mod, *, device, recurse=True):
            if torch.device(device) == meter.device:
                meter.moved.append(model_bytes(mod))
            return meter._empty(mod, device=device, recurse=recurse)

        def broadcast(t, src, group=None, timeout_s=None):
            meter.broadcast.append(t.numel() * t.element_size())
            return meter._bc(t, src, group, timeout_s)

        torch.nn.Module.to, torch.nn.Module.to_empty, comm.broadcast = to, to_empty, broadcast
        return self

    def __exit__(self, *exc):
        from rlhf.distributed import comm

        torch.nn.Module.to, torch.nn.Module.to_empty, comm.broadcast = self._to, self._empty, self._bc

    @property
    def peak(self) -> int:
        return max(self.moved or [0]) + max(self.broadcast)


def check_load_memory(rank, world, kit):
    """Rank 0's device bytes at load: its shard plus one tensor in flight, never the whole model."""
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.load import load_causal_lm

    spec = EngineSpec(lr=1e-3, train_batch_size=2, micro_batch_size=1, total_steps=2)
    full = load_causal_lm(kit)
    total = model_bytes(full)
    largest = max(p.numel() * p.element_size() for p in full.parameters())
    # rank 0's shard of each tensor: ceil(rows / world) rows (FSDP2 chunks dim 0, the first chunks are the larger)
    shard = sum(-(-p.size(0) // world) * p[0].numel() * p.element_size() for p in full.parameters())
    del full
    with DeviceLoadMeter("cpu") as meter:
        eng = FSDP2Engine(load_causal_lm(kit, on_meta=rank != 0), spec, load_on_first=True)
    bound = shard + largest
    assert meter.peak <= bound and meter.peak < total, \
        f"rank {rank}: {meter.peak} bytes on the device at load, model {total}, bound shard + largest tensor {bound}"
    held = model_bytes(eng.model)
    assert held <= shard, f"rank {rank} holds {held} of {total} bytes after load (its shard: {shard})"
    return meter.peak / total


def check_fill_from_other_rank(rank, world, kit):
    """A role group whose first rank is not global rank 0 (a critic on ranks 4-7): the source rank reads, the
    others get their shards; rank 1 is the source here.  Tied embeddings stay tied."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlhf.distributed import comm
    from rlhf.engines.fsdp2 import decoder_layers, fill_from_first, host_copies

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(3)
    src_model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        want = src_model(input_ids=ids).logits
    if rank == 1:
        model, full = src_model, host_copies(src_model)  # taken before fully_shard moves .data (GPU)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        full = None
    mesh = DeviceMesh.from_group(comm.world_group(), "cpu")
    for block in decoder_layers(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    fill_from_first(model, full, comm.world_group(), 1, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied embeddings untied by the load"
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6), f"rank {rank}: logits after fill differ by {(got - want).abs().max()}"


def _grad_bytes(model) -> tuple:
    """(sharded .grad bytes, FSDP2 unsharded accumulated gradient bytes) this rank holds."""
    from torch.distributed.fsdp import FSDPModule

    sharded = sum(_local(p.grad).numel() * _local(p.grad).element_size()
                  for p in model.parameters() if p.grad is not None)
    unsharded = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in (group.fsdp_params if group is not None else []):
                g = fp.unsharded_accumulated_grad  # kept in the reduce dtype (mixed precision) ...
                if g is None and getattr(fp, "_unsharded_param", None) is not None:
                    g = fp._unsharded_param.grad  # ... or where backward left it
                unsharded += 0 if g is None else g.numel() * g.element_size()
    return sharded, unsharded


def check_accumulation_memory(rank, world, kit):
    """Between two micro-batches of one optimizer step a rank holds sharded gradients only (1/world of the fp32
    model); --grad_accum_no_sync holds the full unsharded gradients instead."""
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.load import load_causal_lm

    ids = torch.randint(3, 100, (2, 10))
    out = {}
    for no_sync in (False, True):
        spec = EngineSpec(lr=1e-3, train_batch_size=4, micro_batch_size=1, total_steps=2, accum_no_sync=no_sync)
        eng = FSDP2Engine(load_causal_lm(kit), spec)
        assert eng.accum_steps == 2
        total = model_bytes(eng.model) * world
        x = ids[rank:rank + 1]
        eng.backward(eng.model(input_ids=x, labels=x).loss, 0)
        sharded, unsharded = _grad_bytes(eng.model)
        out[no_sync] = (sharded + unsharded) / total
        eng.backward(eng.model(input_ids=x, labels=x).loss, 1)
        eng.step()
    assert out[False] <= 1 / world + 0.01, f"rank {rank}: default accumulation holds {out[False]:.2f} of the " \
                                           f"model's bytes in gradients (sharded: {1 / world:.2f})"
    assert out[True] >= 0.99, f"--grad_accum_no_sync should keep full gradients, held {out[True]:.2f}"
    return out


def check_bf16_precision(rank, world, kit, monkeypatch_attn):
    """--bf16 (with and without --flash_attn): fp32 parameters and AdamW state after a step, bf16 compute;
    frozen models in bf16."""
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.critic import CriticModel
    from rlhf.models.load import load_causal_lm, load_reward_model

    ids = torch.randint(3, 100, (1, 10))
    for flash in (False, True):
        with monkeypatch_attn():
            model = load_causal_lm(kit, bf16=True, flash_attn=flash)
            critic = CriticModel.from_pretrained(kit, flash_attn=flash)
            ref = load_causal_lm(kit, bf16=True, flash_attn=flash, trainable=False)
        spec = EngineSpec(lr=1e-3, train_batch_size=2, micro_batch_size=1, total_steps=2, bf16=True)
        eng = FSDP2Engine(model, spec)
        seen = []
        h = eng.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, y: seen.append(y.dtype))
        eng.backward(eng.model(input_ids=ids, labels=ids).loss, 0)
        eng.step()
        h.remove()
        dtypes = {_local(p).dtype for p in eng.model.parameters()}
        state = {v.dtype for s in eng.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
        assert dtypes == {torch.float32}, f"--bf16 flash_attn={flash}: master weights {dtypes}, want fp32"
        assert state == {torch.float32}, f"--bf16 flash_attn={flash}: AdamW state {state}, want fp32"
        assert seen == [torch.bfloat16], f"--bf16: the decoder computes in {seen}, want bf16"
        assert {p.dtype for p in critic.parameters()} == {torch.float32}, "critic weights must load in fp32"
        assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}, "a frozen reference loads in bf16 under --bf16"
    rm_dir = os.path.join(kit, "reward")
    if os.path.isdir(rm_dir):
        rm, _ = load_reward_model(rm_dir, bf16=True)
        assert {p.dtype for p in rm.parameters()} == {torch.bfloat16}


def check_fused_head_on_sharded_weights(rank, world, kit):
    """action_logprobs through the fused, chunked head on FSDP2's sharded head: the same log-probs and gradients
    as the plain logits path."""
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.forward import action_logprobs
    from rlhf.models.lm_head import fusable_head
    from rlhf.models.load import load_causal_lm

    spec = EngineSpec(lr=1e-3, train_batch_size=2, micro_batch_size=1, total_steps=2)
    eng = FSDP2Engine(load_causal_lm(kit), spec)
    model = eng.model
    assert fusable_head(model) is not None, "FSDP2's sharded head must take the fused path"
    torch.manual_seed(rank)
    seq = torch.randint(3, 100, (3, 12))
    att = torch.ones_like(seq)
    att[0, :3] = 0
    res = {}
    for fused in (True, False):
        lp, _ = action_logprobs(model, seq, att, 5, temperature=0.7, chunk_size=4, fused=fused)
        lp.sum().backward()
        res[fused] = (lp.detach(), model.lm_head.weight.grad.full_tensor().clone(),
                      model.model.layers[0].mlp.up_proj.weight.grad.full_tensor().clone())
        model.zero_grad(set_to_none=True)
    for i, what in enumerate(("log-probs", "LM head gradient", "layer-0 gradient")):
        gap = (res[True][i] - res[False][i]).abs().max().item()
        assert gap < 1e-5, f"fused head on sharded weights: {what} differ by {gap}"


def run_all(rank, world, kit, out_dir):
    import contextlib
    from unittest import mock

    @contextlib.contextmanager
    def sdpa_for_flash():  # no flash-attn on CPU: the flag's dtype rules are what is tested
        with mock.patch("rlhf.models.load._attn", lambda flash: "sdpa"):
            yield

    frac = check_load_memory(rank, world, kit)
    check_fill_from_other_rank(rank, world, kit)
    acc = check_accumulation_memory(rank, world, kit)
    check_bf16_precision(rank, world, kit, sdpa_for_flash)
    check_fused_head_on_sharded_weights(rank, world, kit)
    from helpers.batching_checks import run_all as batching_checks  # --use_dynamic_batch, --adam_offload

    batching_checks(rank, world, kit)
    if rank == 0:
        with open(os.path.join(out_dir, "fsdp_checks.txt"), "w") as fh:
            fh.write(f"load_peak_fraction {frac:.3f}\naccum_grad_fraction {acc[False]:.3f} no_sync {acc[True]:.3f}\n")
