"""Expert parallelism (rlhf.distributed.expert_parallel): EP 2 equals EP 1 on two gloo ranks."""
from __future__ import annotations

from helpers.mp import spawn


def _ep2_vs_ep1(rank, world, tmp):
    import copy

    import torch
    from helpers.models import tiny_moe
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf.distributed import comm
    from rlhf.distributed.expert_parallel import WEIGHTS, expert_modules, shard_experts

    ref = tiny_moe(layers=2, expert_std=0.3)  # seeded: the same weights on both ranks
    ep = copy.deepcopy(ref)
    assert shard_experts(ep, init_device_mesh("cpu", (world,))) == 2
    for a, b in zip(expert_modules(ep), expert_modules(ref)):
        for name in WEIGHTS:
            shard = getattr(a, name)
            assert shard.to_local().shape[0] == 2 and torch.equal(shard.full_tensor(), getattr(b, name))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 96, (4, 9), generator=g)  # 2 rows per rank, no padding: equal token counts
    mine = ids[2 * rank:2 * rank + 2]
    loss = ep(input_ids=mine, labels=mine).loss / world  # the mean over every rank's tokens, this rank's share
    loss.backward()
    total = comm.all_reduce(loss.detach().clone(), "sum")
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    assert abs(float(total) - float(want)) < 1e-5, (float(total), float(want))
    refp = dict(ref.named_parameters())
    worst = 0.0
    for name, p in ep.named_parameters():
        if name.rsplit(".", 1)[-1] in WEIGHTS:  # this rank's experts: every rank's tokens already summed in
            got, full = p.grad.to_local(), refp[name].grad[2 * rank:2 * rank + 2]
        else:  # replicated: the data-parallel sum
            got, full = comm.all_reduce(p.grad.clone(), "sum"), refp[name].grad
        worst = max(worst, float((got - full).abs().max()))
        assert float(full.abs().max()) > 0 or "gate" in name, f"{name}: no gradient in the reference"
    assert worst < 1e-5, f"EP 2 gradients differ from EP 1 by {worst}"
    from helpers.ep_checks import engine_case

    engine_case(rank, f"{tmp}/ckpt")  # --ep_size 2 on the FSDP2 engine: one update equals one process


def test_ep2_equals_ep1_on_two_gloo_ranks(tmp_path):
    """4 experts over 2 ranks (2 each), top-2, tokens of both ranks dispatched by all-to-all: the loss and every
    gradient (expert shards against the full model's slice, the rest summed over ranks) equal one process's to
    1e-5; the shards' full_tensor() is the original stack.  Then the FSDP2 engine with --ep_size 2
    (helpers.ep_checks): one AdamW update equals one process's (loss, norm, every weight), the checkpoint loads
    back, the weight sync's blocks cover every expert once."""
    spawn(_ep2_vs_ep1, 2, str(tmp_path))
