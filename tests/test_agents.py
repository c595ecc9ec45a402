"""OpenRLHF agent files load unchanged (``openrlhf.utils.agent`` resolved to rlhf.agents.openrlhf_agent while the
file executes) and run under OpenRLHF's executor contract (``execute(...)`` per sample)."""
import os
import sys
import types

import pytest
import torch

from rlhf.agents.base import load_agent
from rlhf.agents.openrlhf_agent import ExecuteAdapter, openrlhf_names, result_to_row
from rlhf.models.load import load_tokenizer
from rlhf.rollout.base import RolloutBatch, SamplingParams

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "agent_openrlhf.py")


class TurnEngine:
    """This project's engine contract (generate(list of prompt ids, SamplingParams) -> RolloutBatch, prompts
    left-padded, actions right-padded): call k answers every row with turns[k][row]; log-prob -0.5 per action."""

    def __init__(self, turns):
        self.turns, self.calls, self.params = turns, 0, []

    def generate(self, prompt_ids, params):
        acts = self.turns[self.calls]
        self.calls += 1
        self.params.append(params)
        P, R, B = max(map(len, prompt_ids)), max(map(len, acts)), len(prompt_ids)
        seq = torch.zeros((B, P + R), dtype=torch.long)
        am = torch.zeros((B, R), dtype=torch.long)
        for i, (p, a) in enumerate(zip(prompt_ids, acts)):
            seq[i, P - len(p):P] = torch.tensor(p)
            seq[i, P:P + len(a)] = torch.tensor(a)
            am[i, :len(a)] = 1
        return RolloutBatch(seq, (seq != 0).long(), am, -0.5 * am.float(), P, torch.zeros(B, dtype=torch.bool))


def test_openrlhf_names_exist_only_while_the_file_loads():
    inst, exe = load_agent(EXAMPLE)
    assert issubclass(exe, ExecuteAdapter) and inst.__name__ == "AgentInstance"
    assert not any(k == "openrlhf" or k.startswith("openrlhf.") for k in sys.modules), "the shim leaked"
    # a real openrlhf already imported is not shadowed afterwards (and its parents are not replaced meanwhile)
    real = {k: types.ModuleType(k) for k in ("openrlhf", "openrlhf.utils", "openrlhf.utils.agent")}
    saved = {k: sys.modules.get(k) for k in real}
    sys.modules.update(real)
    try:
        with openrlhf_names():
            assert sys.modules["openrlhf"] is real["openrlhf"]
            assert sys.modules["openrlhf.utils.agent"].__name__ == "rlhf.agents.openrlhf_agent"
        assert all(sys.modules[k] is m for k, m in real.items())
    finally:
        for k, m in saved.items():
            sys.modules.pop(k) if m is None else sys.modules.__setitem__(k, m)


def test_openrlhf_multiturn_example_runs_with_openrlhf_numbers(tiny_kit):
    tok = load_tokenizer(tiny_kit)
    inst, exe = load_agent(EXAMPLE)
    eos = tok.eos_token_id
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    wrong, right, fb, prompt = ids("9") + [eos], ids("7") + [eos], ids(" wrong, again:"), ids("3+4=")
    # sample 0 right at once; sample 1 wrong, feedback, then right (its second turn is a batch of one)
    engine = TurnEngine([[right, wrong], [right]])
    ex = exe(inst, max_steps=3, max_length=32, engine=engine, tokenizer=tok)
    batch = ex.run([prompt], ["3+4="], ["7"], SamplingParams(n=2, max_new_tokens=4, temperature=0.7))
    P = batch.prompt_len
    r1 = batch.sequences[1, P:][batch.attention_mask[1, P:].bool()].tolist()
    assert batch.sequences[0, P:P + len(right)].tolist() == right and r1 == wrong + fb + right
    assert batch.action_mask[1, :len(r1)].tolist() == [1] * len(wrong) + [0] * len(fb) + [1] * len(right)
    assert torch.allclose(batch.rollout_logprobs[1, :len(r1)], -0.5 * batch.action_mask[1, :len(r1)].float())
    # OpenRLHF's MultiTurnAgentExecutor: reward = sum of step rewards (-0.5 + 1), scores = the last step's
    assert batch.rewards.tolist() == [1.0, 0.5] and batch.scores.tolist() == [1.0, 1.0]
    assert engine.calls == 2, "the two first turns share one engine call"
    # the budget OpenRLHF gives a turn: max_length (prompt + 32) minus what the episode holds already
    assert engine.params[0].max_new_tokens == 32 and engine.params[0].temperature == 0.7
    assert engine.params[1].max_new_tokens == 32 - len(wrong) - len(fb)


CUSTOM = '''
from openrlhf.utils.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    def __init__(self):
        self.calls = 0

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        ids = hf_tokenizer(text=prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0].tolist()
        out = (await llm_engine.generate(ids, sampling_params)).outputs[0]
        act = list(out.token_ids)
        lps = [0.0] * len(ids) + [lp[t].logprob for t, lp in zip(act, out.logprobs)]
        return {"observation_tokens": ids + act + [5], "action_ranges": [(len(ids), len(ids) + len(act))],
                "rollout_log_probs": lps + [0.0], "reward": 2.0 if out.finish_reason == "stop" else 0.0,
                "scores": None, "extra_logs": {}}
'''


def test_custom_openrlhf_executor_contract(tiny_kit, tmp_path):
    tok = load_tokenizer(tiny_kit)
    path = tmp_path / "agent_func.py"
    path.write_text(CUSTOM)
    inst, exe = load_agent(str(path))
    assert inst is None  # OpenRLHF asks for AgentExecutor only
    prompt = tok("1+1=", add_special_tokens=False)["input_ids"]
    engine = TurnEngine([[[11, 12], [13]]])
    batch = exe(inst, max_steps=1, max_length=8, engine=engine, tokenizer=tok).run(
        [prompt], ["1+1="], ["2"], SamplingParams(n=2, max_new_tokens=3))
    P = batch.prompt_len
    assert batch.sequences[0, P:P + 3].tolist() == [11, 12, 5] and batch.sequences[1, P:P + 2].tolist() == [13, 5]
    assert batch.action_mask[0, :3].tolist() == [1, 1, 0] and batch.action_mask[1, :2].tolist() == [1, 0]
    assert batch.rollout_logprobs[0, :3].tolist() == [-0.5, -0.5, 0.0]
    assert batch.rewards.tolist() == [2.0, 2.0] and batch.scores.tolist() == [2.0, 2.0]  # scores None -> reward


def test_openrlhf_executor_errors(tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text("from openrlhf.utils.agent import AgentExecutorBase\n\n"
                    "class AgentExecutor(AgentExecutorBase):\n    pass\n")
    with pytest.raises(ValueError, match="AgentExecutor must implement async execute"):
        load_agent(str(path))
    with pytest.raises(ValueError, match="must return 'action_ranges'"):
        result_to_row({"observation_tokens": [1, 2], "reward": 1.0}, 8)
    # hand case: actions at [2, 4) and [5, 6) of 6 tokens; prompt = the first 2
    p, r, m, lp, tr, rw, sc = result_to_row({"observation_tokens": [1, 2, 3, 4, 5, 6], "action_ranges": [(2, 4), (5, 6)],
                                             "rollout_log_probs": [0, 0, -1, -2, 0, -3], "reward": 1, "scores": 0},
                                            6)
    assert (p, r, m, lp, tr, rw, sc) == ([1, 2], [3, 4, 5, 6], [1, 1, 0, 1], [-1.0, -2.0, 0.0, -3.0], True, 1.0, 0.0)
