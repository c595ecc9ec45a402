"""The RL step's stage list (rlhf.rl.stages): chosen once from config and placement, each stage declaring its
role, the Batch fields it reads and writes and its watchdog deadline; the watchdog reads its deadlines from it."""
from __future__ import annotations

from dataclasses import fields

import pytest

from rlhf.batch import Batch
from rlhf.rl.stages import StageParts, build_stages, stage_deadlines

ORDER = ["rollout", "reward", "rollout_refill", "produce", "ref", "values", "old_logprobs", "logprob_gap",
         "advantages", "critic_update", "actor_update", "reward_ahead", "weight_sync"]


def _cfg(*extra, kind="grpo"):
    from rlhf.config import parse
    from rlhf.train_grpo import GRPO_DEFAULTS

    return parse(kind, ["--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--train_batch_size", "4",
                        "--micro_train_batch_size", "2", *extra], GRPO_DEFAULTS if kind == "grpo" else None)


def _stages(cfg, ref=False, critic=False, reward=False, agent=False, source=True):
    parts = StageParts(has={"ref": ref, "critic": critic, "reward": reward}, agent_mode=agent,
                       reward_source=(lambda *a: None) if source else None, forwards=None, rollouts=None, scorer=None,
                       sampler=None, scheduler=None, watchdog=None, weight_sync=None, reward_norm=None, guard=None,
                       queue=None, refill_draw=None, total_steps=4, timeouts=(10.0, 100.0, 110.0, 330.0))
    return build_stages(cfg.rollout, cfg.algorithm, cfg.optim, cfg.logging, cfg.data, parts)


def test_grpo_on_policy_stage_list_and_deadlines():
    st = _stages(_cfg())
    assert [s.name for s in st] == ["rollout", "reward", "logprob_gap", "advantages", "actor_update", "weight_sync"]
    assert stage_deadlines(st) == {"rollout": 100.0}, "the rest keep the watchdog's default"
    assert [s.name for s in st if not s.trainers_only] == ["rollout", "weight_sync"]
    sync = st[-1]
    assert (sync.role, sync.share, sync.tags) == ("rollout", "actor", ["weights"])


def test_ppo_with_critic_reference_and_reward_model():
    st = _stages(_cfg("--advantage_estimator", "gae", "--max_epochs", "2"), ref=True, critic=True, reward=True,
                 source=False)
    assert [s.name for s in st] == ["rollout", "reward", "ref", "values", "old_logprobs", "advantages",
                                    "critic_update", "actor_update", "weight_sync"]
    roles = {s.name: s.role for s in st}
    assert (roles["ref"], roles["values"], roles["old_logprobs"], roles["critic_update"]) == \
        ("ref", "critic", "actor", "critic")


def test_refill_replaces_rollout_and_reward_with_its_own_deadline():
    st = _stages(_cfg("--dynamic_filtering", "--dynamic_filtering_max_rounds", "2"))
    names = [s.name for s in st]
    assert names[0] == "rollout_refill" and "rollout" not in names and "reward" not in names
    assert stage_deadlines(st)["rollout_refill"] == 330.0 and st[0].refill.round_s == 110.0


def test_async_stages_skip_reward_and_wait_for_the_rollout_ranks():
    st = _stages(_cfg("--async_train", "--vllm_num_engines", "1"), reward=True, source=False)
    names = [s.name for s in st]
    assert names[:2] == ["rollout", "produce"] and "reward" not in names and names[-2:] == ["reward_ahead",
                                                                                           "weight_sync"]
    assert stage_deadlines(st) == {"rollout": 100.0, "produce": 100.0, "reward_ahead": 110.0, "weight_sync": 110.0}


@pytest.mark.parametrize("extra", [(), ("--advantage_estimator", "gae", "--init_kl_coef", "0.01"),
                                   ("--dynamic_filtering", "--dynamic_filtering_max_rounds", "1"),
                                   ("--async_train", "--vllm_num_engines", "1")])
def test_every_stage_declares_fields_of_the_batch_in_the_loop_order(extra):
    known = {f.name for f in fields(Batch)}
    st = _stages(_cfg(*extra), ref=True, critic=True, reward=True)
    assert [s.name for s in st] == [n for n in ORDER if n in {s.name for s in st}]
    for s in st:
        assert set(s.reads) <= known and set(s.writes) <= known, s
        assert type(s).run is not type(s).__mro__[-2].run, f"{s} has no run"


def test_the_memory_planner_plans_the_stages_the_loop_runs():
    """rlhf.planning.memory ``group_stages`` plans the forward and update stages of ``memory_stages`` (the stage
    classes' own names and roles), in the loop's order, for a job with every role colocated."""
    from rlhf.config.schema import TopologyConfig
    from rlhf.distributed.placement import make_placement
    from rlhf.planning.dims import ModelDims
    from rlhf.planning.memory import Job, plan_memory
    from rlhf.rl.stages import memory_stages

    dims = ModelDims(hidden=8, layers=3, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=50, tied=False)
    placement = make_placement(TopologyConfig(), 1, need_ref=True, need_critic=True, need_reward_model=True)
    plan = plan_memory(Job(kind="rl", rollout_engine="hf"), {"actor": dims}, placement, on_cuda=False)
    planned = [s.name for s in plan.groups[0].stages]
    declared = memory_stages()
    want = [name for name, role in declared["forward"] + declared["update"] if placement.ranks.get(role)]
    assert [n for n in planned if n in want] == want, planned


def test_stage_classes_take_their_rows_of_the_one_declaration():
    """rlhf.stage_table declares each stage's name, role, share, tags and memory kind once; the stage classes take
    theirs from it (what the scheduler wakes and the planner plans cannot drift apart), in the loop's order."""
    from rlhf.rl import stages as S
    from rlhf.stage_table import RL_STAGE, RL_STAGES

    assert [r.name for r in RL_STAGES] == ORDER
    every = [S.RolloutStage, S.RewardStage, S.RefillRolloutStage, S.ProduceStage, S.RewardAheadStage, S.RefStage,
             S.ValuesStage, S.OldLogprobsStage, S.LogprobGapStage, S.AdvantagesStage, S.UpdateStage("critic"),
             S.UpdateStage("actor"), S.WeightSyncStage]
    assert sorted(s.name for s in every) == sorted(ORDER)
    for s in every:
        row = RL_STAGE[s.name]
        tags = list(row.tags) if row.tags is not None else None
        assert (s.role, s.share, s.tags, s.memory) == (row.role, row.share, tags, row.memory), s
    built = _stages(_cfg("--init_kl_coef", "0.01"), ref=True, critic=True, reward=True)
    assert all((s.role, s.memory) == (RL_STAGE[s.name].role, RL_STAGE[s.name].memory) for s in built)


def test_the_planner_plans_exactly_the_declared_rows():
    """rlhf.planning.memory plans the declared rows with a memory kind, in their order (after start-up's shard and
    load): RL with every role, DPO with its reference."""
    from rlhf.config.schema import TopologyConfig
    from rlhf.distributed.placement import make_placement
    from rlhf.planning.dims import ModelDims
    from rlhf.planning.memory import Job, plan_memory
    from rlhf.stage_table import RL_STAGES, SUPERVISED_STAGES

    dims = ModelDims(hidden=8, layers=3, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=50, tied=False)
    placement = make_placement(TopologyConfig(), 1, need_ref=True, need_critic=True, need_reward_model=True)
    rl = plan_memory(Job(kind="rl", rollout_engine="hf"), {"actor": dims}, placement, on_cuda=False)
    assert [s.name for s in rl.groups[0].stages] == ["shard", "load"] + [r.name for r in RL_STAGES if r.memory]
    dpo = plan_memory(Job(kind="dpo"), {"actor": dims}, world=2, on_cuda=False)
    assert [s.name for s in dpo.groups[0].stages] == ["shard", "load"] + [r.name for r in SUPERVISED_STAGES]
