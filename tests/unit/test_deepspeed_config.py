"""The DeepSpeed config built from the flags, in process (skipped without deepspeed)."""
import pytest

deepspeed = pytest.importorskip("deepspeed")


def test_deepspeed_config_from_flags():
    from rlhf.engines.deepspeed_engine import deepspeed_config
    from rlhf.engines.train import EngineSpec

    cfg = deepspeed_config(EngineSpec(lr=1e-5, train_batch_size=128, micro_batch_size=4, total_steps=10, bf16=True,
                                      zero_stage=3, max_norm=0.5), dp=8, offload_optimizer=True)
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"]["enabled"] and cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    c2 = deepspeed_config(EngineSpec(lr=1e-5, train_batch_size=16, micro_batch_size=2, total_steps=10, zero_stage=2),
                          dp=2)
    assert not any(k.startswith("stage3") for k in c2["zero_optimization"])
    # a frozen model (ref, reward): OpenRLHF's eval config, no clipping; ZeRO-3 keeps < 10 x hidden whole (HF "auto")
    frozen = deepspeed_config(EngineSpec(lr=0.0, train_batch_size=8, micro_batch_size=4, total_steps=1, bf16=True,
                                         zero_stage=3, trainable=False), dp=2, hidden_size=64)
    assert "gradient_clipping" not in frozen and frozen["bf16"]["enabled"] and frozen["gradient_accumulation_steps"] == 1
    assert frozen["zero_optimization"]["stage3_param_persistence_threshold"] == 640
