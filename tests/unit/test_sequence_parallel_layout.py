"""Sequence parallelism (Ulysses, --ring_attn_size), in process: the pure pieces by hand, the flag's checks, the
placement's SP groups (the 2-rank equality: tests/multiprocess/test_sequence_parallel.py)."""
import pytest
import torch


# ---- pure functions -------------------------------------------------------------------------------------------
def test_segments_of_a_packed_row():
    from rlhf.distributed.sequence_parallel import segments

    assert segments(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [(0, 3), (3, 5), (5, 6)], "a sample starts at position 0"
    assert segments(torch.tensor([[0, 1, 2, 3]])) == [(0, 4)]


def test_padding_slices_and_dp_coords():
    from rlhf.distributed.sequence_parallel import dp_coords, local_range, pad_packed, positions_in

    ids, pos = pad_packed(torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[0, 1, 2, 0, 1]]), 4)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]], "pad to a multiple of N with a token id"
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]], "the pad is a sample of its own (positions restart at 0)"
    assert [local_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert positions_in(torch.tensor([1, 3, 4, 7]), 2, 6) == (1, 3), "rows 3 and 4 lie in [2, 6)"
    # a role of 4 ranks with SP 2: members 0,1 are DP rank 0, members 2,3 DP rank 1
    assert [dp_coords(i, 4, 2) for i in range(4)] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]


def test_role_rows_one_owner_per_sp_group():
    """A role of 4 ranks with SP 2 is 2 data-parallel ranks: both ranks of a group compute the same rows, only the
    group's first reports them (sharding.gather_rows needs one owner per row)."""
    from rlhf.distributed.mesh import RoleMesh
    from rlhf.distributed.sequence_parallel import SP
    from rlhf.roles.base import ModelRole

    got = []
    for rank in range(4):
        role = ModelRole("actor", RoleMesh("actor", [0, 1, 2, 3], rank, {"dp": 2, "sp": 2}, sp=SP(2, rank % 2)))
        got.append((role.dp_index, role.dp_size, role.rows(8)))
    assert got == [(0, 2, slice(0, 4)), (0, 2, None), (1, 2, slice(4, 8)), (1, 2, None)], got


def test_placement_sp_groups_and_plan_print():
    from types import SimpleNamespace

    from rlhf.distributed.placement import TopologyError, make_placement

    def topo(**kw):
        base = dict(actor_num_nodes=1, actor_num_gpus_per_node=0, ref_num_nodes=1, ref_num_gpus_per_node=0,
                    critic_num_nodes=1, critic_num_gpus_per_node=0, reward_num_nodes=1, reward_num_gpus_per_node=0,
                    vllm_num_engines=0, vllm_tensor_parallel_size=1, colocate_all_models=False,
                    colocate_actor_ref=False, colocate_critic_reward=False, ring_attn_size=1)
        base.update(kw)
        return SimpleNamespace(**base)

    p = make_placement(topo(colocate_all_models=True, ring_attn_size=2), 4, need_critic=True)
    assert p.sp_groups["actor"] == [[0, 1], [2, 3]] and p.sp_groups["critic"] == [[0, 1], [2, 3]]
    assert "rollout" not in p.sp_groups, "generation is not split"
    assert "sp actor: 2 x 2 ranks" in p.table(), p.table()
    # actor 4 ranks + ref 2 ranks of its own: SP 4 does not divide the ref's 2 -> the error names a size that works
    with pytest.raises(TopologyError, match=r"--ring_attn_size 4 must divide the ref ranks \(2\).*--ring_attn_size 2"):
        make_placement(topo(actor_num_gpus_per_node=4, ref_num_gpus_per_node=2, ring_attn_size=4), 6)
    # 2 nodes x 3 ranks, actor on all 6, SP 2: group 2-3 would straddle the node boundary
    with pytest.raises(TopologyError, match="crosses a node boundary.*--ring_attn_size 1"):
        make_placement(topo(colocate_all_models=True, ring_attn_size=2), 6, nnodes=2)


def test_ring_attn_size_flag_checks(tiny_kit):
    from rlhf.config import parse
    from rlhf.distributed.sequence_parallel import check_sp, model_heads

    # OpenRLHF's flat and dotted spellings set the same field
    assert parse("sft", ["--ring_attn_size", "2", "--packing_samples"]).topology.ring_attn_size == 2
    assert parse("sft", ["--ds.ring_attn_size", "2", "--packing_samples"]).topology.ring_attn_size == 2
    with pytest.raises(Exception, match="--ring_attn_size 2 splits packed rows: add --packing_samples"):
        parse("sft", ["--ring_attn_size", "2"])
    with pytest.raises(Exception, match="train_rm does not split sequences; use --ring_attn_size 1"):
        parse("rm", ["--ring_attn_size", "2", "--packing_samples"])
    heads = model_heads(tiny_kit)
    assert heads == (4, 2), heads
    with pytest.raises(ValueError, match=r"key/value heads \(2\).*use --ring_attn_size 2"):
        check_sp(4, "sft", True, world=4, heads=heads)
    with pytest.raises(ValueError, match="must divide the world size 3; use --ring_attn_size 1"):
        check_sp(2, "sft", True, world=3, heads=heads)
    check_sp(2, "ppo", True, heads=heads)
