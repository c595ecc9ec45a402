"""The memory planner (rlhf/planning): each term against a hand computation, parameter counts against real
modules, the recipes' plans, suggestions that fit when re-planned, the CLI and the trainers' start-up check."""
import re
from dataclasses import replace

import pytest

from rlhf.config import ConfigError, build_config, load_yaml
from rlhf.config.preflight import memory_notices
from rlhf.plan import main as plan_main
from rlhf.planning import Job, MemoryPlanError, plan_memory, suggest, terms
from rlhf.planning.dims import KNOWN, ModelDims, write_config

GiB = terms.GiB
# h 8, 2 heads of 4, 1 kv head, MLP 16, vocabulary 50, 3 layers, untied
SMALL = ModelDims(hidden=8, layers=3, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=50, tied=False)


def test_param_counts_equal_the_real_modules_and_the_published_sizes():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    # hand: layer = h(q + 2kv) + qh + 3hi + 2h = 128 + 64 + 384 + 16 = 592; root = 2 V h + h = 808
    assert SMALL.layer_params == 592 and SMALL.params == 3 * 592 + 808 == 2584
    kw = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
              vocab_size=50, tie_word_embeddings=False)
    with torch.device("meta"):
        llama = LlamaForCausalLM(LlamaConfig(**kw))
        qwen = Qwen2ForCausalLM(Qwen2Config(**kw))
    assert ModelDims.from_config(llama.config).params == sum(p.numel() for p in llama.parameters()) == 2584
    # Qwen2: q/k/v biases, q + 2 kv = 16 more per layer
    assert ModelDims.from_config(qwen.config).params == sum(p.numel() for p in qwen.parameters()) == 2584 + 3 * 16
    # the published sizes: Qwen2.5-7B 7.62B, Llama-3-70B 70.55B, Qwen2.5-0.5B 0.49B (tied head)
    assert ModelDims.known("qwen2.5-7b").params == 7_615_616_512
    assert ModelDims.known("llama3-70b").params == 70_553_706_496
    assert ModelDims.known("qwen2.5-0.5b").params == 494_032_768


def test_config_json_read_with_autoconfig(tmp_path):
    write_config("llama3-70b", str(tmp_path))
    assert ModelDims.from_pretrained(str(tmp_path)) == ModelDims.known("llama3-70b")


def test_fsdp2_states_by_hand():
    st = terms.fsdp2_states(1000, 4, 2, 3, True, layer_params=100, root_params=200)
    # 4N/dp fp32 params, 4N/dp grads, 8N/dp Adam; gathered bf16 root + 2 layers = 2 (200 + 200)
    assert (st.params, st.grads, st.optimizer, st.gathered) == (1000, 1000, 2000, 800)
    assert terms.fsdp2_states(1000, 4, 2, 2, True, 100, 200).gathered == 2000  # zero 2: every unit stays gathered
    assert terms.fsdp2_states(1000, 4, 2, 3, True, 100, 200, no_sync=True).grads == 4000  # full fp32 grads
    off = terms.fsdp2_states(1000, 4, 2, 3, True, 100, 200, adam_offload=True)
    assert off.resident == 0 and off.host == 4000 and off.gathered == 800
    plain = terms.fsdp2_states(1000, 1, 4, 3, False, 100, 200)  # one rank, fp32: a plain module
    assert (plain.params, plain.grads, plain.optimizer, plain.gathered) == (4000, 0, 0, 0)


def test_deepspeed_states_equal_deepspeeds_estimators():
    # deepspeed estimate_zero3_model_states_mem_needs (no offload): 4 x largest layer + 18 N / gpus
    z3 = terms.deepspeed_states(8000, 8, True, 3, True, layer_params=100)
    assert z3.resident == 18 * 8000 / 8 and z3.gathered == 400
    # estimate_zero2_model_states_mem_needs (no offload): 2 N + 18 N / gpus
    assert terms.deepspeed_states(8000, 8, True, 2, True, 100).total == 2 * 8000 + 18 * 8000 / 8
    z3off = terms.deepspeed_states(8000, 8, True, 3, True, 100, adam_offload=True)
    assert z3off.optimizer == 0 and z3off.host == 16 * 8000 / 8
    assert terms.deepspeed_states(8000, 8, True, 3, False, 100).params == 2 * 8000 / 8  # frozen ZeRO-3 partitions


def test_layer_activations_by_hand():
    # sdpa with a padding mask repeats k/v to every head (kv' = q = 8), c = 2, per token:
    # norms 2 (4 + 4) 8 = 128; q,k,v 2 (8 + 16) = 48; MLP 4 * 2 * 16 = 128; attention out 2*2*8 + 4*2 = 40
    assert terms.layer_activation_bytes(SMALL, 10, 2, "sdpa") == 344 * 10
    # flash: kv = 4 -> 2 (8 + 8) = 32; out 2*8 + 8 = 24
    assert terms.layer_activation_bytes(SMALL, 10, 2, "flash") == 312 * 10
    # eager, s = 5: k/v not repeated (32), out 40, scores a s (4 + c) = 2*5*6 = 60
    assert terms.layer_activation_bytes(SMALL, 10, 2, "eager", seq=5) == 388 * 10


def test_activations_with_and_without_checkpointing_by_hand():
    # b 2 x s 5 = 10 tokens; final norm (4 + 4) 8 10 = 640; bool mask b s^2 = 50 + bf16 copies 2 b s^2 = 100 each
    assert terms.activation_bytes(SMALL, 2, 5, 2, "sdpa") == 3 * 3440 + 640 + 50 + 3 * 100
    # checkpointing: each block's input c h t = 160 x 3, one block recomputed, one mask copy
    assert terms.activation_bytes(SMALL, 2, 5, 2, "sdpa", checkpointing=True) == 3 * 160 + 3440 + 640 + 150
    # sequence parallel 2, flash: 5 tokens per rank, no mask
    assert terms.activation_bytes(SMALL, 2, 5, 2, "flash", sp=2) == 3 * 312 * 5 + 8 * 8 * 5
    # no graph: one block's working set t (2 c h + 4 h + 3 c i) = 10 (32 + 32 + 96) + mask 150
    assert terms.inference_activation_bytes(SMALL, 2, 5, 2, "sdpa") == 1600 + 150


def test_root_gradient_buffers_by_hand():
    # untied, FSDP2-sharded, c 2: the root's unsharded bf16 gradient and its fp32 copy, (2 + 4) x 808
    assert terms.root_grad_bytes(SMALL, 2, sharded=True) == 6 * 808
    assert terms.root_grad_bytes(SMALL, 4, sharded=False) == 0  # plain module, untied: nothing beyond .grad
    tied = replace(SMALL, tied=True)  # root 50 x 8 + 8 = 408; two V h fp32 gradients before they are summed
    assert terms.root_grad_bytes(tied, 4, sharded=False) == 4 * 50 * 8
    assert terms.root_grad_bytes(tied, 2, sharded=True) == 4 * 50 * 8 + 6 * 408


def test_lm_head_and_kv_by_hand():
    # 100 rows, V 1000, chunks of 32: the keep budget (512 KiB = 131 rows) holds all 100 rows -> 100 x 4000
    # kept; one chunk 32 x 1000 x (2 + 4 + 4)
    assert terms.lm_head_bytes(100, 1000, 2, 32, 1 << 19, grad=True) == 400_000 + 320_000
    assert terms.lm_head_bytes(100, 1000, 2, 32, 1 << 19, grad=False) == 320_000
    assert terms.lm_head_bytes(100, 1000, 2, 32, 100_000, grad=True) == 320_000  # 25 rows: no whole chunk kept
    assert terms.lm_head_bytes(100, 1000, 4, 32, 0, grad=True) == 32 * 1000 * 8  # fp32: no cast copy
    assert terms.lm_head_bytes(100, 1000, 2, 32, 0, grad=True, fused=False) == 100 * 1000 * 10
    assert terms.kv_cache_bytes(SMALL, 3, 7, 2) == 2 * 3 * 4 * 2 * 3 * 7


def test_no_grad_head_keeps_nothing():
    """A no-grad forward of a trainable model (old log-probs, eval) must not fill the keep arena: the planner
    counts no kept chunks there (the measured CPU bench found 370 MiB kept for nothing before this)."""
    import torch

    from rlhf.models import lm_head

    lm_head._ARENA.buf = None
    w = torch.randn(300, 16, requires_grad=True)
    with torch.no_grad():
        lm_head.head_logprobs(torch.randn(64, 16), w, None, torch.randint(0, 300, (64,)))
    assert lm_head._ARENA.buf is None


def _cfg(recipe=None, **kw):
    values = load_yaml(recipe) if recipe else {}
    values.update(kw)
    return build_config(values, "plan")


def test_job_from_flags_reads_every_planner_flag_from_its_group():
    """Every ``Job`` field is a flag of one of the five groups the builder is given (a field no group has would
    silently plan with its default), each flag's value arrives, and ``Job.on`` decides --rollout_engine auto."""
    from dataclasses import fields

    from rlhf.planning import job_from_flags

    cfg = _cfg(micro_train_batch_size=2, generate_max_len=77, zero_stage=2, vllm_gpu_memory_utilization=0.3,
               lora_rank=4, max_len=999)
    groups = (cfg.model, cfg.data, cfg.topology, cfg.rollout, cfg.optim, cfg.parallel)  # + --tp_size, --fsdp_shard_size
    job = job_from_flags("grpo", *groups)
    for f in fields(Job):
        if f.name in ("kind", "rl_max_len"):
            continue
        holders = [g for g in groups if hasattr(g, f.name)]
        assert len(holders) == 1, f"Job.{f.name}: in {len(holders)} of the flag groups"
        assert getattr(job, f.name) == getattr(holders[0], f.name), f.name
    assert (job.kind, job.rl_max_len, job.micro_train_batch_size, job.generate_max_len) == ("rl", 999, 2, 77)
    assert job_from_flags("sft", *groups).rl_max_len == 0
    assert job.rollout_engine == "auto"
    assert [job.on(c, v).rollout_engine for c, v in ((True, True), (True, False), (False, True))] == ["vllm", "hf", "hf"]
    assert replace(job, rollout_engine="hf").on(True, True).rollout_engine == "hf"


def _plan_cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        plan_main(["--memory", *map(str, args)])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    return out


def test_recipes_planned(capsys):
    # the recipe as shipped (0.5) fits, and 0.6 (OpenRLHF's critic-free hybrid examples) too; 0.7 does not
    assert "fits: the largest peak is load on ranks 0-31: 66.0 of 80.0 GiB" in _plan_cli(
        capsys, "--config", "configs/ppo_llama3_70b_hybrid.yaml")
    assert "fits: the largest peak is load on ranks 0-31: 74.0 of 80.0 GiB" in _plan_cli(
        capsys, "--config", "configs/ppo_llama3_70b_hybrid.yaml", "--vllm_gpu_memory_utilization", 0.6)
    out = _plan_cli(capsys, "--config", "configs/ppo_llama3_70b_hybrid.yaml", "--vllm_gpu_memory_utilization", 0.7)
    # the actor's and critic's fp32 shards (4 N / 32), the frozen ref's and reward model's bf16 shards (2 N / 32:
    # rlhf/models/load.py weight_dtype), 24.5 GiB (the reward/critic lack the LM head) + vLLM's 0.7 x 80 = 56 GiB
    # + 1.5 GiB runtime: vLLM cannot start next to the loaded models
    assert re.search(r"^  load +24\.46 .* 56\.00 +1\.50 +81\.96  NO", out, re.M), out
    assert re.search(r"OVERFLOW: load on ranks 0-31 needs 82\.0 GiB of 80\.0 GiB \(2\.0 GiB over\)", out), out
    assert "fits with: --vllm_gpu_memory_utilization 0.6" in out
    stages = re.findall(r"^  ([a-z_]+) +[\d.]+ ", out, re.M)
    assert stages == ["shard", "load", "rollout", "reward", "ref", "values", "old_logprobs", "critic_update", "actor_update",
                      "weight_sync"], stages
    short = _plan_cli(capsys, "--config", "configs/grpo_qwen2.5_7b_math.yaml", "--world_size", 8)
    long = _plan_cli(capsys, "--config", "configs/grpo_qwen2.5_7b_math.yaml", "--world_size", 8,
                     "--generate_max_len", 16384)
    assert "fits: the largest peak is load" in short and "OVERFLOW" not in long

    def peak(text, stage):
        return float(re.search(rf"^  {stage} .* ([\d.]+)  (yes|NO)", text, re.M).group(1))

    # activations grow with the response: 17408 vs 5120 tokens per sequence
    assert peak(long, "actor_update") > peak(short, "actor_update") + 15


def test_suggestions_fit_when_replanned():
    from rlhf.config import TopologyConfig
    from rlhf.distributed.placement import make_placement

    t = TopologyConfig()
    t.colocate_all_models = True
    pl = make_placement(t, 8)
    dims = {"actor": ModelDims.known("qwen2.5-7b")}

    def replan(j):
        return plan_memory(j, dims, pl, device_bytes=80 * GiB)

    # 8 x 5120 tokens per micro-batch without checkpointing: the update's activations overflow
    job = Job(bf16=True, micro_train_batch_size=8, micro_rollout_batch_size=16, generate_max_len=4096,
              vllm_enable_sleep=True)
    plan = replan(job)
    assert [s.name for _, s, _ in plan.overflows()] == ["actor_update"]
    fits = suggest(plan, replan)
    assert fits[:2] == [{"gradient_checkpointing": True}, {"micro_train_batch_size": 1}], fits
    # --ring_attn_size 8 would fit too, but Ulysses splits heads: 28 heads / 4 kv heads allow 2 or 4 only
    assert not [ch for ch in fits if ch.get("ring_attn_size", 1) not in (1, 2, 4)]
    assert suggest(plan, replan, max_sp=8) == fits
    for ch in fits:
        assert replan(replace(job, **ch)).fits, ch
    # without sleep every role and vLLM's share stay resident: no single flag fits, the accumulated set does
    awake = replace(job, vllm_enable_sleep=False)
    fits = suggest(replan(awake), replan)
    assert fits == [{"gradient_checkpointing": True, "vllm_enable_sleep": True, "deepspeed_enable_sleep": True}]
    assert replan(replace(awake, **fits[0])).fits


def test_startup_check(tmp_path, capsys):
    write_config("qwen2.5-7b", str(tmp_path))
    cfg = _cfg(pretrain=str(tmp_path), colocate_all_models=True, bf16=True, micro_train_batch_size=8,
               generate_max_len=4096, rollout_engine="vllm")
    assert memory_notices(cfg, "grpo", 8, on_cuda=False) == []  # CPU, no --gpu_memory_gb: silent, never refuses
    assert capsys.readouterr().out == ""
    cfg.topology.gpu_memory_gb = 80.0
    with pytest.raises(MemoryPlanError, match=r"actor_update on ranks 0-7 needs \d+\.\d GiB of 80\.0 GiB .*"
                                              r"Fits with: --gradient_checkpointing --vllm_enable_sleep"):
        memory_notices(cfg, "grpo", 8, on_cuda=False)
    from rlhf.config.preflight import check_memory

    with pytest.raises(ConfigError) as e:
        check_memory(cfg, "grpo", 8)
    assert e.value.flag == "skip_memory_check" and "--skip_memory_check starts anyway" in str(e.value)
    cfg.topology.skip_memory_check = True
    notes = check_memory(cfg, "grpo", 8)
    assert len(notes) == 1 and notes[0].startswith("[memory] WARNING (--skip_memory_check)")
    cfg.model.gradient_checkpointing = cfg.topology.vllm_enable_sleep = True  # the flags it named
    assert check_memory(cfg, "grpo", 8)[0].startswith("[memory] plan: the largest peak")
    sft = _cfg(pretrain=str(tmp_path), gpu_memory_gb=24.0, bf16=True, max_len=4096)
    with pytest.raises(MemoryPlanError, match="train on ranks 0-1"):
        memory_notices(sft, "sft", 2, on_cuda=False)


def test_known_table_has_the_fields_autoconfig_needs():
    for name, c in KNOWN.items():
        assert {"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "tie_word_embeddings", "model_type"} <= set(c), name


def test_preflight_refuses_before_any_process_group(tiny_kit, tmp_path):
    """What the trainers run before comm.init (rl_trainer.py, supervised.py call preflight): the built-in kit's
    GRPO on a 50 MB device is refused, naming the stage and the numbers; CPU defaults stay silent."""
    from rlhf.config.preflight import preflight

    paths = dict(save_path=str(tmp_path / "m"), ckpt_path=str(tmp_path / "c"), log_dir=str(tmp_path / "l"))
    cfg = _cfg(pretrain=tiny_kit, **paths)
    assert not any(n.startswith("[memory]") for n in preflight(cfg, "grpo", 1))
    cfg.topology.gpu_memory_gb = 0.05
    with pytest.raises(ConfigError, match=r"memory plan: \w+ on ranks 0 needs \d\.\d\d GiB of 0\.05 GiB"):
        preflight(cfg, "grpo", 1)


# ---- the largest transients (issue 40 item 9) and a budget below the runtime reserve (issue 42 item 14) ----------
QWEN7 = ModelDims.known("qwen2.5-7b")


def _stage(plan, name, group=0):
    return next(s for s in plan.groups[group].stages if s.name == name)


def test_frozen_models_stored_in_bf16():
    """rlhf/models/load.py ``weight_dtype``: a frozen model (ref, reward) is stored in bf16 under --bf16 (veRL
    verl/workers/fsdp_workers.py: fp32 only for the trained actor), so its FSDP2 shards are 2 N / dp, not 4 N / dp."""
    assert terms.fsdp2_states(1000, 4, 2, 3, False, 100, 200).params == 2 * 1000 / 4
    assert terms.fsdp2_states(1000, 4, 2, 3, True, 100, 200).params == 4 * 1000 / 4  # the trained master: fp32
    assert terms.fsdp2_states(1000, 4, 4, 3, False, 100, 200).params == 4 * 1000 / 4  # fp32 run: fp32
    plan = plan_memory(Job(kind="dpo", bf16=True), {"actor": SMALL}, world=2, device_bytes=80 * GiB)
    load = _stage(plan, "load").parts
    assert load["actor:params"] == 4 * SMALL.params / 2 and load["ref:params"] == 2 * SMALL.params / 2, load


def test_load_transient_one_full_tensor_before_the_rollout_engine():
    """rlhf/engines/fsdp2.py ``fill_from_first``: the source rank moves one full tensor at a time (its host copy
    is detached, so torch's ``fully_shard`` move of ``.data``, torch/distributed/fsdp/_fully_shard/_fsdp_init.py
    ``_move_states_to_device``, does not pile the model up on its GPU) and every member receives it into a device
    buffer: the 'shard' stage holds every role's shards plus the largest tensor in its stored dtype (fp32 for the
    trained actor: Qwen2.5-7B's 152k x 3584 embedding, 2.03 GiB), without vLLM's share (the engine starts after)."""
    from rlhf.config import TopologyConfig
    from rlhf.distributed.placement import make_placement

    t = TopologyConfig()
    t.colocate_all_models = True
    plan = plan_memory(Job(bf16=True), {"actor": QWEN7}, make_placement(t, 8), device_bytes=80 * GiB)
    shard = _stage(plan, "shard").parts
    assert shard["load:transient"] == 4 * 152064 * 3584, shard
    assert not any(k.startswith("rollout:") for k in shard), shard
    assert [s.name for s in plan.groups[0].stages][:2] == ["shard", "load"]
    sft = plan_memory(Job(kind="sft"), {"actor": SMALL}, world=2, device_bytes=GiB)
    assert _stage(sft, "shard").parts["load:transient"] == 4 * SMALL.vocab * SMALL.hidden
    # one rank reads its own checkpoint and moves it tensor by tensor (rlhf/engines/train.py loads_on_first):
    # no broadcast buffer beside the parameters
    one = plan_memory(Job(kind="sft"), {"actor": SMALL}, world=1, device_bytes=GiB)
    assert "load:transient" not in _stage(one, "shard").parts
    ds = plan_memory(Job(kind="sft", backend="deepspeed"), {"actor": SMALL}, world=1, device_bytes=GiB)
    assert "shard" not in [s.name for s in ds.groups[0].stages]  # DeepSpeed loads its own way (zero.Init)


def test_unfused_head_under_zero3_holds_every_tokens_logits():
    """rlhf/models/lm_head.py ``fusable_head``: a ZeRO-3 partitioned head weight (DeepSpeed's ``ds_id``) is not
    fused, so the model's own forward computes (b x s, V) logits for every token, not the response rows in chunks."""
    job = Job(kind="sft", backend="deepspeed", zero_stage=3, bf16=True, max_len=512, micro_train_batch_size=2)
    plan = plan_memory(job, {"actor": QWEN7}, world=8, device_bytes=80 * GiB)
    logits = _stage(plan, "train").parts["logits"]
    assert logits == terms.lm_head_bytes(2 * 512, QWEN7.vocab, 2, 1024, 1 << 30, True, fused=False), logits
    fused = plan_memory(replace(job, zero_stage=2), {"actor": QWEN7}, world=8, device_bytes=80 * GiB)
    assert _stage(fused, "train").parts["logits"] == terms.lm_head_bytes(2 * 512, QWEN7.vocab, 2, 1024, 1 << 30, True)


def test_weight_sync_gathers_in_the_engine_dtype_into_its_buckets():
    """rlhf/distributed/weight_sync.py: each weight is gathered in the engine's dtype (``full_tensor(p, dtype)``:
    the fp32 master's local shard is cast to bf16 first, then all-gathered, as veRL's
    verl/workers/sharding_manager/fsdp_vllm.py gathers the bf16 state dict), straight into the bucket: no fp32
    copy of a whole weight.  Colocated with vLLM: the bucket being gathered, the previous one (still bound) and the
    layer vLLM holds back (``VLLMEngine.load_weights`` ``_pending``), max(B, layer) + B; the HF engine 2 B; an
    actor sending to rollout ranks of their own 3 B (``_send_direct``: the previous bucket, the next one and the
    packed piece in flight); vLLM's workers receiving, layer + 3 B (``vllm_worker.receive_and_load``: two posted
    pieces and the held-back layer's); a plain fp32 model on one rank hands its parameters over (0)."""
    from rlhf.config import TopologyConfig
    from rlhf.distributed.placement import make_placement

    big = 152064 * 3584  # Qwen2.5-7B's embedding: larger than a 256 MiB bucket in bf16 (1.02 GiB)
    layer = 3584 * (3584 + 2 * 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584 + (3584 + 2 * 512)  # q/k/v bias
    assert layer == QWEN7.layer_params
    t = TopologyConfig()
    t.colocate_all_models = True
    plan = plan_memory(Job(bf16=True), {"actor": QWEN7}, make_placement(t, 8), device_bytes=80 * GiB)
    sync = _stage(plan, "weight_sync").parts
    assert "sync:gathered" not in sync, sync  # no fp32 weight gathered whole
    assert sync["sync:buffer"] == max(2 * big, 2 * layer) + 2 * big, sync
    assert sync["sync:gathering"] == 2 * big / 8, sync  # the embedding's bf16 local shard, cast before the gather
    hf = plan_memory(Job(bf16=True, rollout_engine="hf"), {"actor": QWEN7}, make_placement(t, 8), device_bytes=80 * GiB)
    assert _stage(hf, "weight_sync").parts["sync:buffer"] == 2 * 2 * big
    t = TopologyConfig()
    t.actor_num_gpus_per_node, t.vllm_num_engines = 4, 4
    apart = plan_memory(Job(bf16=True), {"actor": QWEN7}, make_placement(t, 8), device_bytes=80 * GiB)
    by_roles = {tuple(g.roles): g for g in apart.groups}
    send = next(s for s in by_roles[("actor", "ref")].stages if s.name == "weight_sync").parts
    recv = next(s for s in by_roles[("rollout",)].stages if s.name == "weight_sync").parts
    assert send["sync:buffer"] == 3 * 2 * big and send["sync:gathering"] == 2 * big / 4, send
    assert recv["sync:buffer"] == 2 * layer + 3 * 2 * big and "sync:gathering" not in recv, recv
    plain = plan_memory(Job(kind="rl", rollout_engine="hf"), {"actor": SMALL}, make_placement(TopologyConfig(), 1),
                        device_bytes=GiB, on_cuda=False)
    assert "sync:buffer" not in _stage(plain, "weight_sync").parts  # fp32, one rank: the parameters themselves


def test_lora_base_in_bf16_and_fp32_adapters():
    """rlhf/models/load.py ``weight_dtype(bf16, trainable, lora=True)``: under --lora_rank the frozen base is
    stored in bf16 under --bf16 and only the adapters are fp32 masters with gradients and AdamW state (veRL
    verl/workers/fsdp_workers.py loads the LoRA actor's base in bf16); peft's all-linear adapters are r (in + out)
    per linear (A: r x in, B: out x r)."""
    st = terms.fsdp2_states(1000, 4, 2, 3, True, 100, 200, adapters=40)
    assert (st.params, st.grads, st.optimizer) == (2 * 1000 / 4 + 4 * 40 / 4, 4 * 40 / 4, 8 * 40 / 4), st
    # SMALL: q 8->8, k 8->4, v 8->4, o 8->8, gate 8->16, up 8->16, down 16->8: 128 (in + out) per layer, 3 layers
    assert terms.lora_adapter_params(SMALL, 4, "all-linear") == 3 * 4 * 128
    assert terms.lora_adapter_params(SMALL, 4, "q_proj,v_proj") == 3 * 4 * (16 + 12)
    a = 3 * 4 * 128
    job = Job(kind="sft", bf16=True, lora_rank=4)
    plan = plan_memory(job, {"actor": SMALL}, world=2, device_bytes=GiB, on_cuda=False)
    train = _stage(plan, "train").parts
    assert train["actor:params"] == 2 * SMALL.params / 2 + 4 * a / 2, train
    assert train["actor:optimizer"] == 8 * a / 2 and train["actor:grads"] == 4 * a / 2, train
    # the load moves the base's largest tensor in bf16 (50 x 8 embedding), not fp32
    assert _stage(plan, "shard").parts["load:transient"] == 2 * SMALL.vocab * SMALL.hidden
    # the sync merges the largest adapted weight (8 x 16) in fp32: gathered bf16 base + three fp32 temporaries
    from rlhf.config import TopologyConfig
    from rlhf.distributed.placement import make_placement

    t = TopologyConfig()
    t.colocate_all_models = True
    rl = plan_memory(replace(job, kind="rl", rollout_engine="hf"), {"actor": SMALL}, make_placement(t, 2),
                     device_bytes=GiB, on_cuda=False)
    assert _stage(rl, "weight_sync").parts["sync:lora_merge"] == (2 + 12) * 8 * 16
    assert "sync:gathering" not in _stage(rl, "weight_sync").parts  # the base is bf16 already: no cast


def test_fsdp2_optimizer_state_stays_on_the_host_in_forward_only_stages():
    """rlhf/engines/fsdp2.py: after a sleep ``wake`` brings the weights only and ``step`` the optimizer state
    (``_onload_optimizer``; veRL verl/workers/fsdp_workers.py ``load_fsdp_optimizer`` only in ``update_actor``), so
    under --deepspeed_enable_sleep the forward-only stages (values, old log-probs) hold no optimizer state; the
    weight sync follows the actor's update with the actor awake, so it does.  DeepSpeed's wake reloads it.  Nothing
    sleeps unless every role shares every rank."""
    from rlhf.config import TopologyConfig
    from rlhf.distributed.placement import make_placement

    t = TopologyConfig()
    t.colocate_all_models = True
    sleep = Job(bf16=True, vllm_enable_sleep=True, deepspeed_enable_sleep=True)
    plan = plan_memory(sleep, {"actor": QWEN7}, make_placement(t, 8), device_bytes=80 * GiB)
    old = _stage(plan, "old_logprobs").parts
    assert "actor:optimizer" not in old and old["actor:params"] == 4 * QWEN7.params / 8, old
    assert _stage(plan, "weight_sync").parts["actor:optimizer"] == 8 * QWEN7.params / 8
    awake = plan_memory(Job(bf16=True), {"actor": QWEN7}, make_placement(t, 8), device_bytes=80 * GiB)
    assert _stage(awake, "old_logprobs").parts["actor:optimizer"] == 8 * QWEN7.params / 8  # no sleep: resident
    ds = plan_memory(replace(sleep, backend="deepspeed"), {"actor": QWEN7}, make_placement(t, 8),
                     device_bytes=80 * GiB)
    assert _stage(ds, "old_logprobs").parts["actor:optimizer"] == 16 * QWEN7.params / 8
    # the scheduler sleeps only when every role shares every rank (rl_trainer.py: enabled=plan.colocated and ...):
    # with rollout ranks of their own, the actor and the reference stay resident whatever the sleep flags say
    t = TopologyConfig()
    t.actor_num_gpus_per_node, t.vllm_num_engines = 4, 4
    apart = plan_memory(sleep, {"actor": QWEN7}, make_placement(t, 8), device_bytes=80 * GiB)
    old = next(s for g in apart.groups if "actor" in g.roles for s in g.stages if s.name == "old_logprobs").parts
    assert old["actor:optimizer"] == 8 * QWEN7.params / 4 and old["ref:params"] == 2 * QWEN7.params / 4, old


def test_load_host_copy_on_the_source_rank():
    """rlhf/engines/fsdp2.py ``host_copies`` / ``fill_from_first``: the group's first rank reads the checkpoint
    whole into host memory in its stored dtype (fp32 for the trained actor, bf16 for a frozen model under --bf16)
    and empties it tensor by tensor; the roles load one after another, so the largest of them; other ranks read
    nothing.  The table names it."""
    from rlhf.config import TopologyConfig
    from rlhf.distributed.placement import make_placement

    t = TopologyConfig()
    t.actor_num_gpus_per_node, t.vllm_num_engines = 4, 4
    plan = plan_memory(Job(bf16=True), {"actor": QWEN7}, make_placement(t, 8), device_bytes=80 * GiB)
    by_roles = {tuple(g.roles): g for g in plan.groups}
    assert by_roles[("actor", "ref")].load_host == 4 * QWEN7.params  # the actor's fp32 copy > the ref's bf16 one
    assert by_roles[("rollout",)].load_host == 0
    assert f"at load {4 * QWEN7.params / GiB:.1f} GiB on the host of the rank that reads" in plan.table()
    ref_only = plan_memory(Job(kind="dpo", bf16=True, lora_rank=8), {"actor": QWEN7}, world=2, device_bytes=80 * GiB)
    a = terms.lora_adapter_params(QWEN7, 8, "all-linear")
    assert ref_only.groups[0].load_host == 2 * QWEN7.params + 4 * a  # LoRA: bf16 base + fp32 adapters


def test_startup_check_plans_with_free_device_memory(tmp_path, monkeypatch):
    """At start-up the device is what is free on it (torch.cuda.mem_get_info: free, total), not its total: memory
    other processes hold cannot be planned with.  80 GiB total with 20 GiB free refuses a job that fits in 80."""
    import torch

    write_config("qwen2.5-0.5b", str(tmp_path))
    cfg = _cfg(pretrain=str(tmp_path), bf16=True, max_len=1024)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * GiB})())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (80 * GiB, 80 * GiB))
    assert memory_notices(cfg, "sft", 1)[0].startswith("[memory] plan: the largest peak")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (int(2.5 * GiB), 80 * GiB))
    with pytest.raises(MemoryPlanError, match=r"of 2\.50 GiB"):
        memory_notices(cfg, "sft", 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=None: (GiB, 80 * GiB))
    with pytest.raises(MemoryPlanError, match=r"GPU 0's free memory \(1\.00 of 80\.0 GiB; other processes hold the "
                                              r"rest\) is 1\.00 GiB per rank, no more than the 1\.50 GiB"):
        memory_notices(cfg, "sft", 1)


def test_budget_below_the_runtime_reserve_says_so(tmp_path, tiny_kit):
    """--gpu_memory_gb below the 1.5 GiB runtime reserve: the refusal says the budget is smaller than the reserve
    and which budget fits, instead of 'needs 0.50 GiB of -1.00 GiB' (issue 42 item 14)."""
    paths = dict(save_path=str(tmp_path / "m"), ckpt_path=str(tmp_path / "c"), log_dir=str(tmp_path / "l"))
    cfg = _cfg(pretrain=tiny_kit, gpu_memory_gb=0.5, **paths)
    with pytest.raises(MemoryPlanError) as e:
        memory_notices(cfg, "grpo", 2, on_cuda=True)
    msg = str(e.value)
    assert re.search(r"the given budget \(--gpu_memory_gb\) is 0\.50 GiB per rank, no more than the 1\.50 GiB every "
                     r"CUDA rank holds before any model .*largest stage, \w+, needs \d\.\d\d GiB at this budget: "
                     r"--gpu_memory_gb (\d+\.\d) or more fits", msg), msg
    need = float(re.search(r"--gpu_memory_gb (\d+\.\d) or more fits", msg).group(1))
    cfg.topology.gpu_memory_gb = need
    assert memory_notices(cfg, "grpo", 2, on_cuda=True)[0].startswith("[memory] plan: the largest peak"), need
