"""DeepSpeed backend on CPU (DeepSpeed picks its CPU accelerator): ZeRO 2/3 steps match a single process; save/load;
full weights for the rollout under ZeRO-3 (issue 24 item 7); fp32 masters under --bf16 (item 5); frozen models."""
import os

import pytest
import torch
from helpers.engine_standin import StandInEngine
from helpers.mp import spawn, train_side_by_side

deepspeed = pytest.importorskip("deepspeed")


def _ds_worker(rank, world, kit, out_dir, stage):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlhf.engines.deepspeed_engine import DeepSpeedEngine
    from rlhf.engines.train import EngineSpec

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
    _check_weight_sync(eng, full, kit, stage)  # right after a step: ZeRO-3 parameters are partitioned
    eng.save_checkpoint(os.path.join(out_dir, "ck"))
    dist.barrier()
    eng2 = DeepSpeedEngine(AutoModelForCausalLM.from_pretrained(kit), spec)
    eng2.load_checkpoint(os.path.join(out_dir, "ck"))
    x = ids[:1]
    with torch.no_grad():
        assert torch.equal(eng.ds(input_ids=x).logits, eng2.ds(input_ids=x).logits)
    _check_bf16_masters(kit, spec, stage)
    from helpers.batching_checks import check_deepspeed_accumulates, check_deepspeed_token_budgets

    check_deepspeed_accumulates(rank, world, kit, stage)  # micro-batches through ds.module accumulate (ZeRO-3)
    check_deepspeed_token_budgets(rank, world, kit, stage)  # --use_dynamic_batch equals fixed micro-batches
    _check_frozen(kit, spec, stage, x)
    if stage == 3:
        _check_lora_merge(kit, spec)
    else:
        _check_sub_group_refused(kit, spec)


class _Recorder(StandInEngine):
    """The rollout side of a colocated sync: HFEngine's ``load_weights`` / ``reset_prefix_cache`` contract."""

    def __init__(self):
        self.got = {}

    def load_weights(self, batch):
        self.got.update((n, t.clone()) for n, t in batch)

    def reset_prefix_cache(self):
        pass


def _check_weight_sync(eng, full, kit, stage):
    """Every rank's colocated sync delivers the full trained weights (ZeRO-3: ``p.shape`` is the partition's)."""
    from transformers import AutoModelForCausalLM

    from rlhf.distributed import comm
    from rlhf.distributed.weight_sync import WeightSync, param_meta

    shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_pretrained(kit).named_parameters()}
    if stage == 3:  # the check means something only if some parameters really are partitioned
        assert any(tuple(p.shape) != tuple(p.ds_shape) for p in eng.model.parameters()), \
            f"nothing partitioned: {[(tuple(p.shape), str(p.ds_status)) for p in eng.model.parameters()][:4]}"
    assert {n: s for n, s, _ in param_meta(eng.model)} == shapes, "weight-sync metadata is not the full shapes"
    rec = _Recorder()
    WeightSync(None, rec, bucket_mb=0.01).sync_colocated(eng.model)
    assert {n: tuple(t.shape) for n, t in rec.got.items()} == shapes
    full = comm.broadcast_object(full, src=0)
    for n, t in rec.got.items():
        assert torch.equal(t, full[n]), f"rank {comm.rank()}: synced {n} differs from the trained weights"


def _check_bf16_masters(kit, spec, stage):
    """--bf16: the module computes in bf16, the optimizer steps fp32 masters with fp32 state; export is fp32."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from rlhf.engines.deepspeed_engine import DeepSpeedEngine

    eng = DeepSpeedEngine(AutoModelForCausalLM.from_pretrained(kit), dataclasses.replace(spec, bf16=True))
    x = torch.randint(3, 100, (1, 8))
    for i in range(eng.accum_steps):
        eng.backward(eng.model(input_ids=x, labels=x).loss, i)
    assert eng.step()["grad_norm"] > 0
    d = eng.master_dtypes()
    assert d == {"master": {torch.float32}, "optim_state": {torch.float32}, "compute": {torch.bfloat16}}, d
    assert all(b.dtype == torch.float32 for b in eng.model.buffers() if b.is_floating_point()), "buffers cast"
    sd = eng.full_state_dict()
    if sd is not None:
        assert {t.dtype for t in sd.values()} == {torch.float32}, {t.dtype for t in sd.values()}


def _check_frozen(kit, spec, stage, x):
    """A frozen model (ref/reward): never init_inference; ZeRO-3 partitioned, else a plain module; bf16 compute."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from rlhf.engines.deepspeed_engine import DeepSpeedEngine

    plain = AutoModelForCausalLM.from_pretrained(kit)
    frozen = DeepSpeedEngine(AutoModelForCausalLM.from_pretrained(kit),
                             dataclasses.replace(spec, trainable=False, bf16=True, train_batch_size=2))
    assert frozen.optimizer is None and not any(p.requires_grad for p in frozen.model.parameters())
    assert type(frozen.model).__name__ == type(plain).__name__, type(frozen.model)  # not an InferenceEngine
    assert (frozen.ds is not None) == (stage == 3)
    assert {p.dtype for p in frozen.model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        got, want = frozen.model(input_ids=x).logits.float(), plain(input_ids=x).logits
    assert (got - want).abs().max() < 0.1 * want.abs().max(), (got - want).abs().max()


def _check_lora_merge(kit, spec):
    """LoRA under ZeRO-3: the sync sends W_base + scaling * B @ A under the plain model's names."""
    import copy

    from transformers import AutoModelForCausalLM

    from rlhf.distributed.weight_sync import WeightSync
    from rlhf.engines.deepspeed_engine import DeepSpeedEngine
    from rlhf.models.load import apply_lora

    torch.manual_seed(1)  # the same LoRA init on every rank
    model = apply_lora(AutoModelForCausalLM.from_pretrained(kit), 4, 8, "q_proj,v_proj")
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)  # peft starts B at 0: the merge would be the identity
    want = {n: p.detach().clone() for n, p in copy.deepcopy(model).merge_and_unload().named_parameters()}
    eng = DeepSpeedEngine(model, spec)
    rec = _Recorder()
    WeightSync(None, rec).sync_colocated(eng.model)
    assert sorted(rec.got) == sorted(want)
    worst = max((rec.got[n] - w).abs().max().item() for n, w in want.items())
    assert worst < 1e-5, worst


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_matches_single_process(tiny_kit, tmp_path, stage):
    spawn(_ds_worker, 2, tiny_kit, str(tmp_path), stage)


def _check_sub_group_refused(kit, spec):
    """A DeepSpeed role on some of the ranks fails at once with the fix, not inside DeepSpeed's world barrier."""
    from transformers import AutoModelForCausalLM

    from rlhf.distributed import comm
    from rlhf.engines.deepspeed_engine import DeepSpeedEngine

    g = comm.new_group([0])  # every rank creates it
    if comm.rank() == 0:
        with pytest.raises(ValueError, match="--colocate_all_models"):
            DeepSpeedEngine(AutoModelForCausalLM.from_pretrained(kit), spec, group=g)
