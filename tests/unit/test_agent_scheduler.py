"""Per-episode generation (issue 44 item 1): the HF engine's continuous batch (rlhf.engines.hf_continuous), the
scheduler coroutine (rlhf.agents.scheduler) and the executors on it (every episode its own asyncio task)."""
import asyncio
import math
import os
import types

import torch
from helpers.models import tiny_llama

from rlhf.agents.llm_engine import AsyncEngine
from rlhf.agents.load import load_agent
from rlhf.agents.openrlhf_agent import OpenRLHFSamplingParams
from rlhf.agents.scheduler import close_scheduler, scheduler_for
from rlhf.engines.hf_engine import HFEngine
from rlhf.engines.requests import Request
from rlhf.engines.rollout import SamplingParams
from rlhf.models.load import load_causal_lm, load_tokenizer

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent_openrlhf.py")
TOK = types.SimpleNamespace(pad_token_id=0, eos_token_id=1, decode=lambda ids, skip_special_tokens=False: "")


def tiny_engine(layers=2):
    m = tiny_llama(layers)
    m.config.use_cache = True
    return HFEngine(m, TOK)


def alone(engine, prompt, p):
    """Tokens and log-probs of a generate of this prompt alone (no padding, its own seed)."""
    b = engine.generate([prompt], p)
    m = b.action_mask[0].bool()
    return b.sequences[0, b.prompt_len:][m].tolist(), b.rollout_logprobs[0][m].tolist()


def test_continuous_batch_rows_equal_single_request_generate():
    """Requests of awkward prompt lengths, greedy and seeded sampling (T 1.0, 0.7, top-k), admitted at steps 0,
    2 and 5 and one aborted mid-run: every finished request's tokens equal a single-request generate and its
    log-probs agree to 1e-5 (fp32); a request admitted mid-run is in the very next step's count."""
    eng = tiny_engine()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (3, 11, 7, 5, 9)]
    ps = [SamplingParams(temperature=0.0, max_new_tokens=9), SamplingParams(temperature=1.0, max_new_tokens=13, seed=5),
          SamplingParams(temperature=0.7, max_new_tokens=4, seed=6, top_k=20),
          SamplingParams(temperature=1.0, max_new_tokens=17, seed=8), SamplingParams(temperature=1.0, max_new_tokens=30,
                                                                                  seed=9)]
    want = [alone(eng, q, p) for q, p in zip(prompts, ps)]
    reqs = [Request(str(i), q, p) for i, (q, p) in enumerate(zip(prompts, ps))]
    admit, abort = {0: reqs[:2] + reqs[4:], 2: [reqs[2]], 5: [reqs[3]]}, {7: ["4"]}
    done, occupancy = {}, []
    for step in range(40):
        res = eng.step_requests(admit.get(step, []), abort.get(step, ()))
        occupancy.append(res.running)
        done.update({c.request_id: c for c in res.finished})
        if len(done) == 4 and step > 7:
            break
    assert occupancy[:3] == [3, 3, 4], f"request 2 did not join the running batch at step 2: {occupancy}"
    assert occupancy[5:8] == [5, 4, 3], f"3 joins at 5 (2 ends in it), 4 is aborted before 7: {occupancy}"
    assert "4" not in done and not eng.decoder.busy, "the aborted request must leave without a completion"
    for i in range(4):
        c = done[str(i)]
        assert c.token_ids == want[i][0], f"request {i}: {c.token_ids} != alone {want[i][0]}"
        gap = max(abs(a - b) for a, b in zip(c.logprobs, want[i][1]))
        assert gap < 1e-5, f"request {i}: log-probs differ from a single-request generate by {gap}"
        assert c.finish_reason == ("length" if len(c.token_ids) == ps[i].max_new_tokens and 1 not in c.token_ids
                                   else "stop"), (i, c)


def test_at_most_micro_batch_rows_decode_together_the_rest_wait_in_order():
    eng = tiny_engine()
    eng.micro_batch_size = 2
    ps = [SamplingParams(temperature=0.0, max_new_tokens=k, stop_token_ids=(1000,)) for k in (3, 5, 4)]
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    want = [alone(eng, q, p)[0] for q, p in zip(prompts, ps)]
    occupancy, done = [], {}
    res = eng.step_requests([Request(str(i), q, p) for i, (q, p) in enumerate(zip(prompts, ps))])
    while True:
        occupancy.append(res.running)
        done.update({c.request_id: c.token_ids for c in res.finished})
        if len(done) == 3:
            break
        res = eng.step_requests([])
    # 0 (3 tokens) and 1 (5) run; 2 waits until 0 leaves after step 3, then decodes its 4 tokens
    assert occupancy == [2, 2, 2, 2, 2, 1, 1], occupancy
    assert [done[str(i)] for i in range(3)] == want


def test_a_request_joins_a_running_batch_and_a_slow_episode_holds_no_other():
    """Ordered by engine steps and events, not by wall-clock time (a loaded machine must not change the verdict).
    Episode A: a 60-token turn, then an environment step that lasts until episode C has finished (a wave-batched
    engine, where C's turns wait for A's, would never get there: the wait times out), then another turn.  Episode B
    is submitted once A's first turn has run 2 engine steps and must finish its 3-token turn before A's turn ends
    (it joined the running batch instead of waiting for it); C's four quick turns all run during A's environment
    step."""
    eng = tiny_engine()
    llm = AsyncEngine(eng, TOK, 8)
    order, c_done = [], asyncio.Event()

    async def turn(name, ids, tokens):
        sp = OpenRLHFSamplingParams(temperature=1.0, max_tokens=tokens, seed=1, stop_token_ids=(1000,))
        ids += (await llm.generate(ids, sp)).outputs[0].token_ids
        order.append(name)

    async def a():
        ids = [5, 6, 7, 8]
        await turn("A", ids, 60)
        await asyncio.wait_for(c_done.wait(), 120)  # A's environment step: C must run meanwhile
        await turn("A", ids, 60)

    async def b():
        while len(scheduler_for(eng).occupancy) < 2:  # A's turn is running
            await asyncio.sleep(0)
        await turn("B", [5, 6, 7, 8], 3)

    async def c():
        while "A" not in order:  # from A's environment step on
            await asyncio.sleep(0.001)
        ids = [5, 6, 7, 8]
        for _ in range(4):
            await turn("C", ids, 3)
        c_done.set()

    async def main():
        await asyncio.gather(a(), b(), c())
        return close_scheduler(eng)

    sched = asyncio.run(main())
    assert order.index("B") < order.index("A"), f"B's request waited for A's running turn instead of joining: {order}"
    assert order == ["B", "A", "C", "C", "C", "C", "A"], order
    assert max(sched.occupancy) >= 2 and min(sched.occupancy) == 1, sched.occupancy


def test_openrlhf_agent_file_at_greedy_equals_single_request_turns(tiny_kit):
    """OpenRLHF's multi-turn agent file through ExecuteAdapter on the HF engine, greedy: every turn (an
    action range) is what a single-request generate of the episode so far gives, tokens and log-probs; the
    step's agent metrics count the turns and the engine steps."""
    tok = load_tokenizer(tiny_kit)
    m = load_causal_lm(tiny_kit, False, trainable=False)
    m.config.use_cache = True
    eng = HFEngine(m, tok)
    inst, exe = load_agent(EXAMPLE)
    texts = ["3+4=", "12+7=", "100+23="]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    ex = exe(inst, max_steps=2, max_length=12, engine=eng, tokenizer=tok)
    b = ex.run(prompts, texts, ["7", "19", "123"], SamplingParams(n=2, temperature=0.0, max_new_tokens=12))
    P, turns = b.prompt_len, 0
    for i in range(6):
        prompt = prompts[i // 2]
        resp = b.sequences[i, P:][b.attention_mask[i, P:].bool()].tolist()
        am = b.action_mask[i, :len(resp)].tolist()
        s = 0
        while s < len(resp):
            if not am[s]:
                s += 1
                continue
            e = s
            while e < len(resp) and am[e]:
                e += 1
            budget = len(prompt) + 12 - (len(prompt) + s)
            want, lps = alone(eng, prompt + resp[:s], SamplingParams(temperature=0.0, max_new_tokens=budget))
            assert resp[s:e] == want, f"episode {i} turn at {s}: {resp[s:e]} != {want}"
            gap = max(abs(x - y) for x, y in zip(b.rollout_logprobs[i, s:e].tolist(), lps))
            assert gap < 1e-5, f"episode {i}: behaviour log-probs off by {gap}"
            turns, s = turns + 1, e
    mets = ex.take_metrics()
    assert mets["agent/turns_mean"] == turns / 6 and mets["agent/episode_errors"] == 0, mets
    assert mets["agent/engine_steps"] > 0 and 1 <= mets["agent/occupancy_mean"] <= 6, mets
    assert ex.take_metrics() == {}, "metrics are taken once"


RAISES = '''
import asyncio
from openrlhf.utils.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        ids = [5, 6, 7]
        sampling_params.max_tokens = 4
        out = (await llm_engine.generate(ids, sampling_params)).outputs[0]
        if label == "bad":
            raise RuntimeError("tool exploded")
        if label == "hang":
            await asyncio.sleep(0.2)
        act = list(out.token_ids)
        return {"observation_tokens": ids + act, "action_ranges": [(3, 3 + len(act))],
                "rollout_log_probs": [0.0] * 3 + [lp[t].logprob for t, lp in zip(act, out.logprobs)],
                "reward": 1.0, "scores": 1.0}
'''


def test_an_episode_that_raises_ends_alone(tmp_path, capsys):
    """An ``execute`` that raises (a tool error) ends its episode only: reward NaN, said once, counted in
    agent/episode_errors; the other episodes, a slow one included, finish with their rewards."""
    path = tmp_path / "agent_func.py"
    path.write_text(RAISES)
    inst, exe = load_agent(str(path))
    ex = exe(inst, max_steps=1, max_length=8, engine=tiny_engine(), tokenizer=TOK)
    b = ex.run([[5, 6, 7]] * 4, ["p"] * 4, ["ok", "bad", "hang", "bad"], SamplingParams(n=1, max_new_tokens=4, seed=2))
    r = b.rewards.tolist()
    assert r[0] == r[2] == 1.0 and math.isnan(r[1]) and math.isnan(r[3]), r
    err = capsys.readouterr().err
    assert err.count("raised RuntimeError: tool exploded") == 1 and str(path) in err, err
    assert ex.take_metrics()["agent/episode_errors"] == 2


def test_one_scheduler_per_engine_and_loop():
    eng = tiny_engine(1)

    async def main():
        a, b = scheduler_for(eng), scheduler_for(eng)
        assert a is b and scheduler_for(tiny_engine(1)) is not a
        return close_scheduler(eng) is a and close_scheduler(eng) is None

    assert asyncio.run(main())


def test_an_engine_error_fails_the_running_requests_and_the_scheduler_goes_on():
    """The engine raises in a step: the requests it ran fail with EngineStepError (the executors end the run
    with it: fail-fast), none hangs; a request made afterwards is served."""
    from helpers.engine_standin import StandInEngine

    from rlhf.engines.requests import Completion, StepResult

    class Flaky(StandInEngine):
        """A step finishes every running request with one token; a prompt [66] makes the step raise."""

        def step_requests(self, admit, abort=()):
            if any(r.prompt_ids == [66] for r in admit):
                raise RuntimeError("engine fell over")
            return StepResult([Completion(r.request_id, [3], [-0.1], "stop") for r in admit], len(admit))

    llm = AsyncEngine(Flaky(), TOK, 4)
    sp = OpenRLHFSamplingParams(max_tokens=2)

    async def main():
        first = await asyncio.wait_for(asyncio.gather(llm.generate([5], sp), llm.generate([66], sp),
                                                      return_exceptions=True), 5)
        later = await asyncio.wait_for(llm.generate([7], sp), 5)
        close_scheduler(llm.engine)
        return first, later

    first, later = asyncio.run(main())
    from rlhf.agents.scheduler import EngineStepError

    assert all(isinstance(e, EngineStepError) and "fell over" in str(e) for e in first), first
    assert later.outputs[0].token_ids == [3] and later.outputs[0].finish_reason == "stop"
