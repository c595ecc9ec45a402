"""--tp_size / --fsdp_shard_size without process groups: the role's DeviceMesh ranks, the placement's checks, the
TP plan per architecture, the flags' refusals (ConfigError before any group) and the memory planner's terms and
suggestions.  Multi-rank equality: tests/multiprocess/test_tensor_parallel.py; the CLI: tests/e2e."""
from dataclasses import replace

import pytest

from rlhf.distributed.mesh import mesh_of
from rlhf.distributed.tensor_parallel import dim_names, mesh_ranks, with_tp
from rlhf.errors import ConfigError, TopologyError


def test_mesh_ranks_dp_tp_sp_and_hsdp():
    """16 ranks = dp 2 x tp 2 x sp 4: member (d, t, s) is rank (2d + t) 4 + s; the FSDP ranks of TP coordinate t
    are dp x sp flattened (torchtitan's dp_shard_cp); --fsdp_shard_size 4 splits those 8 into 2 x 4."""
    m = mesh_of("actor", list(range(16)), 0, {"dp": 2, "tp": 2, "sp": 4})
    r = mesh_ranks(m)
    assert tuple(r.shape) == (1, 8, 2) and dim_names(r) == ["dp_shard", "tp"]
    assert r[0, :, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11] and r[0, :, 1].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert m.replicas == 8 and m.ranks_along("sp")[0] == [0, 1, 2, 3] and m.ranks_along("tp")[0] == [0, 4]
    m.shard_size = 4
    h = mesh_ranks(m)
    assert tuple(h.shape) == (2, 4, 2) and dim_names(h) == ["dp_replicate", "dp_shard", "tp"]
    assert h[1, :, 1].tolist() == [12, 13, 14, 15] and h[:, 0, 0].tolist() == [0, 8]
    plain = mesh_of("actor", list(range(4, 8)), 4, {"dp": 2, "sp": 2})  # neither: FSDP2 over the role's group
    assert mesh_ranks(plain) is None
    plain.shard_size = 2
    assert mesh_ranks(plain)[:, :, 0].tolist() == [[4, 5], [6, 7]]


def test_placement_dims_and_refusals():
    from rlhf.config import TopologyConfig
    from rlhf.distributed.placement import make_placement

    t = TopologyConfig()
    t.colocate_all_models = True
    plan = with_tp(make_placement(t, 8), 2, 2)
    assert plan.dims("actor") == {"dp": 4, "tp": 2, "sp": 1} and plan.dims("rollout") == {"dp": 8, "tp": 1}
    assert "tp 2 (--tp_size)" in plan.table()
    with pytest.raises(TopologyError, match=r"--tp_size 3 must divide the ranks per node \(8\).*--tp_size 2"):
        with_tp(make_placement(t, 8), 3, 0)
    with pytest.raises(TopologyError, match=r"--fsdp_shard_size 3 must divide the actor's 4 FSDP ranks.*\[1, 2, 4\]"):
        with_tp(make_placement(t, 8), 2, 3)


def _tiny(arch, **kw):
    """What layer_plan reads of a model: its config (transformers' own, with its ``base_model_tp_plan``)."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    return SimpleNamespace(config=AutoConfig.for_model(arch, num_attention_heads=4, num_key_value_heads=2, **kw))


def test_plans_from_transformers_and_refused_architectures():
    from rlhf.distributed.tensor_parallel import check_heads, layer_plan

    llama = layer_plan(_tiny("llama"))
    assert llama == {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                     "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                     "mlp.down_proj": "rowwise"}
    q3 = layer_plan(_tiny("qwen3"))
    assert q3["self_attn.q_norm"] == "replicated_with_grad_allreduce"
    moe = layer_plan(_tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8))
    assert not [k for k in moe if "experts" in k] and moe["self_attn.o_proj"] == "rowwise"
    with pytest.raises(ValueError, match=r"no tensor-parallel plan for the 'gpt2' architecture.*--tp_size 1"):
        layer_plan(_tiny("gpt2"))
    with pytest.raises(ValueError, match=r"--tp_size 4 \(x --ring_attn_size 1\).*key/value heads \(2\); use --tp_size 2"):
        check_heads(4, 2, 4)


def _grpo(kit, *extra):
    from rlhf.config import parse

    return parse("grpo", ["--pretrain", kit, "--prompt_data", f"{kit}/data/prompts_train.jsonl", "--remote_rm_url",
                          "builtin:arithmetic", *map(str, extra)])


def test_flags_refused_before_any_group(tiny_kit):
    from rlhf.config.parallel_checks import check_tensor_parallel

    cfg = _grpo(tiny_kit, "--ds.tensor_parallel_size", 2)  # OpenRLHF's flag becomes --tp_size
    assert cfg.parallel.tp_size == 2
    check_tensor_parallel(cfg, "grpo", 2)
    for bad, flag, msg in [
        ((), "tp_size", r"--tp_size 2 must divide the ranks per node \(3\).*use --tp_size 1"),
        (("--backend", "deepspeed"), "tp_size", "needs --backend fsdp2"),
        (("--lora_rank", 4), "tp_size", "LoRA layers have no TP plan"),
        (("--tp_size", 1, "--fsdp_shard_size", 2), "fsdp_shard_size", r"must divide the actor's 3 FSDP ranks"),
    ]:
        c = _grpo(tiny_kit, "--tp_size", 2, *bad)
        with pytest.raises(ConfigError, match=msg) as e:
            check_tensor_parallel(c, "grpo", 3 if not bad or bad[0] == "--tp_size" else 2)
        assert e.value.flag == flag
    with pytest.raises(ConfigError, match="train_ppo / train_grpo only"):
        check_tensor_parallel(cfg, "sft", 2)
    big = _grpo(tiny_kit, "--tp_size", 8)  # the kit's 4 heads / 2 kv heads
    with pytest.raises(ConfigError, match=r"key/value heads \(2\); use --tp_size 2"):
        check_tensor_parallel(big, "grpo", 8)


def test_planner_divides_by_tp_and_shards_by_the_shard_group():
    from rlhf.config import TopologyConfig
    from rlhf.distributed.placement import make_placement
    from rlhf.planning import Job, plan_memory, terms
    from rlhf.planning.dims import ModelDims
    from rlhf.planning.memory import role_states
    from rlhf.planning.plan_types import RoleModel

    d = ModelDims.known("llama3-70b")
    rm = RoleModel(d, 8, True, True)
    full = role_states(Job(bf16=True), rm)
    tp = role_states(Job(bf16=True, tp_size=8), rm)
    # 8 ranks: FSDP over 8 or TP 8 x FSDP 1 hold the same states; the gathered units shrink by tp
    assert abs(tp.params - full.params) / full.params < 1e-3 and abs(tp.optimizer - full.optimizer) < 1e-3 * full.optimizer
    assert abs(tp.gathered * 8 - full.gathered) / full.gathered < 1e-3
    hsdp = role_states(Job(bf16=True, fsdp_shard_size=2), rm)  # sharded over 2, replicated over 4
    assert abs(hsdp.params - 4 * full.params) < 1e-6 * full.params
    # activations: all but the norms' terms / tp (hand: per token 2 (4 + 2c) h + the rest / tp)
    one = terms.layer_activation_bytes(d, 1, 2, "flash")
    assert terms.layer_activation_bytes(d, 1, 2, "flash", tp=4) == pytest.approx((one - 16 * d.hidden) / 4 + 16 * d.hidden)
    # the fixes offer --tp_size where the heads allow it (Qwen2.5-7B: 28 heads, 4 kv heads: 2 and 4, not 8), for
    # FSDP2 RL jobs without LoRA; --fsdp_shard_size 0 where HSDP is on; TP lowers the update's peak when re-planned
    from rlhf.planning.fixes import _candidates

    q7 = ModelDims.known("qwen2.5-7b")
    job = Job(bf16=True, gradient_checkpointing=True, micro_train_batch_size=2, generate_max_len=16384,
              vllm_enable_sleep=True, lm_head_keep_mb=0, fsdp_shard_size=4)
    tps = [ch["tp_size"] for ch in _candidates(job, True, 8, q7) if "tp_size" in ch]
    assert tps == [2, 4] and {"fsdp_shard_size": 0} in _candidates(job, True, 8, q7)
    for other in (replace(job, backend="deepspeed"), replace(job, lora_rank=8), replace(job, kind="sft")):
        assert not [ch for ch in _candidates(other, True, 8, q7) if "tp_size" in ch], other
    t = TopologyConfig()
    t.colocate_all_models = True
    pl = make_placement(t, 8)

    def update_peak(j):
        return next(s.total for s in plan_memory(j, {"actor": q7}, pl, device_bytes=80 * GiB).groups[0].stages
                    if s.name == "actor_update")

    assert update_peak(replace(job, tp_size=4)) < update_peak(replace(job, tp_size=2)) < update_peak(job)


GiB = 1 << 30
