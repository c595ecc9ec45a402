"""--teacher_url: the teacher's log-probs of the sampled tokens from a vLLM-format server (tests/helpers/
teacher_server.py follows vllm/entrypoints/openai/completion/protocol.py), equal to the local forward's; a GRPO
step with OPD against it; an answer that breaks the format is refused with the reason."""
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def kit_model():
    from transformers import AutoModelForCausalLM

    from rlhf.models.load import resolve_pretrain

    path = resolve_pretrain(None)
    return path, AutoModelForCausalLM.from_pretrained(path).eval()


def _rows():
    """3 rows, prompts left-padded to 4, responses right-padded to 5 (pad id 0, mask 0 on padding)."""
    seq = torch.tensor([[0, 12, 30, 41, 50, 61, 72, 2, 0],
                        [9, 13, 31, 40, 55, 66, 0, 0, 0],
                        [0, 0, 14, 33, 57, 68, 79, 81, 93]])
    attn = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1, 1]])
    return seq, attn, attn[:, -5:]


def test_client_matches_the_local_forward(kit_model):
    from helpers.teacher_server import Served

    from rlhf.models.forward import action_logprobs
    from rlhf.rl.teacher_client import TeacherClient

    _, model = kit_model
    seq, attn, amask = _rows()
    with torch.no_grad():
        want = action_logprobs(model, seq, attn, 5)[0] * amask
    with Served(model) as url:
        client = TeacherClient(url + "/v1", max_rows=2)  # two requests: 2 rows, then 1
        got = client.logprobs(seq, attn, 5) * amask
        assert client.model == "teacher"  # from /v1/models
    assert got.shape == (3, 5) and float((got - want).abs().max()) < 1e-5, (got, want)


def test_an_answer_without_prompt_logprobs_is_refused():
    from rlhf.errors import TeacherServerError
    from rlhf.rl.teacher_client import TeacherClient

    def post(url, body, timeout):  # an OpenAI server without vLLM's extension: choices without prompt_logprobs
        return {"choices": [{"index": i, "text": "x"} for i in range(len(body["prompt"]))]}

    with pytest.raises(TeacherServerError, match="prompt_logprobs"):
        TeacherClient("http://h:1", model="m", post=post).request([[1, 2, 3]])

    def other_tokenizer(url, body, timeout):
        return {"choices": [{"index": 0, "prompt_logprobs": [None, {"7": {"logprob": -1.0}}]}]}

    with pytest.raises(TeacherServerError, match="tokenizes differently"):
        TeacherClient("http://h:1", model="m", post=other_tokenizer).request([[1, 2]])


def test_grpo_step_with_a_remote_teacher(kit_model, monkeypatch, tmp_path):
    from helpers.teacher_server import Served

    from rlhf.config.cli import parse
    from rlhf.rl import trainer as rl_trainer
    from rlhf.train_grpo import GRPO_DEFAULTS

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    seen = []
    reduce = rl_trainer.RLTrainer.reduce_metrics
    monkeypatch.setattr(rl_trainer.RLTrainer, "reduce_metrics", lambda self, m: seen.append(dict(m)) or reduce(self, m))
    _, model = kit_model
    with Served(model) as url:
        cfg = parse("grpo", ["--teacher_url", url, "--rollout_engine", "hf", "--max_global_steps", "1",
                             "--rollout_batch_size", "2", "--n_samples_per_prompt", "3", "--train_batch_size", "6",
                             "--micro_train_batch_size", "6", "--micro_rollout_batch_size", "6",
                             "--generate_max_len", "4", "--temperature", "1.0",
                             "--remote_rm_url", os.path.join(ROOT, "tests", "helpers", "varied_scores.py"),
                             "--save_path", str(tmp_path / "m"), "--log_dir", str(tmp_path / "logs"),
                             "--no_progress_bar"], GRPO_DEFAULTS)
        trainer = rl_trainer.run_rl(cfg, "grpo")
    assert trainer.roles.teacher is None and trainer.plan.ranks["teacher"] == []
    assert [s.name for s in trainer.stages].count("teacher") == 1
    # the server's model is the student's starting point, sampled at temperature 1: reverse KL ~0
    assert abs(seen[0]["opd/reverse_kl"]) < 1e-3 and seen[0]["time_teacher"] > 0, seen[0]
