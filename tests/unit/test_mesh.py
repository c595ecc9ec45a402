"""RoleMesh (rlhf.distributed.mesh): coordinates, row ownership and the groups the placement builds, in-process."""
from types import SimpleNamespace

import pytest

from rlhf.config import TopologyConfig
from rlhf.distributed.mesh import RoleMesh, mesh_of
from rlhf.distributed.placement import make_placement, sp_groups_for, supervised_placement


def topo(**kw):
    t = TopologyConfig()
    for k, v in kw.items():
        setattr(t, k, v)
    return t


def test_three_ranks_one_owner_per_row_awkward_split():
    """3 data-parallel ranks over 7 rows: contiguous near-equal shards, every row reported exactly once."""
    owned = [mesh_of("actor", [0, 1, 2], r, {"dp": 3, "sp": 1}).owned_rows(7) for r in range(3)]
    assert owned == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert mesh_of("actor", [0, 1, 2], 5, {"dp": 3, "sp": 1}).owned_rows(7) is None, "a non-member owns nothing"


def test_sp_two_over_four_dp_sp_ownership():
    """dp 2 x sp 2 over ranks 4..7 (a role that does not start at 0): both SP ranks compute a DP shard, the SP
    group's first reports it; dp rank and coordinates follow the row-major layout."""
    ranks = [4, 5, 6, 7]
    got = []
    for r in ranks:
        m = mesh_of("critic", ranks, r, {"dp": 2, "sp": 2})
        got.append((m.coords(), m.dp_rank, m.dp_size, m.dp_rows(5), m.owned_rows(5)))
    assert got == [({"dp": 0, "sp": 0}, 0, 2, slice(0, 3), slice(0, 3)),
                   ({"dp": 0, "sp": 1}, 0, 2, slice(0, 3), None),
                   ({"dp": 1, "sp": 0}, 1, 2, slice(3, 5), slice(3, 5)),
                   ({"dp": 1, "sp": 1}, 1, 2, slice(3, 5), None)]
    assert m.ranks_along("sp") == [[4, 5], [6, 7]] and m.ranks_along("dp") == [[4, 6], [5, 7]]


def test_every_row_has_exactly_one_owner_dp3_sp2():
    ranks = list(range(6))
    cover = []
    for r in ranks:
        rows = mesh_of("actor", ranks, r, {"dp": 3, "sp": 2}).owned_rows(10)
        cover += list(range(rows.start, rows.stop)) if rows is not None else []
    assert sorted(cover) == list(range(10))


def test_dims_must_cover_the_ranks():
    with pytest.raises(ValueError, match=r"dims \{'dp': 2, 'sp': 2\} \(product 4\) do not cover its 6 ranks"):
        mesh_of("actor", list(range(6)), 0, {"dp": 2, "sp": 2})


def test_group_of_a_dim_without_a_group_says_what_to_use():
    m = RoleMesh("actor", [0, 1, 2, 3], 0, {"dp": 2, "sp": 2}, group="G", dim_groups={"sp": "S"})
    assert m.group_of("sp") == "S"
    with pytest.raises(KeyError, match="mesh.group"):
        m.group_of("dp")
    assert RoleMesh("actor", [0, 1], 0, {"dp": 2, "sp": 1}, group="G").group_of("dp") == "G"


def test_placement_dims_match_sp_groups_and_engines():
    """The mesh's inner dimension reproduces the placement's SP groups and the rollout engines' TP ranks."""
    p = make_placement(topo(actor_num_gpus_per_node=4, ref_num_gpus_per_node=2, vllm_num_engines=1,
                            vllm_tensor_parallel_size=2, ring_attn_size=2), 8)
    for role in ("actor", "ref"):
        m = mesh_of(role, p.ranks[role], 0, p.dims(role))
        assert m.ranks_along("sp") == p.sp_groups[role] == sp_groups_for(p.ranks[role], 2, 8, role)
    roll = mesh_of("rollout", p.ranks["rollout"], 6, p.dims("rollout"))
    assert p.dims("rollout") == {"dp": 1, "tp": 2} and roll.ranks_along("tp") == p.engine_ranks == [[6, 7]]
    assert roll.owned_rows(4) == slice(0, 4) and mesh_of("rollout", [6, 7], 7, p.dims("rollout")).owned_rows(4) is None
    assert p.named_ranks() == {"sync": [0, 6, 7], "trainers": [0, 1, 2, 3, 4, 5]}


def test_supervised_placement_is_one_model_over_the_world():
    p = supervised_placement(4, 4, 2)
    assert p.ranks["actor"] == [0, 1, 2, 3] and p.dims("actor") == {"dp": 2, "sp": 2} and p.named_ranks() == {}
    assert supervised_placement(3, 3, 1).dims("actor") == {"dp": 3, "sp": 1}
    from rlhf.distributed.placement import TopologyError
    with pytest.raises(TopologyError, match="must divide the world ranks"):
        supervised_placement(3, 3, 2)


def test_build_groups_meshes_and_named_groups(monkeypatch):
    """build_groups on every rank of a separate-rollout placement (groups faked): each rank's meshes, SP and TP
    groups and the named groups; the trainer ranks and the rollout-only ranks."""
    from rlhf.distributed import comm
    from rlhf.distributed.groups import build_groups

    monkeypatch.setattr(comm, "new_group", lambda ranks: tuple(ranks))
    monkeypatch.setattr(comm, "world_group", lambda: "WORLD")
    monkeypatch.setattr(comm, "check_groups_agree", lambda: None)
    p = make_placement(topo(actor_num_gpus_per_node=2, reward_num_gpus_per_node=2, vllm_num_engines=2,
                            vllm_tensor_parallel_size=1, ring_attn_size=2), 6, need_ref=False, need_reward_model=True)
    g = {r: build_groups(p, r) for r in range(6)}
    assert set(g[0].meshes) == {"actor", "reward", "rollout"}
    assert g[0].mesh("actor").sp.size == 2 and g[1].mesh("actor").sp.rank == 1
    assert g[0].mesh("actor").group == (0, 1) and g[2].mesh("actor").group is None
    assert g[2].mesh("reward").group_of("sp") == (2, 3) and g[2].mesh("reward").dp_rank == 0
    assert g[4].mesh("rollout").group_of("tp") == (4,) and g[5].mesh("rollout").dp_rank == 1
    assert g[0].ranks("rollout_reward") == [2, 3, 4, 5] and g[0].group("rollout_reward") is None
    assert g[4].group("rollout_reward") == (2, 3, 4, 5) and g[0].group("sync") == (0, 4, 5)
    assert [g[r].rollout_only for r in range(6)] == [False] * 4 + [True] * 2
    assert g[0].group("nothing") is None and g[0].mesh("critic") is None


def test_role_reads_its_mesh():
    from rlhf.distributed.sequence_parallel import SP
    from rlhf.roles.base import ModelRole
    from rlhf.roles.rollout import RolloutRole

    role = ModelRole("actor", RoleMesh("actor", [2, 3, 4, 5], 5, {"dp": 2, "sp": 2}, sp=SP(2, 1)))
    assert (role.members, role.index, role.dp_index, role.dp_size, role.rows(4)) == ([2, 3, 4, 5], 3, 1, 2, None)
    roll = RolloutRole("rollout", mesh_of("rollout", [0, 1, 2, 3], 2, {"dp": 2, "tp": 2}))
    assert roll.engine_ranks == [[0, 1], [2, 3]] and roll.engine_index == 1


def test_role_needs_are_the_placement_kwargs():
    from rlhf.distributed.placement import role_needs

    alg = SimpleNamespace(advantage_estimator="gae", init_kl_coef=0.0, use_kl_loss=False)
    assert role_needs(alg, SimpleNamespace(reward_pretrain=None, teacher_pretrain=None)) == dict(
        need_ref=False, need_critic=True, need_reward_model=False, need_teacher=False)
    alg = SimpleNamespace(advantage_estimator="group_norm", init_kl_coef=0.0, use_kl_loss=True)
    assert role_needs(alg, SimpleNamespace(reward_pretrain="rm", teacher_pretrain=None)) == dict(
        need_ref=True, need_critic=False, need_reward_model=True, need_teacher=False)


def test_batch_check_counts_data_parallel_ranks_of_the_mesh():
    """--ring_attn_size 2 over 4 ranks: 2 data-parallel actor ranks, so 6 = 3 x (micro 1 x 2) passes and
    micro 2 x 2 = 4 does not divide it (the SP ranks of a group take the same micro-batches)."""
    from rlhf.rl.checks import InputError, check_batch_sizes

    p = make_placement(topo(colocate_all_models=True, ring_attn_size=2), 4)
    optim = lambda micro: SimpleNamespace(train_batch_size=6, micro_train_batch_size=micro)  # noqa: E731
    samples = 3 * 2  # --rollout_batch_size 3 x --n_samples_per_prompt 2
    check_batch_sizes(optim(1), samples, p)
    with pytest.raises(InputError, match=r"micro_train_batch_size 2 x 2 actor ranks = 4"):
        check_batch_sizes(optim(2), samples, p)
