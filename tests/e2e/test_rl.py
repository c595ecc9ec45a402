"""End to end: the real trainers under torchrun on the tiny kit (gloo, CPU)."""
import json
import os
import shutil

import pytest
from helpers.e2e import rl_args as _rl_args
from helpers.e2e import torchrun

pytestmark = pytest.mark.slow


def test_grpo_colocated_hybrid_reward_rises(tiny_kit, sft_model, tmp_path):
    args = _rl_args(tiny_kit, sft_model, rollout_batch_size=16, n_samples_per_prompt=8, train_batch_size=32,
                    micro_train_batch_size=16, micro_rollout_batch_size=128, actor_learning_rate=2e-4,
                    lr_scheduler="constant", max_global_steps=60, eval_steps=30, colocate_all_models=True,
                    vllm_enable_sleep=True, deepspeed_enable_sleep=True, seed=1, save_path=tmp_path / "grpo",
                    eval_n_samples_per_prompt=4, eval_temperature=1.0)
    train, ev, out = torchrun("rlhf.train_grpo", 2, args, tmp_path, str(tmp_path / "logs"))
    assert len(train) == 60
    acc = [r["reward_accuracy"] for r in train]
    early, late = sum(acc[:15]) / 15, sum(acc[-15:]) / 15
    assert late > early + 0.05, (early, late)
    for r in train:
        assert 0 <= r["kl"] < 1 and r["tokens_per_s"] > 0 and r["response_len"] > 0
        for k in ("time_rollout", "time_actor_update", "time_weight_sync", "entropy", "clip_frac", "policy_loss", "grad_norm"):
            assert k in r
    assert len(ev) == 2
    for e in ev:  # OpenRLHF's eval keys (no datasource column: "default"); 4 samples per prompt
        assert 0 <= e["eval_default_pass1"] <= e["eval_default_pass4"] <= 1, e
    with open(tmp_path / "logs" / "generations.jsonl") as fh:  # --log_val_generations 4 (default) per eval
        assert [json.loads(line)["step"] for line in fh] == [30] * 4 + [60] * 4
    assert os.path.isfile(tmp_path / "grpo" / "model.safetensors")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "grpo"))


def test_resume_continues_exactly(tiny_kit, sft_model, tmp_path):
    ck = tmp_path / "ck"
    base = dict(max_global_steps=4, save_steps=2, ckpt_path=ck, eval_steps=0, save_path=tmp_path / "m",
                colocate_all_models=True)
    full, _, _ = torchrun("rlhf.train_grpo", 2, _rl_args(tiny_kit, sft_model, **base), tmp_path,
                          str(tmp_path / "a"))
    shutil.rmtree(ck / "global_step_4")
    (ck / ".tmp-global_step_4").mkdir()  # a crash mid-save is ignored
    resumed, _, out = torchrun("rlhf.train_grpo", 2, _rl_args(tiny_kit, sft_model, load_checkpoint=True, **base),
                               tmp_path, str(tmp_path / "b"))
    assert "[resume] from" in out and "global_step_2" in out
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        for k in ("reward", "policy_loss", "kl", "grad_norm", "response_len"):
            assert a[k] == b[k], (k, a[k], b[k])


def test_ppo_gae_critic_and_reward_model_on_own_ranks(tiny_kit, sft_model, tmp_path):
    """actor 0, critic + reward model on 1, rollout on 2; critic trained (gae)."""
    args = _rl_args(tiny_kit, sft_model, advantage_estimator="gae", n_samples_per_prompt=1, rollout_batch_size=8,
                    train_batch_size=8, remote_rm_url=None, reward_pretrain=os.path.join(tiny_kit, "reward"),
                    actor_num_gpus_per_node=1, critic_num_gpus_per_node=1, reward_num_gpus_per_node=1,
                    colocate_critic_reward=True, vllm_num_engines=1, max_global_steps=2, eval_steps=0,
                    save_path=tmp_path / "m", critic_learning_rate=1e-3)
    train, _, _ = torchrun("rlhf.train_ppo", 3, args, tmp_path, str(tmp_path / "logs"))
    assert len(train) == 2
    for r in train:
        assert r["value_loss"] > 0 and "critic_grad_norm" in r and r["reward_std"] > 0
