"""DeepSpeed backend on CPU (DeepSpeed picks its CPU accelerator): ZeRO 2/3 steps match a single process; save/load;
full weights for the rollout under ZeRO-3 (issue 24 item 7); fp32 masters under --bf16 (item 5); frozen models."""
import os

import pytest
import torch
from helpers.mp import spawn, train_side_by_side

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


class _Recorder:
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

    from rlhf.backends.deepspeed_engine import DeepSpeedEngine

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

    from rlhf.backends.deepspeed_engine import DeepSpeedEngine

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

    from rlhf.backends.deepspeed_engine import DeepSpeedEngine
    from rlhf.distributed.weight_sync import WeightSync
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
    # a frozen model (ref, reward): OpenRLHF's eval config, no clipping; ZeRO-3 keeps < 10 x hidden whole (HF "auto")
    frozen = deepspeed_config(EngineSpec(lr=0.0, train_batch_size=8, micro_batch_size=4, total_steps=1, bf16=True,
                                         zero_stage=3, trainable=False), dp=2, hidden_size=64)
    assert "gradient_clipping" not in frozen and frozen["bf16"]["enabled"] and frozen["gradient_accumulation_steps"] == 1
    assert frozen["zero_optimization"]["stage3_param_persistence_threshold"] == 640


@pytest.mark.slow
def test_grpo_deepspeed_zero3_rollout_logprobs_equal_trainer_after_sync(tiny_kit, sft_model, tmp_path):
    """Issue 24 item 7, end to end: ``python -m rlhf.train_grpo --backend deepspeed --zero_stage 3`` on 2 ranks
    (actor, frozen ref and rollout on both).  Two optimizer steps per rollout batch, so the trainer computes the
    actor's log-probs of each batch before updating; from step 2 on the batch was generated after a weight sync,
    so the rollout engine's log-probs must equal the trainer's (the actor has moved from the reference: kl > 0).
    Before the fix the sync sent ZeRO-3's empty partitions and the job died in the rollout engine's load."""
    from helpers.e2e import torchrun

    d = os.path.join(tiny_kit, "data")
    args = ["--pretrain", sft_model, "--prompt_data", f"{d}/prompts_train.jsonl", "--eval_dataset",
            f"{d}/prompts_eval.jsonl", "--remote_rm_url", "builtin:arithmetic", "--generate_max_len", 6,
            "--rollout_batch_size", 8, "--n_samples_per_prompt", 4, "--train_batch_size", 16,
            "--micro_train_batch_size", 4, "--micro_rollout_batch_size", 8, "--backend", "deepspeed",
            "--zero_stage", 3, "--colocate_all_models", "--actor_learning_rate", 1e-4, "--lr_warmup_ratio", 0,
            "--max_global_steps", 3, "--eval_steps", -1, "--save_path", tmp_path / "m",
            "--eval_temperature", 0, "--eval_n_samples_per_prompt", 1]
    train, _, _ = torchrun("rlhf.train_grpo", 2, args, tmp_path, str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["rollout_logprob_gap"] < 1e-4, f"step {r['step']}: rollout and trainer log-probs differ: {r}"
        assert r["grad_norm"] > 0
    for r in train[1:]:  # the synced weights are the updated ones, not the initial ones
        assert r["kl"] > 100 * r["rollout_logprob_gap"], r
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))  # full shapes, not ZeRO-3 partitions
    init = AutoModelForCausalLM.from_pretrained(sft_model)
    assert {n: p.shape for n, p in exported.named_parameters()} == {n: p.shape for n, p in init.named_parameters()}


def _check_sub_group_refused(kit, spec):
    """A DeepSpeed role on some of the ranks fails at once with the fix, not inside DeepSpeed's world barrier."""
    from transformers import AutoModelForCausalLM

    from rlhf.backends.deepspeed_engine import DeepSpeedEngine
    from rlhf.distributed import comm

    g = comm.new_group([0])  # every rank creates it
    if comm.rank() == 0:
        with pytest.raises(ValueError, match="--colocate_all_models"):
            DeepSpeedEngine(AutoModelForCausalLM.from_pretrained(kit), spec, group=g)
