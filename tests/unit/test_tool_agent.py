"""Tool episodes (rlhf.agents.tool_agent, tools, tool_parsers): the parser against vLLM's, tools cut at their timeout,
errors and malformed calls fed back, the output cap, the per-episode limits, tool tokens out of the action mask, and
one GRPO step with --tools_path.  The engine is a scripted stand-in of the RolloutEngine contract (its rows as
rlhf.engines.rollout.batch_from_rows lays them out, as the HF and vLLM engines return them)."""
import asyncio
import json
import os
import re
import textwrap
import time

import pytest
import torch
from helpers.engine_standin import StandInEngine

from rlhf.agents.tool_agent import ToolAgentExecutor, ToolLimits, tool_turn_text
from rlhf.agents.tool_parsers import HermesParser
from rlhf.agents.tools import load_tools, schema_of
from rlhf.engines.rollout import SamplingParams, batch_from_rows
from rlhf.errors import ConfigError

TOOLS_PY = textwrap.dedent('''
    import asyncio, time

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    def hang(seconds: float) -> str:
        """Sleep (a tool that hangs).

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "woke"

    async def slow(seconds: float) -> str:
        """Sleep without blocking.

        Args:
            seconds: how long
        """
        await asyncio.sleep(seconds)
        return "woke"

    def boom(x: str) -> str:
        """Raise.

        Args:
            x: anything
        """
        raise RuntimeError("tool exploded on " + x)

    def big(n: int) -> str:
        """A long output.

        Args:
            n: characters
        """
        return "y" * n
''')


@pytest.fixture(scope="module")
def tok():
    from rlhf.models.tiny_kit import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tools") / "tools.py"
    p.write_text(TOOLS_PY)
    return str(p)


def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class ScriptedEngine(StandInEngine):
    """Answers each prompt by its script (the text after "do:" in the prompt, else "*"), one entry per model turn: the turn
    is the number of tool turns (role "tool" openings) already in the prompt.  Each token's log-prob is
    -(its position in the turn + 1) / 10; a turn longer than max_new_tokens is cut there without a stop token."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts, self.calls, self.times = tok, scripts, [], []

    def generate(self, prompt_ids, params):
        rows, lps, trunc = [], [], []
        for ids in prompt_ids:
            text = self.tok.decode(ids)
            key = re.search(r"do:(\w+)", text)
            script = self.scripts[key.group(1) if key else "*"]
            turn = min(text.count("<|tool|>"), len(script) - 1)
            r = self.tok(script[turn], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            cut = len(r) > params.max_new_tokens
            r = r[:params.max_new_tokens]
            rows.append(r), lps.append([-(k + 1) / 10 for k in range(len(r))]), trunc.append(cut)
        self.calls.append(len(prompt_ids))
        self.times.append(time.perf_counter())
        return batch_from_rows(prompt_ids, rows, lps, trunc, self.tok.pad_token_id)


def contains_reward(needle):
    def fn(queries, prompts, labels):
        with pytest.raises(RuntimeError, match="no running event loop"):  # called as a plain reward call
            asyncio.get_running_loop()
        r = torch.tensor([float(needle in q[len(p):]) for q, p in zip(queries, prompts)])
        return {"rewards": r, "scores": r, "valid": torch.ones_like(r, dtype=torch.bool)}
    return fn


def run(tok, tools_file, scripts, prompts, limits=None, max_new=300, needle="5", context=None):
    lim = limits or ToolLimits(max_turns=4, max_tool_calls=8, timeout_s=0.5, max_chars=60, max_episode_tokens=2000)
    eng = ScriptedEngine(tok, scripts)
    eng.max_model_len = context
    ex = ToolAgentExecutor(load_tools(tools_file), HermesParser(), lim, eng, tok, contains_reward(needle))
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": f"do:{p}"}], tokenize=False,
                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]
           for p in prompts]
    t0 = time.perf_counter()
    b = ex.run(ids, [tok.decode(i) for i in ids], [None] * len(ids), SamplingParams(max_new_tokens=max_new,
                                                                                   stop_token_ids=(tok.eos_token_id,)))
    return b, ex.take_metrics(), time.perf_counter() - t0, eng


def spans(b, i):
    """(model text turns, tool text spans) of row i, split by the action mask."""
    P, n = b.prompt_len, int(b.attention_mask[i, b.prompt_len:].sum())
    ids, m = b.sequences[i, P:P + n].tolist(), b.action_mask[i, :n].tolist()
    out = []
    for t, k in zip(ids, m):
        if not out or out[-1][0] != k:
            out.append((k, []))
        out[-1][1].append(t)
    return out


# ---- parsing ------------------------------------------------------------------------------------------------------
TEXTS = [
    "plain answer, no call",
    "let me add " + call("add", a=2, b=3),
    call("add", a=1, b=2) + "\n" + call("big", n=3),
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}',              # unclosed, valid JSON
    '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',        # bad JSON
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',                         # no name
    '<tool_call>{"name": "add"}</tool_call>',                                 # no arguments
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',                    # name not text
    '<tool_call>["add", 1]</tool_call>',                                      # not an object
    '<tool_call></tool_call>',                                                # empty
    call("add", a=1, b=2) + '<tool_call>{"name": "x", "arguments": ',        # good then cut
    '<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call> after',      # arguments as text
    '<tool_call>{"name": "ünï", "arguments": {"s": "é"}}</tool_call>',
]


def test_hermes_parser_agrees_with_vllms(tok):
    """Our parser (used where vLLM is absent) and vLLM's Hermes2ProToolParser (vllm/tool_parsers/
    hermes_tool_parser.py, through rlhf.agents.tool_parsers.VLLMParser) read every text alike, malformed ones too."""
    pytest.importorskip("vllm")
    from rlhf.agents.tool_parsers import VLLMParser

    ours, theirs = HermesParser(), VLLMParser("hermes", tok)
    for t in TEXTS:
        a, b = ours.extract(t), theirs.extract(t)
        assert (a.content, [(c.name, c.arguments) for c in a.calls], a.malformed) == \
            (b.content, [(c.name, c.arguments) for c in b.calls], b.malformed), f"parsers differ on {t!r}: {a} vs {b}"
    got = [(len(p.calls), p.malformed) for p in map(ours.extract, TEXTS)]
    assert got == [(0, False), (1, False), (2, False), (1, False)] + [(0, True)] * 6 + [(0, True), (1, False),
                                                                                      (1, False)], got
    assert ours.extract(TEXTS[1]).content == "let me add " and ours.extract(TEXTS[11]).calls[0].arguments == '"1, 2"'



def test_own_parser_only_without_vllm(tok, monkeypatch):
    """Where vLLM is absent --tool_call_parser takes hermes only, served by our parser; another name is refused
    naming the one that works."""
    from rlhf.agents import tool_parsers

    monkeypatch.setattr(tool_parsers, "has_vllm", lambda: False)
    assert tool_parsers.parser_names() == ["hermes"]
    assert isinstance(tool_parsers.make_parser("hermes", tok), HermesParser)
    with pytest.raises(ConfigError, match="'qwen3_xml' is not a tool parser of this build without vLLM.*hermes"):
        tool_parsers.make_parser("qwen3_xml", tok)

# ---- episodes -----------------------------------------------------------------------------------------------------
def test_tool_tokens_out_of_the_action_mask(tok, tools_file):
    """A call, its tool message through the chat template (action mask 0, log-prob 0), then the answer; the reward
    function sees the tool's output in the episode's text."""
    b, m, _, _ = run(tok, tools_file, {"A": ["sum " + call("add", a=2, b=3), "it is 5"]}, ["A"], needle="<|tool|>5")
    parts = spans(b, 0)
    assert [k for k, _ in parts] == [1, 0, 1], parts
    turn1, fb, turn2 = (ids for _, ids in parts)
    eos = tok.eos_token_id
    assert turn1 == tok("sum " + call("add", a=2, b=3), add_special_tokens=False)["input_ids"] + [eos]
    assert tok.decode(fb) == tool_turn_text(tok, [{"role": "tool", "content": "5"}]) == "\n<|tool|>5\n<|assistant|>"
    assert turn2 == tok("it is 5", add_special_tokens=False)["input_ids"] + [eos]
    n1, nf = len(turn1), len(fb)
    lp = b.rollout_logprobs[0, :n1 + nf + len(turn2)].tolist()
    assert lp[:n1] == pytest.approx([-(k + 1) / 10 for k in range(n1)]) and lp[n1:n1 + nf] == [0.0] * nf
    assert lp[n1 + nf:] == pytest.approx([-(k + 1) / 10 for k in range(len(turn2))])
    assert b.rewards.tolist() == [1.0] and not bool(b.truncated[0])
    assert m["tool/calls_per_episode"] == 1 and m["tool/turns_per_episode"] == 2 and m["tool/error_rate"] == 0



@pytest.mark.parametrize("name,eos,want", [
    ("qwen2_5", "<|im_end|>", "\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
                              "</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    ("qwen3", "<|im_end|>", "\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
                            "</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    ("llama3_1", "<|eot_id|>", '<|start_header_id|>ipython<|end_header_id|>\n\n"a"<|eot_id|><|start_header_id|>'
                               'ipython<|end_header_id|>\n\n"b"<|eot_id|><|start_header_id|>assistant<|end_header_id|>'
                               '\n\n')])
def test_tool_turn_through_real_chat_templates(name, eos, want):
    """The tool turn after a model turn that ended with its stop token, through the real models' templates (TRL
    ships copies: trl/chat_templates/*.jinja): Qwen2.5 and Qwen3 group tool messages in one user turn (Qwen3 also
    renders its last assistant turn apart: an empty think block), Llama 3.1 one ipython turn each."""
    trl = pytest.importorskip("trl")
    from rlhf.models.tiny_kit import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"eos_token": eos})
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{name}.jinja")) as fh:
        tok.chat_template = fh.read()
    assert tool_turn_text(tok, [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]) == want

def test_hung_raising_capped_unknown_and_malformed_calls_are_fed_back(tok, tools_file):
    """A sync tool that hangs 30 s and an async one are cut at --tool_timeout_s (0.5 s) while the other episodes
    go on; a raise, an unknown tool, bad arguments and a malformed call come back as messages; output capped."""
    scripts = {"H": [call("hang", seconds=30), "ok"], "S": [call("slow", seconds=30), "ok"],
               "B": [call("boom", x="q"), "ok"], "C": [call("big", n=500), "ok"], "U": [call("nope"), "ok"],
               "X": [call("add", a=1), "ok"], "M": ['<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
                                                   "ok"], "F": ["5 straight away"]}
    b, m, wall, eng = run(tok, tools_file, scripts, list(scripts))
    assert wall < 5, f"a hung tool stalled the run: {wall:.1f} s"
    fed = {k: tok.decode(dict(spans(b, i)).get(0, [])) for i, k in enumerate(scripts)}
    assert "timed out after 0.5 s" in fed["H"] and "timed out after 0.5 s" in fed["S"], fed
    assert "raised RuntimeError: tool exploded on q" in fed["B"], fed["B"]
    assert "y" * 60 + "... [440 more characters cut]" in fed["C"], fed["C"]
    assert "unknown tool 'nope'" in fed["U"] and "bad arguments for tool 'add'" in fed["X"], fed
    assert "could not be read" in fed["M"] and fed["F"] == "", fed
    assert eng.calls[0] == 8 and sum(eng.calls[1:]) == 7, f"one first turn each, one second turn for 7: {eng.calls}"
    early = sum(n for n, t in zip(eng.calls[1:], eng.times[1:]) if t - eng.times[0] < 0.4)
    assert early >= 5, f"the episodes whose tools returned went on before the hung ones' timeout: {early} of 5"
    assert m["tool/calls_per_episode"] == pytest.approx(6 / 8) and m["tool/timeout_rate"] == pytest.approx(2 / 6)
    assert m["tool/error_rate"] == pytest.approx(3 / 6) and m["tool/malformed_calls"] == 1, m


def test_a_rows_tools_limit_its_calls(tok, tools_file):
    """run_items (what RolloutRole calls): a row whose ``tools`` offer only ``add`` gets "unknown tool" for ``big``,
    which the file has; a row without its own tools may call every tool of the file."""
    from rlhf.data.formatting import PromptItem

    eng = ScriptedEngine(tok, {"A": [call("big", n=3), "ok"]})
    lim = ToolLimits(max_turns=4, max_tool_calls=8, timeout_s=1, max_chars=60, max_episode_tokens=2000)
    ex = ToolAgentExecutor(load_tools(tools_file), HermesParser(), lim, eng, tok, contains_reward("yyy"))
    ids = tok("<|user|>do:A\n<|assistant|>", add_special_tokens=False)["input_ids"]
    add_only = [{"type": "function", "function": {"name": "add"}}]
    b = ex.run_items([PromptItem("p", None, ids, add_only), PromptItem("p", None, ids, None)],
                     SamplingParams(max_new_tokens=300, stop_token_ids=(tok.eos_token_id,)))
    fed = [tok.decode(dict(spans(b, i))[0]) for i in range(2)]
    assert "unknown tool 'big'; the tools are add" in fed[0] and "<|tool|>yyy" in fed[1], fed
    assert b.rewards.tolist() == [0.0, 1.0], b.rewards


def test_limits_on_calls_turns_and_tokens(tok, tools_file):
    """--max_tool_calls: calls past it get a message and do not run; --max_steps ends a model that keeps calling;
    --max_episode_tokens ends (truncated) an episode whose next tool message would not fit."""
    three = "".join(call("add", a=i, b=1) for i in range(3))
    lim = ToolLimits(max_turns=3, max_tool_calls=2, timeout_s=1, max_chars=100, max_episode_tokens=2000)
    b, m, _, _ = run(tok, tools_file, {"T": [three, three, three]}, ["T"], lim)
    kinds = [k for k, _ in spans(b, 0)]
    fb = [tok.decode(ids) for k, ids in spans(b, 0) if k == 0]
    assert kinds == [1, 0, 1, 0, 1], kinds  # 3 turns: the last one's calls are not run
    assert "limit reached" in fb[0] and fb[0].count("<|tool|>") == 3 and fb[1].count("limit reached") == 3, fb
    assert m["tool/calls_per_episode"] == 2 and m["tool/over_limit_calls"] == 4, m
    n1 = len(tok(call("add", a=2, b=3), add_special_tokens=False)["input_ids"]) + 1  # + the stop token
    lim = ToolLimits(max_turns=4, max_tool_calls=8, timeout_s=1, max_chars=100, max_episode_tokens=n1 + 2)
    b, m, _, _ = run(tok, tools_file, {"T": [call("add", a=2, b=3), "done"]}, ["T"], lim)
    n = int(b.attention_mask[0, b.prompt_len:].sum())
    assert bool(b.truncated[0]) and n == n1 and int(b.action_mask[0].sum()) == n1, (n, n1, b.action_mask)
    assert m["tool/calls_per_episode"] == 1, "the call ran; its message did not fit in --max_episode_tokens"
    # the engine's context (max_model_len) bounds the episode alike: prompt + turn + 2 tokens leave no room
    P = len(tok("<|user|>do:T\n<|assistant|>", add_special_tokens=False)["input_ids"])
    b, _, _, _ = run(tok, tools_file, {"T": [call("add", a=2, b=3), "done"]}, ["T"], context=P + n1 + 2)
    assert bool(b.truncated[0]) and int(b.attention_mask[0, b.prompt_len:].sum()) == n1, "cut at max_model_len"


# ---- loading and flags --------------------------------------------------------------------------------------------
def test_bad_tools_files_and_flags_are_refused(tmp_path, tools_file, tok):
    from rlhf.agents.tool_parsers import has_vllm
    from rlhf.agents.tool_setup import check_tool_run
    from rlhf.config.cli import parse

    def check(c):
        check_tool_run(c.agent, c.rollout, c.model, c.data, tok)

    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_here\n")
    with pytest.raises(ConfigError, match="--tools_path .*cannot load: ModuleNotFoundError"):
        load_tools(str(bad))
    bare = tmp_path / "bare.py"
    bare.write_text("def f(x):\n    return x\n")
    with pytest.raises(ConfigError, match="tool 'f' has no schema"):
        load_tools(str(bare))
    assert schema_of(load_tools(tools_file).functions["add"], "t")["function"]["parameters"]["required"] == ["a", "b"]
    assert [s["function"]["name"] for s in load_tools(tools_file).schemas] == ["add", "hang", "slow", "boom", "big"]
    base = ["--tools_path", tools_file, "--remote_rm_url", "builtin:arithmetic"]
    for extra, msg in ((["--tool_call_parser", "nonesuch"], "--tool_call_parser 'nonesuch' is not"),
                       (["--agent_func_path", "a.py"], "give one"), (["--tool_timeout_s", "0"], "--tool_timeout_s 0"),
                       (["--max_steps", "0"], "--max_steps 0 must be at least 1"),
                       (["--tool_call_parser", "llama3_json"], "cannot read this model's tool calls" if has_vllm()
                        else "'llama3_json' is not a tool parser of this build without vLLM")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            check(parse("grpo", base + extra))
    with pytest.raises(ConfigError, match="cannot load"):
        check(parse("grpo", ["--tools_path", str(bad)]))
    check(parse("grpo", base))


def test_rows_tools_rendered_by_the_chat_template(tok):
    from rlhf.data.formatting import format_prompt, row_tools

    tpl = ("{% if tools %}<|system|>tools:{{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
           "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    schemas = [{"type": "function", "function": {"name": "add"}}]
    row = {"input": "hi", "tools": json.dumps(schemas)}
    old = tok.chat_template
    try:
        tok.chat_template = tpl
        assert format_prompt("hi", tok, True, tools=row_tools(row)) == "<|system|>tools:add\n<|user|>hi\n<|assistant|>"
        assert format_prompt("hi", tok, True) == "<|user|>hi\n<|assistant|>"
    finally:
        tok.chat_template = old
    assert row_tools({"input": "x"}, schemas) == schemas and row_tools(row, None) == schemas
    from types import SimpleNamespace

    from rlhf.data.formatting import build_prompts

    d = SimpleNamespace(input_key="input", label_key=None, apply_chat_template=True, input_template=None,
                        prompt_max_len=64)
    other = [{"type": "function", "function": {"name": "other"}}]
    items = build_prompts([row, {"input": "yo"}], tok, d, tools=other)
    assert [i.tools for i in items] == [schemas, other], "a row's own tools, else --tools_path's"
    with pytest.raises(ValueError, match="'tools' column is text but not JSON"):
        row_tools({"tools": "[{"})


def test_one_grpo_step_with_tools(tiny_kit, tmp_path, tools_file, tok):
    """--tools_path without --agent_func_path: the rollout runs tool episodes, scored by the reward function at
    their end, and the step trains on them and logs the tool metrics.  The first step's episodes come from the HF
    engine (a random tiny model: turns cut at --generate_max_len, no calls); then the scripted engine takes its
    place, so the second step's episodes each call a tool once (tool tokens inside the response, action mask 0)."""
    from helpers.e2e import flags_argv

    from rlhf.config import parse
    from rlhf.rl.trainer import RLTrainer
    from rlhf.train_grpo import GRPO_DEFAULTS
    from rlhf.utils.logging import read_metrics

    d = os.path.join(tiny_kit, "data")
    argv = flags_argv({"pretrain": tiny_kit, "prompt_data": f"{d}/prompts_train.jsonl", "tools_path": tools_file,
                       "remote_rm_url": "builtin:arithmetic", "generate_max_len": 80, "rollout_batch_size": 3,
                       "n_samples_per_prompt": 2, "train_batch_size": 6, "micro_train_batch_size": 3,
                       "micro_rollout_batch_size": 6, "max_global_steps": 2, "max_steps": 3, "max_episode_tokens": 240,
                       "rollout_engine": "hf", "log_dir": tmp_path / "logs", "save_path": tmp_path / "out"})
    cfg = parse("grpo", argv, GRPO_DEFAULTS)
    trainer = RLTrainer(cfg, "grpo")
    agent = trainer.roles.rollout.agent
    assert isinstance(agent, ToolAgentExecutor), type(agent)
    real = agent.engine
    scripted = ScriptedEngine(tok, {"*": [call("add", a=2, b=3), "so 5"]})
    scripted.max_model_len = real.max_model_len

    rollout = next(s for s in trainer.stages if s.name == "rollout")
    first = rollout.run

    def run_then_swap(batch, roles):  # after the first step's rollout the scripted engine answers
        first(batch, roles)
        agent.engine = scripted

    rollout.run = run_then_swap
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = [r for r in read_metrics(os.path.join(tmp_path, "logs", "metrics.jsonl")) if r["split"] == "train"]
    assert len(rows) == 2 and rows[0]["tool/turns_per_episode"] >= 1, rows
    assert {"tool/calls_per_episode", "tool/error_rate", "tool/timeout_rate", "tool/time_s"} <= set(rows[0]), rows[0]
    assert (rows[1]["tool/calls_per_episode"], rows[1]["tool/turns_per_episode"], rows[1]["tool/error_rate"]) == \
        (1.0, 2.0, 0.0), rows[1]
    assert real.max_model_len == 1024 + 240, "the engine's context holds a prompt and a whole episode"


class VersionedEngine(ScriptedEngine):
    """ScriptedEngine whose log-probs also say which weights produced them: -(position + 1) / 10 - version / 1000."""
    version = 0
    max_model_len = None

    def generate(self, prompt_ids, params):
        b = super().generate(prompt_ids, params)
        b.rollout_logprobs = b.rollout_logprobs - self.version / 1000 * b.action_mask
        return b


def test_tool_episodes_under_async_train(tok, tools_file):
    """--tools_path with --async_train (rlhf.rl.async_queue.AsyncRollout over the real RolloutRole.run_agent and
    the tool executor): 3 prompts in flight for batches of 2 (oversampling), groups kept by dynamic filtering on
    the episodes' end rewards (range (0.5, 1.5): prompts that call ``add`` and answer 5); each episode runs whole in
    one produce: every token of it (both model turns, the tool message) carries that produce's weight version and
    its log-probs that version's weights, across a weight sync; a buffered group keeps its older version; a row's
    own ``tools`` column reaches the executor; the n samples of a group draw their own seeds."""
    from types import SimpleNamespace

    from rlhf.data.formatting import PromptItem
    from rlhf.distributed.mesh import RoleMesh
    from rlhf.rl.async_queue import AsyncRollout, QueueSettings
    from rlhf.roles.rollout import RolloutRole

    yes = {0, 1, 2, 4}  # prompt indices whose episodes call add(2, 3) then answer "so 5" (reward 1); others: 0
    eng = VersionedEngine(tok, {"yes": [call("add", a=2, b=3), "so 5"], "no": ["no idea"]})
    seeds = []
    real = eng.generate
    eng.generate = lambda ids, p: (seeds.append(p.seed), real(ids, p))[1]
    lim = ToolLimits(max_turns=4, max_tool_calls=8, timeout_s=2.0, max_chars=60, max_episode_tokens=2000)
    role = RolloutRole("rollout", RoleMesh("rollout", [0], 0, {"tp": 1}))
    role.engine = eng
    role.agent = ToolAgentExecutor(load_tools(tools_file), HermesParser(), lim, eng, tok, contains_reward("5"))
    big = [s for s in load_tools(tools_file).schemas if s["function"]["name"] == "big"]
    items = []
    for i in range(12):
        text = tok.apply_chat_template([{"role": "user", "content": f"do:{'yes' if i in yes else 'no'}"}],
                                       tokenize=False, add_generation_prompt=True)
        items.append(PromptItem(text, None, tok(text, add_special_tokens=False)["input_ids"],
                                big if i == 4 else None))  # prompt 4 offers only ``big``: its add call is unknown
    s = QueueSettings(k=1, n=2, batch=2, generate_batch=3, chunk=None, max_new_tokens=300, max_staleness=3,
                      filter_range=(0.5, 1.5), filter_rounds=3)
    sampler = SimpleNamespace(params=lambda step, salt=0: SamplingParams(
        n=2, max_new_tokens=300, temperature=1.0, stop_token_ids=(tok.eos_token_id,), seed=7 + step + salt))
    q = AsyncRollout(s, SimpleNamespace(rollout=role, reward=None), None, 0,
                     SimpleNamespace(agent_mode=True, reward_source=None), sampler,
                     lambda step: items[2 * step:2 * step + 2], tok.pad_token_id)
    q.produce(0, 1)
    eng.version = 1  # the weight sync between the two batches
    q.produce(1, 2)
    (b1, m1), (b2, m2) = q.produced
    assert b1.group_index.tolist() == [0, 0, 1, 1] and b2.group_index.tolist() == [2, 2, 4, 4], \
        (b1.group_index, b2.group_index)
    assert b1.rewards.tolist() == [1.0] * 4 and b2.rewards.tolist() == [1.0] * 4, (b1.rewards, b2.rewards)
    assert (m1["async/filtered_groups"], m2["async/filtered_groups"], m2["async/drawn_prompts"]) == (0, 2, 3), m2
    for b, want in ((b1, [0, 0, 0, 0]), (b2, [0, 0, 1, 1])):  # group 2 was buffered at version 0
        for i, v in enumerate(want):
            n = int(b.attention_mask[i, b.prompt_len:].sum())
            mask, vers = b.action_mask[i, :n], b.versions[i, :n]
            assert vers.tolist() == [v] * n, f"row {i}: an episode's tokens carry one version ({v}), got {vers}"
            turns = [k for k, _ in spans(b, i)]
            assert turns == [1, 0, 1], f"row {i}: model turn, tool message (mask 0), model turn; got {turns}"
            lp = b.rollout_logprobs[i, :n][mask.bool()]
            x = (lp.double() + v / 1000) * 10  # -(position + 1) exactly when version v's weights made every token
            assert len(lp) > 4 and torch.allclose(x, x.round(), atol=1e-4), \
                f"row {i}: every model turn's log-probs come from version {v}'s weights: {lp}"
    tool_text = tok.decode(b2.sequences[2, b2.prompt_len:][b2.action_mask[2] == 0][:40])
    assert "unknown tool 'add'" in tool_text and m2["tool/error_rate"] > 0, (tool_text, m2)
    assert m1["tool/calls_per_episode"] == 1.0 and m1["agent/turns_mean"] == 2.0, m1
    assert len(set(seeds)) == len(seeds), f"every request of every episode has its own seed: {seeds}"


REWARD_TOOLS_PY = textwrap.dedent('''
    def grade(x: int) -> dict:
        """A tool with a reward of its own.

        Args:
            x: a number
        """
        return {"content": "graded " + str(x), "reward": x / 4}

    def bad(x: int) -> dict:
        """A reward that is not a number.

        Args:
            x: a number
        """
        return {"content": "c", "reward": "high"}

    def plain(x: int) -> dict:
        """A dict with more keys: plain content.

        Args:
            x: a number
        """
        return {"content": "c", "reward": 1, "more": x}
''')


def test_tool_rewards_are_summed_into_the_episode_reward(tok, tmp_path):
    """A tool returning {"content": c, "reward": r} (veRL's BaseTool.execute step reward): the model sees c, the
    episode's reward is the reward function's plus its calls' rewards, by hand: episode "two" calls grade(1) in
    turn 1, grade(2) and plain(0) in turn 2 and answers "done 5": 1 + 1/4 + 2/4 = 1.75 (plain's dict has a third
    key: it is content, reward 0); "one" calls bad (a reward that is not a number: an error, reward 0) and answers
    "no": 0; "none" answers "so 5": 1.  Scores stay the reward function's."""
    f = tmp_path / "reward_tools.py"
    f.write_text(REWARD_TOOLS_PY)
    scripts = {"two": [call("grade", x=1), call("grade", x=2) + call("plain", x=0), "done 5"],
               "one": [call("bad", x=3), "no"], "none": ["so 5"]}
    b, m, _, _ = run(tok, str(f), scripts, ["two", "one", "none"], max_new=300)
    assert b.rewards.tolist() == [1.75, 0.0, 1.0], b.rewards
    assert b.scores.tolist() == [1.0, 0.0, 1.0], b.scores
    texts = ["".join(tok.decode(t) for k, t in spans(b, i) if k == 0) for i in range(2)]
    assert "graded 1" in texts[0] and "graded 2" in texts[0] and '"more": 0' in texts[0], texts[0]
    assert "raised ValueError: its reward must be" in texts[1], texts[1]
    assert (m["tool/reward_per_episode"], m["tool/error_rate"], m["tool/calls_per_episode"]) == (0.25, 0.25, 4 / 3), m


def test_a_rows_own_schemas_reach_the_parser(tok, tmp_path):
    """A row's own ``tools`` schemas are passed to the parser of its episodes (vLLM's qwen3_coder types a call's
    arguments from the schema, vllm/tool_parsers/qwen3coder_tool_parser.py): the file's tool ``echo(a: str)`` says
    a is text, so the file's parser passes "2"; a row declaring a as integer gets a parser over its schema, which
    passes 2; the tool reports the type it received.  One parser per distinct schema list."""
    pytest.importorskip("vllm.tool_parsers", reason="vLLM's parsers are what reads a row's schemas")
    import copy

    from rlhf.agents.tool_parsers import VLLMParser
    from rlhf.data.formatting import PromptItem

    f = tmp_path / "echo.py"
    f.write_text('def echo(a: str) -> str:\n    """Echo the type.\n\n    Args:\n        a: a value\n    """\n'
                 '    return "got " + type(a).__name__\n')
    tools = load_tools(str(f))
    typed = copy.deepcopy(tools.schemas)
    typed[0]["function"]["parameters"]["properties"]["a"]["type"] = "integer"
    coder = "<tool_call>\n<function=echo>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>"
    eng = ScriptedEngine(tok, {"*": [coder, "done"]})
    eng.max_model_len = None
    lim = ToolLimits(max_turns=3, max_tool_calls=4, timeout_s=2.0, max_chars=60, max_episode_tokens=2000)
    ex = ToolAgentExecutor(tools, VLLMParser("qwen3_coder", tok, tools.schemas), lim, eng, tok,
                           contains_reward("int"), lambda s: VLLMParser("qwen3_coder", tok, s))
    text = tok.apply_chat_template([{"role": "user", "content": "go"}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    items = [PromptItem(text, None, ids, None), PromptItem(text, None, ids, typed),
             PromptItem(text, None, ids, copy.deepcopy(typed))]
    b = ex.run_items(items, SamplingParams(max_new_tokens=200, stop_token_ids=(tok.eos_token_id,)))
    got = ["".join(tok.decode(t) for k, t in spans(b, i) if k == 0) for i in range(3)]
    assert "got str" in got[0] and "got int" in got[1] and "got int" in got[2], got
    assert b.rewards.tolist() == [0.0, 1.0, 1.0] and len(ex.parsers) == 1, (b.rewards, ex.parsers)
