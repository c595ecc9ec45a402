"""The memory planner (rlhf/planning): each term against a hand computation, parameter counts against real
modules, the recipes' plans, suggestions that fit when re-planned, the CLI and the trainers' start-up check."""
import re
from dataclasses import replace

import pytest

from rlhf.config import ConfigError, build_config, load_yaml
from rlhf.plan import main as plan_main
from rlhf.planning import terms
from rlhf.planning.dims import KNOWN, ModelDims, write_config
from rlhf.planning.memory import Job, MemoryPlanError, plan_memory, startup_check, suggest

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


def _plan_cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        plan_main(["--memory", *map(str, args)])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    return out


def test_recipes_planned(capsys):
    # the recipe as shipped (0.5) fits; OpenRLHF's 0.6 does not
    assert "fits: the largest peak is load on ranks 0-31: 74.1 of 80.0 GiB" in _plan_cli(
        capsys, "--config", "configs/ppo_llama3_70b_hybrid.yaml")
    out = _plan_cli(capsys, "--config", "configs/ppo_llama3_70b_hybrid.yaml", "--vllm_gpu_memory_utilization", 0.6)
    # 4 roles' fp32 shards (4 x 70.55e9 x 4 / 32 ranks = 32.6 GiB... the reward/critic lack the LM head) + vLLM's
    # 0.6 x 80 = 48 GiB + 1.5 GiB runtime: vLLM cannot start next to the loaded models
    assert re.search(r"OVERFLOW: load on ranks 0-31 needs 82\.\d GiB of 80\.0 GiB \(2\.\d GiB over\)", out), out
    assert "fits with: --vllm_gpu_memory_utilization 0.5" in out
    stages = re.findall(r"^  ([a-z_]+) +[\d.]+ ", out, re.M)
    assert stages == ["load", "rollout", "reward", "ref", "values", "old_logprobs", "critic_update", "actor_update",
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
    assert startup_check(cfg, "grpo", 8, on_cuda=False) == []  # CPU, no --gpu_memory_gb: silent, never refuses
    assert capsys.readouterr().out == ""
    cfg.topology.gpu_memory_gb = 80.0
    with pytest.raises(MemoryPlanError, match=r"actor_update on ranks 0-7 needs \d+\.\d GiB of 80\.0 GiB .*"
                                              r"Fits with: --gradient_checkpointing --vllm_enable_sleep"):
        startup_check(cfg, "grpo", 8, on_cuda=False)
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
        startup_check(sft, "sft", 2, on_cuda=False)


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
