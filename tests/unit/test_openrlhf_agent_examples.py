"""OpenRLHF's own agent examples train here unchanged: 2 GRPO steps through the trainer (one rank, in this process,
HF engine, the SFT'd tiny model so turns end at EOS and episodes have several), checked on values.

The files are OpenRLHF's, byte for byte (tests/openrlhf_examples/*.txt, git blob sha1 checked):

- examples/python/agent_func.py, https://github.com/OpenRLHF/OpenRLHF/blob/98dc14f15b6d28288558c52aa167d7bd721a7540/
  examples/python/agent_func.py (git blob cca39fcc; unchanged at OpenRLHF main 3c3be62, 2026-08-13): a random
  environment of ``random.randint(1, 3) + 1`` turns, feedback "[INCORRECT] ... Assistant: " between the turns,
  "[CORRECT]" after the last, reward ``torch.randint(0, 2)`` at the last step;
- examples/python/agent_func_gem_multiturn.py, https://github.com/OpenRLHF/OpenRLHF/blob/
  629870839cfb025698b29fe5f9474dbb14bd2e31/examples/python/agent_func_gem_multiturn.py (git blob 32167a05;
  unchanged at main): gem's ``game:GuessTheNumber-v0`` with ``async def __init__``.  That environment id is in
  gem-llm 0.0.4 and was removed in gem 0.1.0 (axon-rl/gem#86, 2025-09-13); the test runs where gem 0.0.x is
  installed and is skipped, saying so, elsewhere (CI has no gem).
"""
import os
import random
import re

import pytest
import torch
from helpers.e2e import flags_argv

from rlhf.agents.openrlhf_agent import ExecuteAdapter

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "openrlhf_examples")
WRONG = "\n\nHuman: [INCORRECT]\nPlease analyze the issues and try again.\n</s>\n\nAssistant: "
RIGHT = "\n\nHuman: [CORRECT]\n</s>"


def _openrlhf_example(name, blob, dest):
    import hashlib

    with open(os.path.join(EXAMPLES, name + ".txt"), "rb") as fh:
        data = fh.read()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, f"{name} is not OpenRLHF's file"
    (dest / name).write_bytes(data)
    return str(dest / name)


def _capture(monkeypatch):
    """Each rollout's ``execute`` results (in row order) and the Batch built from them."""
    runs, real_episodes, real_run = [], ExecuteAdapter.run_episodes, ExecuteAdapter._run

    async def run_episodes(self, jobs):
        out = await real_episodes(self, jobs)
        runs.append({"results": out})
        return out

    async def _run(self, *a):
        batch = await real_run(self, *a)
        runs[-1]["batch"] = batch
        return batch

    monkeypatch.setattr(ExecuteAdapter, "run_episodes", run_episodes)
    monkeypatch.setattr(ExecuteAdapter, "_run", _run)
    return runs


def _train_two_steps(agent, kit, sft, tmp_path, monkeypatch):
    """GRPO, 2 steps of 2 prompts x 2 samples, on one rank in this process; returns (train rows, rollouts)."""
    from rlhf.config import parse
    from rlhf.rl.trainer import RLTrainer
    from rlhf.train_grpo import GRPO_DEFAULTS
    from rlhf.utils.logging import read_metrics

    runs = _capture(monkeypatch)
    d = os.path.join(kit, "data")
    # --max_steps x --generate_max_len = 384 tokens per episode: 4 turns of OpenRLHF's feedback (76 tokens each)
    args = dict(pretrain=sft, prompt_data=f"{d}/prompts_train.jsonl", eval_holdout=0.0, agent_func_path=agent,
                generate_max_len=48, max_steps=8, rollout_batch_size=2, n_samples_per_prompt=2, train_batch_size=4,
                micro_train_batch_size=2, micro_rollout_batch_size=4, max_global_steps=2, seed=5,
                lr_warmup_ratio=0.0, actor_learning_rate=1e-4, log_dir=tmp_path / "logs", save_path=tmp_path / "m",
                ckpt_path=tmp_path / "ck", no_progress_bar=True)
    cfg = parse("grpo", flags_argv(args), GRPO_DEFAULTS)
    trainer = RLTrainer(cfg, "grpo")
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [r for r in read_metrics(os.path.join(cfg.logging.log_dir, "metrics.jsonl")) if r["split"] == "train"]
    return rows, runs


def _rows(batch):
    """Per row: (response token ids, action mask) without the right padding."""
    P = batch.prompt_len
    out = []
    for i in range(batch.sequences.size(0)):
        keep = batch.attention_mask[i, P:].bool()
        out.append((batch.sequences[i, P:][keep].tolist(), batch.action_mask[i][keep[:batch.action_mask.size(1)]]
                    .tolist()))
    return out


def _segments(ids, mask, want):
    """Consecutive runs of the tokens whose mask is ``want``."""
    segs, cur = [], []
    for t, m in zip(ids, mask):
        if m == want:
            cur.append(t)
        elif cur:
            segs, cur = segs + [cur], []
    return segs + [cur] if cur else segs


def _check_step_rows(rows, runs, tok, feedback_of):
    """Both steps ran and trained; each step's batch carries the agent's rewards and turns; the action mask is 1
    exactly on the model's tokens (``action_ranges``) and 0 on the environment's feedback."""
    assert [r["step"] for r in rows] == [1, 2], f"2 training steps expected, got {[r['step'] for r in rows]}"
    assert len(runs) == 2, f"one agent rollout per step expected, got {len(runs)}"
    assert all("policy_loss" in r and torch.isfinite(torch.tensor(r["grad_norm"])) for r in rows), rows
    for step, (row, run) in enumerate(zip(rows, runs), 1):
        res, batch = run["results"], run["batch"]
        rewards = [float(r["reward"]) for r in res]
        assert batch.rewards.tolist() == pytest.approx(rewards), (step, batch.rewards.tolist(), rewards)
        assert row["reward"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6), (step, row["reward"], rewards)
        turns = [len(r["action_ranges"]) for r in res]
        assert row["agent/turns_mean"] == pytest.approx(sum(turns) / len(turns)), (step, row, turns)
        assert row["agent/turns_max"] == max(turns), (step, row, turns)
        for r, (ids, mask) in zip(res, _rows(batch)):
            obs, ranges = r["observation_tokens"], r["action_ranges"]
            start = ranges[0][0]
            assert ids == obs[start:], f"step {step}: the trained response is not the episode's tokens"
            acts = _segments(ids, mask, 1)
            assert acts == [obs[s:e] for s, e in ranges], f"step {step}: action mask != action_ranges"
            fbs = [tok.decode(f, skip_special_tokens=False) for f in _segments(ids, mask, 0)]
            feedback_of(r, fbs, step)
    return [[float(r["reward"]) for r in run["results"]] for run in runs], \
        [[len(r["action_ranges"]) for r in run["results"]] for run in runs]


def test_openrlhf_agent_func_trains_two_grpo_steps_unchanged(tiny_kit, sft_model, tmp_path, monkeypatch):
    """OpenRLHF's examples/python/agent_func.py, unchanged: each episode's turns are its environment's (2-4, one
    "[INCORRECT]" feedback after each turn but the last, "[CORRECT]" after the last), its reward the last step's
    0/1 draw (OpenRLHF's MultiTurnAgentExecutor sums the step rewards; the others are 0), the feedback tokens masked
    out, and both steps train on them."""
    from rlhf.models.load import load_tokenizer

    random.seed(3)
    tok = load_tokenizer(sft_model)
    agent = _openrlhf_example("agent_func.py", "cca39fcc4626545666bad928ed55c2ca022222b3", tmp_path)

    def feedback_of(r, fbs, step):
        n = len(r["action_ranges"])
        assert 2 <= n <= 4, f"step {step}: agent_func.py's episodes have 2-4 turns, got {n}"
        assert fbs == [WRONG] * (n - 1) + [RIGHT], f"step {step}: feedback {fbs!r} for {n} turns"
        assert float(r["reward"]) in (0.0, 1.0), r["reward"]

    rows, runs = _train_two_steps(agent, tiny_kit, sft_model, tmp_path, monkeypatch)
    rewards, turns = _check_step_rows(rows, runs, tok, feedback_of)
    print(f"agent_func.py: rewards {rewards}, turns {turns}")
    # its extra_logs {"dummy_scores": the last step's reward} logged, as OpenRLHF logs a sample's extra_logs
    assert [r["agent/dummy_scores"] for r in rows] == pytest.approx([sum(x) / len(x) for x in rewards]), rows
    assert len({t for ts in turns for t in ts}) > 1 or len({x for rs in rewards for x in rs}) > 1, \
        "8 episodes of one turn count and one reward: the environment's randomness did not reach the batch"


ASYNC_INIT = '''
import asyncio
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        await asyncio.sleep(0)
        self.env = {"reward": 2.5}  # set only once __init__ has run to its end

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        return {"rewards": self.env["reward"], "environment_feedback": " ok", "done": True}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def test_openrlhf_async_init_is_awaited_as_openrlhf_ray_actors_did(tiny_kit, tmp_path):
    """OpenRLHF agent files with ``async def __init__`` (agent_func_gem_multiturn.py) were written for OpenRLHF's
    Ray-actor instances, whose async constructors Ray awaits: the file loads and each episode's instance is built by
    awaiting it (before the fix: "--agent_func_path ...: AgentInstance.__init__ is `async def`" at load)."""
    from test_agents import TurnEngine

    from rlhf.agents.load import load_agent
    from rlhf.engines.rollout import SamplingParams
    from rlhf.models.load import load_tokenizer

    tok = load_tokenizer(tiny_kit)
    path = tmp_path / "agent_func.py"
    path.write_text(ASYNC_INIT)
    inst, exe = load_agent(str(path))
    engine = TurnEngine([[[11, 12], [13]]])
    batch = exe(inst, max_steps=1, max_length=8, engine=engine, tokenizer=tok).run(
        [tok("1+1=", add_special_tokens=False)["input_ids"]], ["1+1="], ["2"], SamplingParams(n=2, max_new_tokens=3))
    assert batch.rewards.tolist() == [2.5, 2.5], batch.rewards.tolist()


def _gem_or_skip():
    gem = pytest.importorskip("gem", reason="OpenRLHF's agent_func_gem_multiturn.py needs gem (pip install "
                                            "gem-llm==0.0.4); CI has no gem")
    from gem.envs.registration import ENV_REGISTRY

    if "game:GuessTheNumber-v0" not in ENV_REGISTRY:
        pytest.skip(f"gem {getattr(gem, '__version__', '?')} has no game:GuessTheNumber-v0, which "
                    f"agent_func_gem_multiturn.py makes (removed in gem 0.1.0, axon-rl/gem#86): pip install "
                    f"gem-llm==0.0.4")


def test_openrlhf_gem_multiturn_trains_two_steps_unchanged(tiny_kit, sft_model, tmp_path, monkeypatch):
    """OpenRLHF's examples/python/agent_func_gem_multiturn.py, unchanged (its AgentInstance has ``async def
    __init__``, awaited as OpenRLHF's Ray actors did).  Scripted first (gem's own rules, any secret number): two
    guesses outside 1-20 get "outside the range" (reward 0, the game goes on), then no \\boxed{} answer ends it with
    gem's format-error reward -0.1; then 2 GRPO steps through the trainer, where the SFT'd arithmetic model answers
    without \\boxed{}: one turn, reward -0.1, feedback masked."""
    _gem_or_skip()
    from test_agents import TurnEngine

    from rlhf.agents.load import load_agent
    from rlhf.engines.rollout import SamplingParams
    from rlhf.models.load import load_tokenizer

    tok = load_tokenizer(sft_model)
    agent = _openrlhf_example("agent_func_gem_multiturn.py", "32167a05f8e2987e018b6d433ecfda6857bc4d60", tmp_path)
    inst, exe = load_agent(agent)
    say = lambda s: tok(s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    engine = TurnEngine([[say("\\boxed{25}")], [say("\\boxed{25}")], [say("pass")]])
    batch = exe(inst, max_steps=8, max_length=2048, engine=engine, tokenizer=tok).run(
        [tok("3+4=", add_special_tokens=False)["input_ids"]], ["3+4="], ["7"], SamplingParams(n=1, max_new_tokens=8))
    (ids, mask), = _rows(batch)
    fbs = [tok.decode(f, skip_special_tokens=False) for f in _segments(ids, mask, 0)]
    assert len(fbs) == 3 and all("outside the range specified" in f for f in fbs[:2]), fbs
    assert fbs[0].startswith("<|im_end|>\n<|im_start|>user\nAt turn 1, you guessed 25") and \
        fbs[0].endswith("Enter your next guess within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n"), fbs[0]
    assert fbs[2] == "<|im_end|>\n<|im_start|>user\nAt turn 3, you did not provide a valid guess.<|im_end|>", fbs[2]
    assert batch.rewards.tolist() == pytest.approx([-0.1]) and engine.calls == 3

    def feedback_of(r, fbs, step):
        assert len(r["action_ranges"]) == 1 and float(r["reward"]) == pytest.approx(-0.1), r
        assert len(fbs) == 1 and re.fullmatch(r"(<\|im_end\|>\n)?<\|im_start\|>user\nAt turn 1, you did not "
                                              r"provide a valid guess\.<\|im_end\|>", fbs[0]), fbs

    rows, runs = _train_two_steps(agent, tiny_kit, sft_model, tmp_path, monkeypatch)
    rewards, turns = _check_step_rows(rows, runs, tok, feedback_of)
    print(f"agent_func_gem_multiturn.py: rewards {rewards}, turns {turns}")
    for r in rows:  # its extra_logs: {"dummy_scores": reward, "turn_count": turns}, logged as OpenRLHF logs them
        assert r["agent/turn_count"] == 1 and r["agent/dummy_scores"] == pytest.approx(-0.1), r
