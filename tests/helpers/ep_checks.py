"""--ep_size on the FSDP2 engine against one process, run on 2 gloo ranks inside
tests/multiprocess/test_expert_parallel.py's launch: the actor's experts split over the ep group, FSDP2 over the
rest, one AdamW step; the loss, every gradient (``full_tensor``), the clipped norm and every updated weight equal
one plain process's to TOL, the checkpoint round-trips, and the weight sync's blocks cover each expert once."""
from __future__ import annotations

import copy

import torch

from helpers.tp_checks import TOL, VOCAB, batch, checkpoint_roundtrip, logprob_loss


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def engine_case(rank, tmp: str, ep: int = 2) -> None:
    from torch.distributed.tensor import Shard

    from helpers.models import tiny_moe
    from rlhf.distributed import comm
    from rlhf.distributed.expert_parallel import WEIGHTS, with_ep
    from rlhf.distributed.groups import build_groups
    from rlhf.distributed.placement import supervised_placement
    from rlhf.engines.fsdp2 import FSDP2Engine, to_meta
    from rlhf.engines.train import EngineSpec

    world = comm.world_size()
    mesh = build_groups(with_ep(supervised_placement(world, world, 1), ep), rank).mesh("actor")
    assert mesh.ep_size == ep and "ep" in mesh.dim_groups, f"--ep_size {ep}: the actor mesh has no ep group"
    ref = tiny_moe(layers=2, vocab=VOCAB, expert_std=0.3)
    model = copy.deepcopy(ref)
    if rank != 0:  # load_on_first: the other ranks built the model on meta
        to_meta(model)
    spec = EngineSpec(lr=1e-3, train_batch_size=world, micro_batch_size=1, total_steps=10, max_norm=0.5,
                      warmup_ratio=0.0, scheduler="constant", weight_decay=0.01)
    eng = FSDP2Engine(model, spec, mesh=mesh, load_on_first=True)
    experts = [n for n, _ in eng.model.named_parameters() if n.rsplit(".", 1)[-1] in WEIGHTS]
    assert len(experts) == 4 and len(eng.experts) == 4, f"EP engine: expert weights {experts}"
    for n, p in eng.model.named_parameters():
        if n in experts:  # this rank's E/ep experts, a DTensor on the (dp_mod_ep, ep) mesh
            assert p.placements[-1] == Shard(0) and p.to_local().shape[0] == 4 // ep, f"{n}: {p.placements}"
            assert p.device_mesh.mesh_dim_names == ("dp_mod_ep", "ep"), f"{n}: {p.device_mesh}"
            # the GPU contract: the ep mesh is on the engine's device (rank 1 built its model on meta)
            assert p.device_mesh.device_type == eng.device.type, f"{n}: ep mesh on {p.device_mesh.device_type}"
            assert p.to_local().device == eng.device, f"{n}: shard on {p.to_local().device}, engine {eng.device}"
    seq, att, act = batch()
    rows = mesh.dp_rows(seq.size(0))
    loss = logprob_loss(eng.model, seq[rows], att[rows], act[rows], packed=False)
    eng.backward(loss * world, 0)  # FSDP2 (and reduce_expert_grads) average over the ranks
    total = comm.all_reduce(loss.detach().clone(), group=mesh.group)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    ref_loss = logprob_loss(ref, seq, att, act, packed=False)
    ref_loss.backward()
    what = f"EP {ep} engine"
    assert abs(float(total) - float(ref_loss)) < TOL, f"{what}: loss {float(total)} != one process {float(ref_loss)}"
    want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    opt.step()
    norm = eng.step()["grad_norm"]
    assert abs(norm - want_norm) < TOL, f"{what}: grad norm {norm} != one process {want_norm}"
    want = dict(ref.named_parameters())
    for n, p in eng.model.named_parameters():
        err = float((_full(p.detach()) - want[n].detach()).abs().max())
        assert err < TOL, f"{what}: weight {n} after one AdamW step differs from one process by {err}"
    _sync_blocks(eng, experts, world)
    checkpoint_roundtrip(rank, eng, tmp)


def _sync_blocks(eng, experts, world) -> None:
    """The shard weight sync (rlhf.distributed.shard_sync.block) sends each expert row once over the ranks."""
    from rlhf.distributed import comm
    from rlhf.distributed.shard_sync import block

    params = dict(eng.model.named_parameters())
    for n in experts:
        b = block(params[n], comm.rank())
        rows = torch.zeros(params[n].shape[0])
        if b is not None:
            rows[b[0][0]:b[0][0] + b[1][0]] = 1
        comm.all_reduce(rows)
        assert torch.equal(rows, torch.ones_like(rows)), f"weight sync blocks of {n} cover rows {rows.tolist()}"
