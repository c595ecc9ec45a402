"""On-policy distillation under torchrun (issue 46 item 1): the SFT'd kit model teaches the raw one, the teacher on
a rank of its own under --async_train (one launch: the teacher on the actor's rank runs in process,
tests/unit/test_teacher_opd.py ``test_grpo_step_with_opd_in_process``, and in bench/opd_tiny.py)."""
import math

import pytest
from helpers.e2e import rl_args, torchrun

pytestmark = pytest.mark.slow

OPD = dict(opd_only=True, max_global_steps=2, eval_steps=0, rollout_batch_size=4, n_samples_per_prompt=3,
           train_batch_size=12, micro_train_batch_size=6, micro_rollout_batch_size=12, generate_max_len=5,
           temperature=1.0, actor_learning_rate=5e-3, init_kl_coef=0)


def _check(train, n):
    assert [r["step"] for r in train] == list(range(1, n + 1)), [r["step"] for r in train]
    for r in train:  # a random student against the SFT'd teacher: a large reverse KL, the teacher's forward timed
        assert math.isfinite(r["opd/reverse_kl"]) and r["opd/reverse_kl"] > 1.0, r
        assert r["time_teacher"] > 0 and r["opd/teacher_logprob"] < 0, r


def test_opd_teacher_on_its_own_rank_async(tiny_kit, sft_model, tmp_path):
    # actor on rank 0, the teacher on rank 1, the HF rollout engine on rank 2, one step off-policy
    args = rl_args(tiny_kit, tiny_kit, teacher_pretrain=sft_model, actor_num_gpus_per_node=1,
                   teacher_num_gpus_per_node=1, vllm_num_engines=1, async_train=True, save_path=tmp_path / "b",
                   **OPD)
    train, _, out = torchrun("rlhf.train_grpo", 3, args, tmp_path, str(tmp_path / "lb"))
    _check(train, 2)
    assert "async/age_mean" in train[1] and train[1]["async/age_mean"] == 1, train[1]  # one step off-policy
