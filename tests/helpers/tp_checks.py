"""Tensor parallelism (--tp_size) and hybrid sharding (--fsdp_shard_size) against one process, run on 4 gloo ranks
inside tests/multiprocess/test_tensor_parallel.py's launch: each case trains one step of the FSDP2 engine on a
layout and the same step of a plain single-process model (same seed), and compares the loss, every gradient
(gathered: ``full_tensor``), the clipped gradient norm and every updated weight (one AdamW step) to TOL."""
from __future__ import annotations

import copy

import torch

TOL = 1e-5
VOCAB = 61  # odd: the vocabulary shards are uneven (31 + 30 rows)


def tiny(arch: str, tie: bool = False, kv_heads: int = 2, critic: bool = False):
    """A tiny model of ``arch`` from a config (awkward sizes: hidden 40, intermediate 36, head_dim 10)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=36, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=kv_heads, head_dim=10, max_position_embeddings=64, tie_word_embeddings=tie,
              attn_implementation="sdpa")
    if arch == "qwen3":
        kw["layer_types"] = ["full_attention"] * 2
    cfg = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(0)
    if critic:  # rlhf.models.critic: a backbone without LM head and a replicated value head
        from transformers import AutoModel

        from rlhf.models.critic import CriticModel

        model = CriticModel(AutoModel.from_config(cfg).float(), cfg.hidden_size)
    else:
        model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # biases (Qwen2's q/k/v) and norms away from their init: every term is tested
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def batch(seed: int = 0):
    """Six rows of a packed-able rollout: left-padded prompts (slot 5), right-padded responses (slot 7)."""
    g = torch.Generator().manual_seed(seed)
    P, R = 5, 7
    plens, rlens = [5, 2, 4, 3, 5, 1], [7, 3, 1, 6, 2, 5]
    seq = torch.zeros((len(plens), P + R), dtype=torch.long)
    att = torch.zeros_like(seq)
    for i, (p, r) in enumerate(zip(plens, rlens)):
        seq[i, P - p:P + r] = torch.randint(1, VOCAB, (p + r,), generator=g)
        att[i, P - p:P + r] = 1
    return seq, att, att[:, P:].clone()


def logprob_loss(model, seq, att, act, packed: bool):
    """-sum(logp) - 0.1 sum(entropy) over response tokens, / 40 (both through the fused LM head); a critic:
    sum((V - 0.3)^2) over response tokens, / 40."""
    from rlhf.models.forward import action_logprobs, packed_action_logprobs

    if not hasattr(model, "config"):
        return (((model(seq, att, act.size(1)) - 0.3) ** 2) * act).sum() / 40.0
    if packed:
        lp, ent = packed_action_logprobs(model, seq, att, act, 1.3, 7, with_entropy=True)
    else:
        lp, ent = action_logprobs(model, seq, att, act.size(1), 1.3, 7, with_entropy=True)
    return -((lp + 0.1 * ent) * act).sum() / 40.0


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_case(rank, what: str, arch: str, tp: int, sp: int, shard: int, tie: bool = False, load_on_first=True,
             kv_heads: int = 2, critic: bool = False):
    """One layout on the 4 ranks against one process; raises AssertionError naming the case and the tensor."""
    from rlhf.distributed import comm
    from rlhf.distributed.groups import build_groups
    from rlhf.distributed.placement import supervised_placement
    from rlhf.distributed.sequence_parallel import attach
    from rlhf.distributed.tensor_parallel import with_tp
    from rlhf.engines.fsdp2 import FSDP2Engine, to_meta
    from rlhf.engines.train import EngineSpec

    world = comm.world_size()
    plan = with_tp(supervised_placement(world, world, sp), tp, shard)
    mesh = build_groups(plan, rank).mesh("actor")
    ref = tiny(arch, tie, kv_heads, critic)
    model = copy.deepcopy(ref)
    if load_on_first and rank != 0:  # as a model built on the meta device: tied weights stay one tensor
        to_meta(model)
    spec = EngineSpec(lr=1e-3, train_batch_size=world // tp, micro_batch_size=1, total_steps=10, max_norm=0.5,
                      warmup_ratio=0.0, scheduler="constant", weight_decay=0.01)
    eng = FSDP2Engine(model, spec, mesh=mesh, load_on_first=load_on_first)
    check_layout(what, eng, tp, shard)
    attach(eng.model, mesh.sp)
    seq, att, act = batch()
    rows = mesh.dp_rows(seq.size(0))
    dp = mesh.dp_size
    loss = logprob_loss(eng.model, seq[rows], att[rows], act[rows], packed=sp > 1)
    eng.backward(loss * dp, 0)  # every rank of a dp group: the same loss; FSDP averages over dp (x sp) ranks
    total = comm.all_reduce(loss.detach().clone(), group=mesh.group) / mesh.replicas
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    ref_loss = logprob_loss(ref, seq, att, act, packed=sp > 1)
    ref_loss.backward()
    assert abs(float(total) - float(ref_loss)) < TOL, f"{what}: loss {float(total)} != one process {float(ref_loss)}"
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in eng.model.named_parameters():
        if n in eng.tp_partial:
            continue
        err = float((_full(p.grad) - grads[n]).abs().max())
        assert err < TOL, f"{what}: gradient of {n} differs from one process by {err}"
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    opt.step()
    norm = eng.step()["grad_norm"]
    assert abs(norm - ref_norm) < TOL, f"{what}: grad norm {norm} != one process {ref_norm}"
    want = dict(ref.named_parameters())
    for n, p in eng.model.named_parameters():
        err = float((_full(p.detach()) - want[n].detach()).abs().max())
        assert err < TOL, f"{what}: weight {n} after one AdamW step differs from one process by {err}"
    return eng


def check_layout(what: str, eng, tp: int, shard: int) -> None:
    """The engine built the layout the case names: k_proj and the LM head's weight sharded on their rows over TP,
    FSDP's mesh with a replicate dimension under --fsdp_shard_size."""
    # the GPU contract: the mesh is on the engine's compute device, not the parameters' (ranks 1-3 built the
    # model on the meta device, load_on_first; a mesh read from the parameters would be "meta" there)
    assert eng.device_mesh.device_type == eng.device.type, f"{what}: mesh on {eng.device_mesh.device_type}"
    inner = eng.model.backbone if hasattr(eng.model, "backbone") else eng.model.model
    k = inner.layers[0].self_attn.k_proj.weight
    names = k.device_mesh.mesh_dim_names
    assert ("tp" in names) == (tp > 1), f"{what}: k_proj mesh {names}, --tp_size {tp}"
    assert k.device_mesh.device_type == eng.device.type and k.to_local().device == eng.device, f"{what}: k_proj device"
    assert ("dp_replicate" in names) == bool(shard), f"{what}: mesh {names}, --fsdp_shard_size {shard}"
    if tp > 1:
        from torch.distributed.tensor import Shard

        assert k.placements[-1] == Shard(0), f"{what}: k_proj on tp is {k.placements[-1]}, want Shard(0)"
        if hasattr(eng.model, "backbone"):
            return
        head = eng.model.lm_head.weight
        assert head.placements[-1] == Shard(0), f"{what}: LM head on tp is {head.placements[-1]}, want Shard(0)"


def checkpoint_roundtrip(rank, eng, path: str) -> None:
    """A TP x FSDP engine's checkpoint (torch.distributed.checkpoint over 2-D DTensors) loads back bit for bit,
    and ``full_state_dict`` (group rank 0) holds the full tensors."""
    before = {n: _full(p.detach()).clone() for n, p in eng.model.named_parameters()}
    eng.save_checkpoint(path)
    with torch.no_grad():
        for p in eng.model.parameters():
            p.zero_()
    eng.load_checkpoint(path)
    for n, p in eng.model.named_parameters():
        assert torch.equal(_full(p.detach()), before[n]), f"checkpoint: {n} did not load back"
    full = eng.full_state_dict()
    if rank == 0:
        bad = [n for n in before if not torch.equal(full[n], before[n])]
        assert not bad, f"full_state_dict differs from the trained weights: {bad}"
