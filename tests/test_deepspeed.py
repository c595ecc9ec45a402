"""DeepSpeed backend on CPU (DeepSpeed picks its CPU accelerator): ZeRO 2/3 steps match a single process; save/load."""
import os

import pytest
import torch
from mp import spawn, train_side_by_side

deepspeed = pytest.importorskip("deepspeed")


def _ds_worker(rank, world, kit, out_dir, stage):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlhf.backends.base import EngineSpec
    from rlhf.backends.deepspeed_engine import DeepSpeedEngine

    torch.manual_seed(0)
    ids = torch.randint(3, 100, (4, 12))
    spec = EngineSpec(lr=1e-2, train_batch_size=4, micro_batch_size=1, total_steps=10, warmup_ratio=0.0,
                      scheduler="constant", zero_stage=stage)
    eng = DeepSpeedEngine(AutoModelForCausalLM.from_pretrained(kit), spec)
    assert eng.accum_steps == 2
    ref = train_side_by_side(eng, eng.ds, kit, ids, rank)
    full = eng.full_state_dict()
    if rank == 0:
        worst = max((full[k].float() - v).abs().max().item() for k, v in ref.state_dict().items() if k in full)
        assert worst < 5e-5, worst
    eng.save_checkpoint(os.path.join(out_dir, "ck"))
    dist.barrier()
    eng2 = DeepSpeedEngine(AutoModelForCausalLM.from_pretrained(kit), spec)
    eng2.load_checkpoint(os.path.join(out_dir, "ck"))
    x = ids[:1]
    with torch.no_grad():
        assert torch.equal(eng.ds(input_ids=x).logits, eng2.ds(input_ids=x).logits)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_matches_single_process(tiny_kit, tmp_path, stage):
    spawn(_ds_worker, 2, tiny_kit, str(tmp_path), stage)


def test_deepspeed_config_from_flags():
    from rlhf.backends.base import EngineSpec
    from rlhf.backends.deepspeed_engine import deepspeed_config

    cfg = deepspeed_config(EngineSpec(lr=1e-5, train_batch_size=128, micro_batch_size=4, total_steps=10, bf16=True,
                                      zero_stage=3, max_norm=0.5), dp=8, offload_optimizer=True)
    assert cfg["gradient_accumulation_steps"] == 4 and cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"]["enabled"] and cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    c2 = deepspeed_config(EngineSpec(lr=1e-5, train_batch_size=16, micro_batch_size=2, total_steps=10, zero_stage=2),
                          dp=2)
    assert not any(k.startswith("stage3") for k in c2["zero_optimization"])
