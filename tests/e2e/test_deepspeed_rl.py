"""GRPO under DeepSpeed ZeRO-3 through the CLI (torchrun, 2 ranks; skipped without deepspeed): the rollout's log-probs
equal the trainer's after a weight sync."""
import os

import pytest

deepspeed = pytest.importorskip("deepspeed")


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
