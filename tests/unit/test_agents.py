"""OpenRLHF agent files load unchanged (``openrlhf.utils.agent`` resolved to rlhf.agents.openrlhf_agent while the
file executes) and run under OpenRLHF's executor contract (``execute(...)`` per sample)."""
import math
import os
import sys
import types

import pytest
import torch
from helpers.engine_standin import StandInEngine

from rlhf.agents.load import load_agent
from rlhf.agents.openrlhf_agent import ExecuteAdapter, openrlhf_names, result_to_row
from rlhf.engines.rollout import Batch, SamplingParams
from rlhf.models.load import load_tokenizer

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent_openrlhf.py")


class TurnEngine(StandInEngine):
    """This project's engine contract (generate(list of prompt ids, SamplingParams) -> Batch, prompts
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
        return Batch(sequences=seq, attention_mask=(seq != 0).long(), action_mask=am, rollout_logprobs=-0.5 * am.float(),
                     prompt_len=P, truncated=torch.zeros(B, dtype=torch.bool))


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


# ---- issue 41 item 15, issue 42 item 11 ---------------------------------------------------------------------------
def _openrlhf_example(name, blob, dest):
    import hashlib

    with open(os.path.join(os.path.dirname(__file__), "..", "openrlhf_examples", name + ".txt"), "rb") as fh:
        data = fh.read()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, f"{name} is not OpenRLHF's file"
    (dest / name).write_bytes(data)
    return str(dest / name)


@pytest.fixture(autouse=True)
def _fresh_notices():
    from rlhf.agents import base

    getattr(base, "_SAID", set()).clear()  # each test sees its notices
    yield


def test_openrlhf_vlm_agent_on_a_text_model_is_refused_by_name(tiny_kit, tmp_path, capsys):
    """OpenRLHF's examples/python/vlm_multiturn_agent.py, unchanged (git blob 4f63b339 at OpenRLHF main), on a
    text-only model: its step returns ``environment_images`` (a screenshot) at step 2.  The images were once
    dropped with a notice; now images reach the engine (tests/unit/test_vlm_agent.py trains it on the tiny VLM), so
    a text-only --pretrain fails those episodes (reward NaN) with one message naming the fix."""
    import random

    random.seed(0)
    tok = load_tokenizer(tiny_kit)
    inst, exe = load_agent(_openrlhf_example("vlm_multiturn_agent.py", "4f63b3399d0d19553dc30bd57171ece9123839d3",
                                             tmp_path))
    ans = tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    engine = TurnEngine([[ans, ans]] * 4)
    batch = exe(inst, max_steps=4, max_length=4096, engine=engine, tokenizer=tok).run(
        [tok("3+4=", add_special_tokens=False)["input_ids"]], ["3+4="], ["7"], SamplingParams(n=2, max_new_tokens=4))
    err = capsys.readouterr().err
    assert err.count("text-only model") == 1, err
    assert "the agent gave 1 image(s) but --pretrain is a text-only model" in err, err
    assert all(math.isnan(r) for r in batch.rewards.tolist()) and engine.calls == 2, (batch.rewards, engine.calls)


@pytest.mark.parametrize("style", ["native"])  # OpenRLHF's awaits it: test_openrlhf_agent_examples.py
def test_async_init_is_named_with_the_fix(tmp_path, style):
    """A native agent class with ``async def __init__``: calling it fails with a bare "TypeError: __init__() should
    return None, not 'coroutine'"; now the load names the file and the fix."""
    base = "from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n" if style == "openrlhf" \
        else "from rlhf.agents.base import AgentInstanceBase\n"
    tail = ("class AgentExecutor(MultiTurnAgentExecutor):\n    def __init__(self):\n"
            "        super().__init__(AgentInstance)\n") if style == "openrlhf" else ""
    path = tmp_path / "agent_func.py"
    path.write_text(base + "class AgentInstance(AgentInstanceBase):\n    async def __init__(self, *a, **kw):\n"
                           "        self.env = None\n\n    async def step(self, states, **kw):\n"
                           "        return {'rewards': 1.0, 'environment_feedback': '', 'done': True}\n\n" + tail)
    with pytest.raises(ValueError) as e:
        load_agent(str(path))
    msg = str(e.value)
    assert str(path) in msg and "AgentInstance.__init__ is `async def`" in msg and "async def reset" in msg, msg


BAD_STEPS = '''
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

RETURNS = {
    "ok": {"rewards": torch.tensor(1.0), "environment_feedback": "", "done": True},
    "none": None,
    "str_reward": {"rewards": "1.0", "environment_feedback": "", "done": True},
    "list": [1.0, "", True],
    "no_rewards": {"environment_feedback": "", "done": True},
    "feedback": {"rewards": 0.0, "environment_feedback": {"text": "again"}, "done": False},
}


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states, **kwargs):
        return {"observation": 12345 if states["label"] == "obs" else states["observation"]}

    async def step(self, states, **kwargs):
        return RETURNS[states["label"]]


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def test_step_contract_violations_name_the_agent_and_fail_only_their_episode(tiny_kit, tmp_path, capsys):
    """Agents whose step returns None, a string reward, a list, no 'rewards', or a non-string feedback (and a reset
    with a non-string observation) ended the job with a bare TypeError / KeyError deep in the executor.  Now each
    is said once, naming the file, the method, the field, what came back and OpenRLHF's contract
    (openrlhf/utils/agent.py MultiTurnAgentExecutor.execute), and only its episode fails (reward NaN: excluded from
    the loss and counted in reward_invalid, as a NaN reward function result)."""
    tok = load_tokenizer(tiny_kit)
    path = tmp_path / "agent_func.py"
    path.write_text(BAD_STEPS)
    inst, exe = load_agent(str(path))
    labels = ["ok", "none", "str_reward", "list", "no_rewards", "feedback", "obs"]
    ans = tok("7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    engine = TurnEngine([[ans] * len(labels)])
    prompt = tok("3+4=", add_special_tokens=False)["input_ids"]
    batch = exe(inst, max_steps=2, max_length=64, engine=engine, tokenizer=tok).run(
        [prompt] * len(labels), ["3+4="] * len(labels), labels, SamplingParams(n=1, max_new_tokens=4))
    r = batch.rewards.tolist()
    assert r[0] == 1.0 and all(math.isnan(x) for x in r[1:]), r
    err = capsys.readouterr().err
    where = f"{path}: AgentInstance.step returned"
    for needle in (f"{where} NoneType None, not a dict (a missing `return`?)",
                   f"{where} 'rewards' = str '1.0'; expected a number or a one-value tensor",
                   f"{where} list [1.0, '', True], not a dict",
                   f"{where} a dict without 'rewards' (keys: ['done', 'environment_feedback'])",
                   f"{where} 'environment_feedback' = dict {{'text': 'again'}}; expected a string",
                   f"{path}: AgentInstance.reset returned int 12345 as the observation; expected a dict"):
        assert needle in err, f"missing: {needle}\n{err}"
    assert err.count("OpenRLHF's contract (openrlhf/utils/agent.py") == 6, err  # each kind once
    assert "counted as failed" in err


def test_native_agent_contract_violations(tiny_kit, tmp_path, capsys):
    tok = load_tokenizer(tiny_kit)
    path = tmp_path / "agent.py"
    path.write_text("from rlhf.agents.base import AgentInstanceBase\n\n"
                    "class AgentInstance(AgentInstanceBase):\n    async def step(self, states, **kw):\n"
                    "        return {'rewards': [1.0, 2.0], 'done': True} if states['label'] == 'bad' else "
                    "{'rewards': 0.5, 'done': True}\n")
    inst, exe = load_agent(str(path))
    ans = tok("7", add_special_tokens=False)["input_ids"]
    prompt = tok("3+4=", add_special_tokens=False)["input_ids"]
    batch = exe(inst, max_steps=1, max_length=16, engine=TurnEngine([[ans, ans]]), tokenizer=tok).run(
        [prompt, prompt], ["3+4=", "3+4="], ["ok", "bad"], SamplingParams(n=1, max_new_tokens=4))
    assert batch.rewards[0].item() == 0.5 and math.isnan(batch.rewards[1].item())
    assert f"{path}: AgentInstance.step returned 'rewards' = list [1.0, 2.0]" in capsys.readouterr().err
