"""--lora_sync adapter on the HF engine, in this process: the base goes once, then the adapter (A, B, scaling) as a
new peft adapter version per sync; the engine's log-probs equal the trainer's LoRA model's (fp32), bytes per sync fall
to the adapter's; versions past ``keep`` are evicted.  Also the pure parts: ``AdapterVersions``, peft config, the
QLoRA refusal."""
import pytest
import torch

peft = pytest.importorskip("peft")

from rlhf.distributed.lora_sync import AdapterVersions, adapter_config, export_adapter, vllm_max_lora_rank  # noqa: E402
from rlhf.distributed.weight_sync import WeightSync  # noqa: E402
from rlhf.engines.hf_engine import HFEngine  # noqa: E402
from rlhf.engines.rollout import SamplingParams  # noqa: E402
from rlhf.models.forward import action_logprobs  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9], [11, 12, 13, 14], [3, 4, 5, 6, 7]]


def lora_actor(kit, seed):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(kit)
    # awkward: r=3, alpha 7 (scaling 7/3), only some projections
    m = peft.get_peft_model(base, peft.LoraConfig(r=3, lora_alpha=7, target_modules=["q_proj", "v_proj", "down_proj"]))
    randomize(m, seed)
    return m


def randomize(m, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:  # B starts at zero: make the adapter matter
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def gap(model, engine):
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    with torch.no_grad():
        lp, _ = action_logprobs(model, out.sequences, out.attention_mask, out.num_actions, temperature=1.0)
    return float(((lp * out.action_mask) - out.rollout_logprobs).abs().max())


def test_hf_engine_adapter_sync_matches_trainer_and_sends_the_base_once(tiny_kit):
    from transformers import AutoModelForCausalLM

    from rlhf.models.load import load_tokenizer

    actor = lora_actor(tiny_kit, seed=1)
    actor.eval()
    with torch.no_grad():  # the engine's own copy starts elsewhere: the base must arrive through the sync
        plain = AutoModelForCausalLM.from_pretrained(tiny_kit)
        for p in plain.parameters():
            p.add_(0.05)
    eng = HFEngine(plain, load_tokenizer(tiny_kit), lora_adapters=True)
    ws = WeightSync(None, eng, bucket_mb=0.01, lora_sync="adapter", keep_versions=2)
    first = ws.sync_colocated(actor)
    g1 = gap(actor, eng)
    assert g1 < 1e-5, f"adapter sync: HF engine vs trainer log-prob gap {g1} at fp32"
    randomize(actor, seed=2)  # the next step's adapter
    second = ws.sync_colocated(actor)
    g2 = gap(actor, eng)
    assert g2 < 1e-5, f"second adapter version not used for generation: gap {g2}"
    adapter_bytes = sum(t.numel() * 4 for _, _, _, t in export_adapter(actor))
    assert second == adapter_bytes, f"the second sync sent {second} bytes, the adapter is {adapter_bytes}"
    assert first > 20 * second, f"the first sync ({first} B) carries the base, the next only the adapter ({second} B)"
    randomize(actor, seed=3)
    ws.sync_colocated(actor)
    names = set(eng.model.peft_config)
    assert names == {"v2", "v3"}, f"keep_versions=2 should hold versions 2 and 3, the engine holds {names}"
    assert gap(actor, eng) < 1e-5
    # merged: same engine kind, the sync sends W + s B A every time (all weights)
    eng2 = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_kit), load_tokenizer(tiny_kit))
    merged = WeightSync(None, eng2, bucket_mb=0.01, lora_sync="merged").sync_colocated(actor)
    assert merged > 20 * second and gap(actor, eng2) < 1e-5


def test_adapter_config_and_versions():
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=24, intermediate_size=36, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    m = peft.get_peft_model(base, peft.LoraConfig(r=5, lora_alpha=10, target_modules=["k_proj", "up_proj"]))
    cfg = adapter_config(m)
    assert cfg == {"r": 5, "lora_alpha": 10, "target_modules": ["k_proj", "up_proj"], "bias": "none",
                   "lora_dropout": 0.0}, cfg
    names = [n for n, *_ in export_adapter(m, materialize=False)]
    assert names == ["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight",
                     "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight",
                     "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
                     "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"], names
    assert set(names) == set(peft.get_peft_model_state_dict(m)), "not peft's saved names"
    v = AdapterVersions(keep=2)
    assert [v.add(i) for i in (1, 2, 3, 4)] == [[], [], [1], [2]] and v.held == [3, 4] and v.current == 4
    assert [vllm_max_lora_rank(r) for r in (1, 3, 8, 9, 300)] == [1, 8, 8, 16, 320]
    with pytest.raises(ValueError, match="max_lora_rank 512"):
        vllm_max_lora_rank(513)


def test_load_in_4bit_refused_without_cuda_or_bitsandbytes(monkeypatch):
    from rlhf.config.qlora import check_load_in_4bit
    from rlhf.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--load_in_4bit.*--lora_rank"):
        check_load_in_4bit(True, 0, cuda=True, has_bnb=True)
    with pytest.raises(ConfigError, match=r"--load_in_4bit.*CUDA.*drop --load_in_4bit"):
        check_load_in_4bit(True, 16, cuda=False, has_bnb=True)
    with pytest.raises(ConfigError, match=r"--load_in_4bit.*bitsandbytes"):
        check_load_in_4bit(True, 16, cuda=True, has_bnb=False)
    with pytest.raises(ConfigError, match=r"--load_in_4bit is not supported for RL.*--lora_rank over a --bf16"):
        check_load_in_4bit(True, 16, cuda=True, has_bnb=True, rl=True)
    check_load_in_4bit(True, 16, cuda=True, has_bnb=True)  # where it runs (SFT / DPO / RM)
    check_load_in_4bit(False, 0, cuda=False, has_bnb=False)
