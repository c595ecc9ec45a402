"""The role table (rlhf/distributed/role_table.py): one declaration reaches the placement, the process groups'
order, ``Roles``, the declared stage list and the memory planner's stages."""
from types import SimpleNamespace

import pytest

from rlhf.config.schema import TopologyConfig
from rlhf.distributed import role_table
from rlhf.distributed.placement import make_placement, required_world_size, role_needs
from rlhf.distributed.role_table import Block, RoleDecl, Share
from rlhf.errors import TopologyError
from rlhf.planning.dims import ModelDims
from rlhf.planning.memory import Job, plan_memory
from rlhf.rl.stages import declared_forwards, memory_stages
from rlhf.roles.base import Roles


@pytest.fixture
def probe(monkeypatch):
    """Declare a throwaway role "probe" for one test (needed when the model config names ``probe_pretrain``)."""
    def declare(ranks, forward="ref_logprobs"):
        decl = RoleDecl("probe", ranks, need=lambda a, m: m.probe_pretrain is not None, need_kw="need_probe",
                        forward=forward)
        monkeypatch.setitem(role_table.ROLE_TABLE, "probe", decl)
        return decl
    return declare


def test_the_built_in_table_keeps_the_block_and_group_order():
    assert role_table.role_names() == ("actor", "ref", "critic", "reward", "rollout", "teacher")
    assert role_table.sp_role_names() == ("actor", "ref", "critic", "reward", "teacher")


def test_a_declared_role_reaches_placement_roles_and_stages(probe):
    probe(lambda t, needs: Share("actor"))
    alg = SimpleNamespace(advantage_estimator="group_norm", init_kl_coef=0.0, use_kl_loss=False)
    needs = role_needs(alg, SimpleNamespace(reward_pretrain=None, teacher_pretrain=None, probe_pretrain="dir"))
    assert needs == dict(need_ref=False, need_critic=False, need_reward_model=False, need_teacher=False,
                         need_probe=True)
    plan = make_placement(TopologyConfig(ring_attn_size=2), 4, **needs)
    assert plan.ranks["probe"] == plan.ranks["actor"] == [0, 1, 2, 3] and "probe" in plan.roles_of(0)
    assert plan.sp_groups["probe"] == [[0, 1], [2, 3]]
    assert make_placement(TopologyConfig(), 2, need_probe=False).ranks["probe"] == []
    actor, p = object(), object()
    roles = Roles(actor=actor, probe=p)
    assert roles.probe is p and list(roles.all()) == ["actor", "probe"] and roles.ref is None
    stages = declared_forwards(None, {"probe": True})
    assert [(s.name, s.role, s.writes) for s in stages] == [("probe", "probe", ("ref_logprobs",))]
    assert declared_forwards(None, {"probe": False}) == []
    assert ("probe", "probe") in memory_stages()["forward"]
    dims = ModelDims(hidden=8, layers=3, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=50, tied=False)
    planned = [s.name for s in plan_memory(Job(kind="rl", rollout_engine="hf"), {"actor": dims},
                                           make_placement(TopologyConfig(), 1, need_probe=True),
                                           on_cuda=False).groups[0].stages]
    assert planned.index("ref") < planned.index("probe") < planned.index("actor_update"), planned


def test_a_declared_block_is_taken_after_the_others_and_counted(probe):
    probe(lambda t, needs: Block("probe", 1, 2))
    t = TopologyConfig(actor_num_gpus_per_node=2, vllm_num_engines=1)
    assert required_world_size(t, need_ref=False, need_probe=True) == 5
    plan = make_placement(t, 5, need_ref=False, need_probe=True)
    assert (plan.ranks["actor"], plan.ranks["rollout"], plan.ranks["probe"]) == ([0, 1], [2], [3, 4])
    with pytest.raises(TopologyError, match="2 actor \\+ 1 rollout \\+ 2 probe = 5"):
        make_placement(t, 4, need_ref=False, need_probe=True)


def test_unknown_role_names_are_errors_naming_the_table():
    with pytest.raises(TypeError, match="need_student.*need_critic"):
        make_placement(TopologyConfig(), 1, need_student=True)
    with pytest.raises(TypeError, match="student.*role table"):
        Roles(actor=object(), student=object())
    with pytest.raises(AttributeError, match="no role 'student'"):
        Roles(actor=object()).student
