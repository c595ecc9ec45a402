"""OpenRLHF's examples/python/agent_func_openai_server_executor.py, unchanged, trains 2 GRPO steps (the real CLI, one
process): its own uvicorn server on its own thread calls our llm_engine (rlhf.agents.endpoint.executor
``thread_safe_executor``), its ``execute`` without ``images`` is called as it is, its client outlives a rollout
step, and the rewards it leaves out (reward None) come from --remote_rm_url, as OpenRLHF's reward model group gives
them."""
import hashlib
import os

import pytest
from helpers.e2e import torchrun

pytestmark = pytest.mark.slow

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "openrlhf_examples")
# https://github.com/OpenRLHF/OpenRLHF/blob/3c3be6234e0cb353e76bb8019947db9dfe99fca7/examples/python/
# agent_func_openai_server_executor.py (last changed in 6c6056da, 2026-05-26): git blob edd5faf1
BLOB = "edd5faf19a82934426c49fba93d59ea3c8d792bf"


def test_openrlhf_openai_server_executor_runs_unchanged_for_two_grpo_steps(tiny_kit, tmp_path):
    pytest.importorskip("vllm", reason="OpenRLHF's agent_func_openai_server_executor.py imports vllm.SamplingParams")
    with open(os.path.join(EXAMPLES, "agent_func_openai_server_executor.py.txt"), "rb") as fh:
        data = fh.read()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == BLOB, "not OpenRLHF's file"
    agent = tmp_path / "agent_func_openai_server_executor.py"
    agent.write_bytes(data)
    d = os.path.join(tiny_kit, "data")
    args = ["--pretrain", tiny_kit, "--prompt_data", f"{d}/prompts_train.jsonl", "--agent_func_path", agent,
            "--remote_rm_url", "builtin:arithmetic", "--generate_max_len", 5, "--rollout_batch_size", 3,
            "--n_samples_per_prompt", 2, "--train_batch_size", 6, "--micro_train_batch_size", 3,
            "--micro_rollout_batch_size", 6, "--max_global_steps", 2, "--max_steps", 2]
    train, _, out = torchrun("rlhf.train_grpo", 0, args, tmp_path, str(tmp_path / "logs"))
    assert [r["step"] for r in train] == [1, 2], out[-3000:]
    assert "OpenAI-compatible server ready" in out, "the file's own server did not start"
    assert out.count("OpenAI-compatible server ready") == 1, "one server for the run: the executor outlives a step"
    for r in train:
        assert r["reward_invalid"] == 0 and 0 <= r["reward"] <= 1, r  # builtin:arithmetic scored every episode
        assert r["response_len"] > 0, r
    assert train[0]["rollout_logprob_gap"] < 1e-4, train[0]  # measured on the first (on-policy) step
