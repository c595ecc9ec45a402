"""The in-job OpenAI-compatible endpoint (rlhf.agents.endpoint, issue 44 item 3): a ``run_agent`` file drives the
HF engine through the real ``openai`` client; each session's calls are stitched into one training sample whose
tokens are exactly the engine's and whose log-probs the trainer's forward reproduces; bad calls get their 4xx
without stalling the other episodes."""
import threading

import httpx
import pytest
import torch
from helpers.endpoint_agents import THREE_TURNS, Recording, action_spans, check_stitched

from rlhf.agents.endpoint.hub import Hub, Settings
from rlhf.agents.endpoint.server import endpoint
from rlhf.agents.endpoint.sessions import EndpointError, Session, next_prompt, record, stitched
from rlhf.agents.load import load_agent
from rlhf.engines.hf_engine import HFEngine
from rlhf.engines.rollout import SamplingParams
from rlhf.models.forward import action_logprobs
from rlhf.models.load import load_tokenizer

BAD_CALLS = '''
import openai

SEEN = {}


async def run_agent(client, prompt, label, **kw):
    if label != "bad":  # a well-behaved episode running beside the bad one: a chat call, then a completion on ids
        stream = await client.chat.completions.create(model=kw["model"], max_tokens=2, stream=True,
                                                      messages=[{"role": "user", "content": prompt}])
        chunks = [c async for c in stream]
        SEEN["stream"] = ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                          chunks[-1].choices[0].finish_reason, chunks[0].choices[0].model_extra["token_ids"])
        ids = chunks[0].model_extra["prompt_token_ids"] + chunks[0].choices[0].model_extra["token_ids"] + [5, 6]
        c = await client.completions.create(model=kw["model"], prompt=ids, max_tokens=3, logprobs=1)
        free = await client.with_options(default_headers={"X-Session-Id": ""}).completions.create(
            model=kw["model"], prompt="1+1=", max_tokens=2)  # no session: served, not recorded
        SEEN["completion"] = (ids, c.model_extra["prompt_token_ids"], c.choices[0].model_extra["token_ids"],
                              c.choices[0].logprobs.token_logprobs, free.model_extra["prompt_token_ids"])
        return {"reward": 1.0}
    msgs = [{"role": "user", "content": prompt}]
    r = await client.chat.completions.create(model=kw["model"], messages=msgs, max_tokens=2)
    SEEN["session"] = kw["session_id"]
    tries = {
        "unknown": lambda: client.with_options(default_headers={"X-Session-Id": "no-such-session"}).chat.completions
        .create(model=kw["model"], messages=msgs, max_tokens=2),
        "break": lambda: client.chat.completions.create(
            model=kw["model"], messages=[{"role": "user", "content": "9+9="}, {"role": "user", "content": "x"}]),
        "too_long": lambda: client.chat.completions.create(
            model=kw["model"], messages=msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                                                {"role": "user", "content": "1+2=" * 200}]),
        "n": lambda: client.chat.completions.create(model=kw["model"], messages=msgs, n=2),
        "two_ids": lambda: client.chat.completions.create(model=kw["model"], messages=msgs,
                                                          extra_body={"session_id": "other"}),
        "empty": lambda: client.chat.completions.create(model=kw["model"], messages=[]),
    }
    for name, call in tries.items():
        try:
            await call()
            SEEN[name] = (200, "")
        except openai.APIStatusError as e:
            SEEN[name] = (e.status_code, e.message)
    # the session still works after its refused calls
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "+1"}]
    await client.chat.completions.create(model=kw["model"], messages=msgs, max_tokens=2)
    return {"reward": 0.0}
'''


@pytest.fixture(scope="module")
def kit(tiny_kit):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(tiny_kit)
    model = AutoModelForCausalLM.from_pretrained(tiny_kit, dtype=torch.float32)
    model.config.use_cache = True
    return tok, model


def _agent(tmp_path, text, name="agent_file.py", settings=None):
    path = tmp_path / name
    path.write_text(text)
    inst, exe = load_agent(str(path), settings or Settings())
    return inst, exe, exe.openrlhf_cls.run_agent.__globals__


def test_three_turn_episodes_are_stitched_token_exactly(kit, tmp_path):
    tok, model = kit
    engine = Recording(HFEngine(model, tok))
    inst, exe, g = _agent(tmp_path, THREE_TURNS)
    prompts, labels = ["3+4=", "12+9="], ["7", "21"]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    T = 0.7
    ex = exe(inst, 3, 64, engine, tok)
    ex.take_metrics()  # from here on: this run's
    batch = ex.run(ids, prompts, labels, SamplingParams(n=2, max_new_tokens=5, temperature=T, seed=7))
    m = ex.take_metrics()
    assert (m["endpoint/requests"], m["endpoint/sessions"], m["endpoint/requests_per_session"]) == (12, 4, 3.0), m
    assert m["endpoint/stitched_len_max"] == int(batch.attention_mask.sum(1).max()) and m["endpoint/4xx"] == 0, m
    # the episodes' agent metrics count the endpoint's calls (made on the server's thread, not in the episode task)
    assert m["agent/turns_mean"] == 3 and m["agent/turns_max"] == 3 and 0 < m["agent/gen_s"], m
    assert batch.sequences.size(0) == 4 and batch.rewards.tolist() == [1.0, 1.0, 2.0, 2.0], batch.rewards
    assert batch.scores.tolist() == [0.5] * 4
    calls = g["CALLS"]
    assert len(calls) == 12 and len({c[0] for c in calls}) == 4, "4 sessions of 3 calls each"
    check_stitched(batch, engine.rows, calls)
    P = batch.prompt_len
    for i in range(4):  # the sample's prompt: the first call's chat-template rendering
        first = batch.sequences[i, :P][batch.attention_mask[i, :P].bool()].tolist()
        assert tok.decode(first).startswith("<|system|>add\n<|user|>"), tok.decode(first)
    # the trainer's log-probs (fp32 forward at the rollout's temperature) on the stitched samples
    R = batch.action_mask.size(1)
    with torch.no_grad():
        lp, _ = action_logprobs(model, batch.sequences, batch.attention_mask, R, temperature=T)
    m = batch.action_mask.bool()
    gap = (lp[m] - batch.rollout_logprobs[m]).abs().max().item()
    assert gap < 1e-4, f"trainer vs recorded log-probs differ by {gap}"
    assert (batch.rollout_logprobs[~m] == 0).all(), "tool / template tokens carry no log-prob"


def test_bad_calls_get_4xx_and_do_not_stall_other_sessions(kit, tmp_path):
    tok, model = kit
    engine = HFEngine(model, tok)
    inst, exe, g = _agent(tmp_path, BAD_CALLS, "bad_agent.py")
    batch = exe(inst, 2, 24, engine, tok).run([tok("3+4=", add_special_tokens=False)["input_ids"]] * 2,
                                              ["3+4=", "5+5="], ["bad", "good"], SamplingParams(n=1, max_new_tokens=2, seed=3))
    seen, sid = g["SEEN"], g["SEEN"]["session"]
    assert batch.rewards.tolist() == [0.0, 1.0], "both episodes finish, the good one unhindered"
    assert seen["unknown"][0] == 404 and "no-such-session" in seen["unknown"][1], seen["unknown"]
    assert seen["break"][0] == 409 and f"session {sid}: prefix break" in seen["break"][1], seen["break"]
    code, msg = seen["too_long"]
    limit = 24 + 4  # the episode's budget: its prompt's 4 tokens + the executor's 24
    assert code == 400 and f"maximum context length is {limit} tokens" in msg and sid in msg, seen["too_long"]
    assert seen["n"][0] == 400 and "n must be 1" in seen["n"][1]
    text, finish, ids = seen["stream"]  # stream=True: one content chunk, then the finish reason
    assert finish in ("stop", "length") and 1 <= len(ids) <= 2 and text == tok.decode(ids, skip_special_tokens=True)
    assert seen["two_ids"][0] == 400 and "differ" in seen["two_ids"][1]
    assert seen["empty"][0] == 400 and "messages" in seen["empty"][1]
    hub, server = endpoint(tok, Settings())
    url = server.url
    # the episode is over: its session is finished (410), the stitched sample kept the refused calls out
    r = httpx.post(f"{url}/v1/chat/completions", headers={"X-Session-Id": sid},
                   json={"model": "m", "messages": [{"role": "user", "content": "3+4="}]})
    assert r.status_code == 410 and "finished" in r.json()["error"]["message"], r.text
    assert len(action_spans(batch.action_mask[0].tolist())) == 2, "two accepted model calls"
    sent, prompt, comp, lps, free = seen["completion"]  # /v1/completions on token ids extends the session exactly
    assert prompt == sent and len(lps) == len(comp) >= 1 and free == tok("1+1=", add_special_tokens=False)["input_ids"]
    row = batch.sequences[1][batch.attention_mask[1].bool()].tolist()
    assert row == sent + comp and len(action_spans(batch.action_mask[1].tolist())) == 2, "the sessionless call is not in the sample"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == hub.model_name
    t = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "3+4="}]}).json()
    assert t["tokens"] == tok(tok.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert t["count"] == len(t["tokens"])
    assert hub.table.metrics.snapshot()["endpoint/4xx"] >= 7


def test_sessions_stay_on_their_engine(kit, tmp_path):
    """Two engines in one process, each rolling out on its own thread: every call of a session runs on the engine
    its episode runs on; a session opened without one goes to the least loaded engine and stays there."""
    tok, model = kit
    engines = [Recording(HFEngine(model, tok)), Recording(HFEngine(model, tok))]
    inst, exe, g = _agent(tmp_path, THREE_TURNS, "two_engines.py")
    out = {}

    def roll(k):
        texts = [f"{k}+1=", f"{k}+2="]  # each engine its own prompts: no row of one equals a row of the other
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in texts]
        out[k] = exe(inst, 3, 64, engines[k], tok).run(ids, texts, [str(k), str(k + 1)],
                                                       SamplingParams(n=1, max_new_tokens=2, seed=5 + k))

    threads = [threading.Thread(target=roll, args=(k,)) for k in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for k in (0, 1):
        assert out[k].rewards.tolist() == [1.0, 1.0], k
    for sid, prompt, comp, _ in g["CALLS"]:
        where = [k for k in (0, 1) if (tuple(prompt), tuple(comp)) in engines[k].rows]
        assert len(where) == 1, f"session {sid}'s call ran on engines {where}"
    per = {}
    for sid, prompt, comp, _ in g["CALLS"]:
        per.setdefault(sid, set()).add(next(k for k in (0, 1) if (tuple(prompt), tuple(comp)) in engines[k].rows))
    assert len(per) == 4 and all(len(v) == 1 for v in per.values()), per
    hub = Hub(tok, "m", Settings())
    hub.slots.update({"a": None, "b": None})
    placed = [hub.open_session().engine for _ in range(3)]
    assert placed == ["a", "b", "a"], placed


def test_next_prompt_rules(kit):
    """The stitching rules by hand (rlhf/agents/endpoint/sessions.py): exact extension, BPE drift repaired on the
    text, the stop token a chat template does not render kept, a prefix break refused naming the session."""
    tok, _ = kit
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    dec = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    s = Session("s-1", "e")
    first = enc("<|user|>12+9=\n<|assistant|>")
    assert next_prompt(s, "<|user|>12+9=\n<|assistant|>", first, enc, dec) == (first, False)
    record(s, first, enc("2") + enc("1"), [-0.5, -0.25], "length", "21")  # two tokens: maybe not encode("21")
    text = "<|user|>12+9=\n<|assistant|>21\n<|user|>ok\n<|assistant|>"
    ids, repaired = next_prompt(s, text, enc(text), enc, dec)
    assert ids[:len(s.ids)] == s.ids and dec(ids) == text
    assert repaired == (enc(text)[:len(s.ids)] != s.ids)
    # the model's eos ends its turn; the template renders "\n" instead: the eos is kept, the rest appended
    s2 = Session("s-2", "e")
    record(s2, first, enc("7") + [tok.eos_token_id], [-0.1, -0.2], "stop", "7")
    text2 = "<|user|>12+9=\n<|assistant|>7\n<|tool|>ok\n<|assistant|>"
    ids2, rep2 = next_prompt(s2, text2, enc(text2), enc, dec)
    assert rep2 and ids2[:len(s2.ids)] == s2.ids and dec(ids2[len(s2.ids):]) == "\n<|tool|>ok\n<|assistant|>"
    with pytest.raises(EndpointError, match="session s-2: prefix break at call 2") as e:
        next_prompt(s2, "<|user|>12+8=\n<|assistant|>7\n", enc("<|user|>12+8=\n<|assistant|>7\n"), enc, dec)
    assert e.value.status == 409
    record(s2, ids2, enc("5"), [-0.3], "length", "5")
    st = stitched(s2)
    assert st["action_ranges"] == [(len(first), len(first) + 2), (len(ids2), len(ids2) + 1)]
    assert st["rollout_log_probs"][len(first):len(first) + 2] == [-0.1, -0.2] and st["truncated"]
    assert sum(1 for x in st["rollout_log_probs"] if x) == 3
    # a special token the model emitted mid-turn: the client's content lacks it, the sample keeps it
    s3 = Session("s-3", "e")
    record(s3, first, enc("7") + [tok.pad_token_id] + enc("8"), [-0.1] * 3, "length", "78")
    text3 = "<|user|>12+9=\n<|assistant|>78\n<|user|>?\n<|assistant|>"
    ids3, rep3 = next_prompt(s3, text3, enc(text3), enc, dec)
    assert rep3 and ids3[:len(s3.ids)] == s3.ids and dec(ids3[len(s3.ids):]) == "\n<|user|>?\n<|assistant|>"


@pytest.mark.parametrize("argv,flag", [(["--agent_endpoint_port", "70000"], "agent_endpoint_port"),
                                       (["--agent_endpoint_port", "-1"], "agent_endpoint_port"),
                                       (["--agent_endpoint_host", " "], "agent_endpoint_host")])
def test_endpoint_flags_refused_at_parse(argv, flag):
    import click

    from rlhf.config.cli import parse
    from rlhf.errors import ConfigError

    with pytest.raises((click.UsageError, ConfigError), match=f"--{flag}.*e.g. --{flag}"):
        parse("grpo", ["--n_samples_per_prompt", "2", *argv])


def test_run_agent_file_refused_at_load(tmp_path):
    """A run_agent file that cannot work is refused when it loads (before any process group)."""
    for text, want in (("def run_agent(client, prompt, label, **kw):\n    return {}\n", "must be `async def"),
                       ("async def run_agent(client):\n    return {}\n", "cannot take")):
        path = tmp_path / "agent.py"
        path.write_text(text)
        with pytest.raises(ValueError, match=want) as e:
            load_agent(str(path))
        assert str(path) in str(e.value)


TOOL_AGENT = '''
import json

SEEN = {}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


async def run_agent(client, prompt, label, **kw):
    msgs = [{"role": "user", "content": prompt}]
    r = await client.chat.completions.create(model=kw["model"], messages=msgs, tools=TOOLS)
    m = r.choices[0].message
    SEEN["first"] = (r.choices[0].finish_reason, m.content, [c.model_dump() for c in m.tool_calls or []])
    call = m.tool_calls[0]
    args = json.loads(call.function.arguments)
    msgs += [m.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])}]
    r = await client.chat.completions.create(model=kw["model"], messages=msgs, tools=TOOLS)
    SEEN["second"] = r.choices[0].message.content
    return {"reward": None}  # the job's reward function scores the episode
'''


class ScriptedEngine:
    """This project's engine contract, one row per call: call k answers with replies[k] + eos, log-prob -0.25."""

    def __init__(self, tok, replies):
        self.replies = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in replies]
        self.prompts, self.pad = [], tok.pad_token_id

    def generate(self, prompt_ids, params):
        from rlhf.engines.rollout import batch_from_rows

        rows = [self.replies[len(self.prompts) + i] for i in range(len(prompt_ids))]
        self.prompts += [list(p) for p in prompt_ids]
        return batch_from_rows(prompt_ids, rows, [[-0.25] * len(r) for r in rows], [False] * len(rows), self.pad)

    def step_requests(self, admit, abort=()):
        """The contract's default for an engine without a running batch (rlhf/engines/requests.py run_whole)."""
        from rlhf.engines.requests import run_whole

        return run_whole(self, admit)


def test_tool_calls_read_and_their_turn_rendered_as_the_model_wrote_it(kit, tmp_path, monkeypatch):
    """A tool call comes back as OpenAI ``tool_calls``; the harness sends it back as a structured assistant message
    (which the chat template cannot render as the model wrote it), and the next prompt still extends the session's
    tokens exactly: the call's id names its turn (rlhf/agents/endpoint/tool_turns.py).  The parser here stands in
    for rlhf/agents/tool_parsers.py's (its ``extract(text) -> Parsed(content, calls, malformed)`` interface)."""
    import json
    import re
    import types

    from rlhf.agents.endpoint import hub as hub_mod

    class Hermes:  # <tool_call>{"name", "arguments"}</tool_call>, as tool_parsers.HermesParser reads it
        def extract(self, text):
            found = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
            calls = [types.SimpleNamespace(name=json.loads(f)["name"], arguments=json.dumps(json.loads(f)["arguments"]))
                     for f in found]
            return types.SimpleNamespace(content=text[:text.find("<tool_call>")] or None if found else text,
                                         calls=calls, malformed=False)

    monkeypatch.setattr(hub_mod, "make_tool_parser", lambda name, tok, tools: Hermes() if name and tools else None)
    tok, _ = kit
    call = '<tool_call>{"name": "add",  "arguments": {"b": 4, "a": 3}}</tool_call>'  # the model's own spacing
    engine = ScriptedEngine(tok, [call, "7"])
    asked = []

    def reward_fn(queries, prompts, labels):  # --remote_rm_url's contract: lists in, {"rewards", "scores"} out
        asked.append((queries, prompts, labels))
        return {"rewards": [float(queries[0].endswith(labels[0]))], "scores": [0.5]}

    settings = Settings(tool_call_parser="hermes", score=reward_fn)
    inst, exe, g = _agent(tmp_path, TOOL_AGENT, "tool_agent.py", settings)
    batch = exe(inst, 2, 200, engine, tok).run([tok("3+4=", add_special_tokens=False)["input_ids"]], ["3+4="],
                                               ["7"], SamplingParams(n=1, max_new_tokens=64))
    finish, content, calls = g["SEEN"]["first"]
    assert finish == "tool_calls" and content is None and len(calls) == 1, g["SEEN"]
    assert calls[0]["function"]["name"] == "add" and json.loads(calls[0]["function"]["arguments"]) == {"a": 3, "b": 4}
    assert g["SEEN"]["second"] == "7" and batch.rewards.tolist() == [1.0] and batch.scores.tolist() == [0.5]
    (queries, prompts, labels), = asked  # the whole conversation, as OpenRLHF's reward model group is asked
    assert labels == ["7"] and prompts == ["<|user|>3+4=\n<|assistant|>"] and "<tool_call>" in queries[0], asked
    # the second prompt: the first prompt + the model's call tokens (eos included) + the tool turn's tokens
    first, second = engine.prompts
    assert second[:len(first) + len(engine.replies[0])] == first + engine.replies[0], "prefix not kept"
    assert tok.decode(second[len(first) + len(engine.replies[0]):]) == "\n<|tool|>7\n<|assistant|>"
    row = batch.sequences[0][batch.attention_mask[0].bool()].tolist()
    assert row == second + engine.replies[1]
    spans = action_spans(batch.action_mask[0].tolist())
    assert [e - s for s, e in spans] == [len(engine.replies[0]), len(engine.replies[1])], spans
