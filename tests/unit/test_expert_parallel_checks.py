"""--ep_size: the refusals before any process group (rlhf.config.parallel_checks.check_expert_parallel), the ep and
dp_mod_ep rank lines of a role (rlhf.distributed.expert_parallel.ep_lines, torchtitan's dp_shard_in_ep /
dp_shard_mod_ep), the placement's check and the planner's expert term."""
from __future__ import annotations

import json

import pytest

from rlhf.errors import ConfigError, TopologyError


def _model(tmp_path, name, **cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **cfg}))
    return str(d)


def _grpo(pretrain, *extra):
    from rlhf.config import parse

    return parse("grpo", ["--pretrain", pretrain, "--prompt_data", "p.jsonl", "--remote_rm_url",
                          "builtin:arithmetic", *map(str, extra)])


def test_ep_lines_are_consecutive_chunks_and_their_strides():
    from rlhf.distributed.expert_parallel import ep_lines

    ep, mod = ep_lines([3, 4, 5, 6, 7, 8], 2)  # a role on ranks 3..8
    assert ep == [[3, 4], [5, 6], [7, 8]] and mod == [[3, 5, 7], [4, 6, 8]]
    assert ep_lines([0, 1], 2) == ([[0, 1]], [[0], [1]])


def test_ep_size_refused_before_any_group(tmp_path):
    from rlhf.config.parallel_checks import check_expert_parallel

    moe = _model(tmp_path, "moe", num_experts=6)
    dense = _model(tmp_path, "dense")
    mixtral = _model(tmp_path, "mixtral", num_local_experts=4)
    check_expert_parallel(_grpo(moe, "--ep_size", 2), "grpo", 4)  # 6 experts, 4 ranks: fine
    check_expert_parallel(_grpo(mixtral, "--ep_size", 4), "grpo", 4)
    check_expert_parallel(_grpo(dense), "grpo", 4)  # --ep_size 1: nothing checked
    for path, extra, world, msg in [
        (dense, (), 2, "is not a mixture-of-experts model"),
        (moe, ("--ep_size", 4), 4, r"must divide the 6 experts of .*use one of \[1, 2, 3, 6\]"),
        (moe, ("--ep_size", 3), 4, r"--ep_size 3 must divide the actor's 4 ranks; use one of \[1, 2, 4\]"),
        (moe, ("--backend", "deepspeed"), 2, "needs --backend fsdp2"),
        (moe, ("--tp_size", 2), 4, "with --tp_size 2 is not supported here; use --ep_size 1 or --tp_size 1"),
        (moe, ("--fsdp_shard_size", 2), 4, "--fsdp_shard_size 2"),
        (moe, ("--ring_attn_size", 2, "--packing_samples"), 4, "--ring_attn_size 2"),
        (moe, ("--lora_rank", 4), 4, "--lora_rank 4"),
        (moe, ("--adam_offload",), 4, "--adam_offload 1"),
        (moe, ("--ep_size", 0), 4, "must be >= 1"),
    ]:
        extra = extra if "--ep_size" in extra else ("--ep_size", 2, *extra)
        with pytest.raises(ConfigError, match=msg) as e:
            check_expert_parallel(_grpo(path, *extra), "grpo", world)
        assert e.value.flag == "ep_size", (extra, e.value.flag)
    with pytest.raises(ConfigError, match="train_ppo / train_grpo only"):
        check_expert_parallel(_grpo(moe, "--ep_size", 2), "sft", 2)


def test_preflight_refuses_ep_on_a_dense_kit(tiny_kit):
    from rlhf.config.preflight import preflight

    with pytest.raises(ConfigError, match="is not a mixture-of-experts model") as e:  # every rank, before any group
        preflight(_grpo(tiny_kit, "--ep_size", 2), "grpo", 2)
    assert e.value.flag == "ep_size"


def test_with_ep_sets_the_actor_and_ref_meshes():
    from rlhf.distributed.expert_parallel import ep_of, with_ep
    from rlhf.distributed.placement import supervised_placement

    plan = with_ep(supervised_placement(4, 4, 1), 2)
    assert plan.ep_size == 2 and ep_of(plan, "actor") == 2 and ep_of(plan, "ref") == 2 and ep_of(plan, "critic") == 1
    with pytest.raises(TopologyError, match=r"--ep_size 3 must divide the actor's 4 ranks"):
        with_ep(supervised_placement(4, 4, 1), 3)


def test_planner_holds_experts_over_ep_outside_fsdp():
    """An MoE actor's experts are E/ep per rank under --ep_size (terms.ep_states), the dense weights FSDP2 shards."""
    from types import SimpleNamespace

    from rlhf.planning.dims import ModelDims
    from rlhf.planning.job import Job
    from rlhf.planning.memory import role_states
    from rlhf.planning.plan_types import RoleModel

    c = SimpleNamespace(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=96, moe_intermediate_size=40, num_experts=6, vocab_size=100,
                        model_type="qwen3_moe")
    d = ModelDims.from_config(c)
    assert d.layer_expert_params == 6 * 3 * 64 * 40
    assert d.layer_params == 64 * (64 + 2 * 32) + 64 * 64 + 6 * 3 * 64 * 40 + 64 * 6 + 2 * 64  # experts + router
    actor = RoleModel(d, ranks=4, trainable=True, lm=True)
    x = 3 * d.layer_expert_params
    one, two = role_states(Job(backend="fsdp2"), actor), role_states(Job(backend="fsdp2", ep_size=2), actor)
    assert one.params == 4.0 * d.params / 4  # ep 1: every weight sharded over the 4 FSDP ranks
    assert two.params == 4.0 * (d.params - x) / 4 + 4.0 * x / 2, (two.params, x)  # ep 2: experts over 2 ranks
    assert two.grads == two.params and two.optimizer == 2 * two.params
    critic = RoleModel(d, ranks=4, trainable=True, lm=False)  # not an EP role: unchanged
    assert role_states(Job(backend="fsdp2", ep_size=2), critic).params == role_states(Job(backend="fsdp2"), critic).params
