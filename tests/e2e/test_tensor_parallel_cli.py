"""GRPO with --tp_size 2 through the CLI (torchrun, 2 ranks: actor and reference split over TP, FSDP2 over the
remaining data-parallel rank, HF rollout engine colocated): after each weight sync (full tensors gathered from the
TP x FSDP shards) the rollout's log-probs equal the trainer's, which come from the vocabulary-parallel head."""
import os

import pytest


@pytest.mark.slow
def test_grpo_tp2_rollout_logprobs_equal_trainer(tiny_kit, tmp_path):
    from helpers.e2e import rl_args, torchrun

    args = rl_args(tiny_kit, tiny_kit, micro_train_batch_size=4, micro_rollout_batch_size=8, colocate_all_models=True,
                   actor_learning_rate=1e-3, lr_warmup_ratio=0, max_global_steps=2, eval_steps=-1, tp_size=2,
                   use_kl_loss=True, init_kl_coef=0.01, eval_dataset=None)
    train, _, out = torchrun("rlhf.train_grpo", 2, args, tmp_path, str(tmp_path / "logs"))
    assert "DeviceMesh {'dp_shard': 1, 'tp': 2}" in out, f"the actor was not tensor-parallel:\n{out[-3000:]}"
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["rollout_logprob_gap"] < 1e-4, f"step {r['step']}: rollout and trainer log-probs differ: {r}"
    for r in train[1:]:  # the synced weights are the updated ones (the actor moved from the reference)
        assert r["kl"] > 100 * r["rollout_logprob_gap"], r
    assert os.path.isdir(tmp_path / "logs")
