"""Multi-turn tool episodes (``--tools_path`` without ``--agent_func_path``): the model calls tools, the tools'
messages come back through the chat template, until the model answers without a call or a limit is reached.

One episode (``ToolAgentExecutor.episode``), as veRL's ToolAgentLoop (verl/experimental/agent_loop/
tool_agent_loop.py) and TRL's tool-calling GRPO (``max_tool_calling_iterations``) run it::

    ids = prompt
    for turn in 1 .. --max_steps:
        turn_ids = await llm_engine.generate(ids, ...)         # action mask 1, its log-probs kept
        calls = --tool_call_parser(turn text)
        no call, or a length stop             -> episode ends
        turn == --max_steps                   -> episode ends (no turn left for the answer)
        each call (up to --max_tool_calls per episode): run_call (timeout, output cap, errors as text)
        a malformed call                      -> one error message instead ("could not read the tool call")
        tool_ids = the chat template's tool messages (role "tool") after the turn   # action mask 0, log-prob 0
        over --max_episode_tokens, or no room left in the engine's max_model_len -> episode ends (truncated)

The generation goes through OpenRLHF's llm_engine contract (``rlhf.agents.openrlhf_agent.AsyncEngine``: ``await
generate(prompt_token_ids, sampling_params)`` -> outputs[0].token_ids / .text / .logprobs / .finish_reason), so
what batches the requests underneath may change without touching this file.  The reward is the run's reward
function (--remote_rm_url, else the built-in) on the whole episode's text (prompt + model turns + tool messages),
at the episode's end, plus the episode's tool rewards::

    reward = reward_fn(prompt + episode text) + sum over the episode's tool calls of the call's reward

(a tool returning ``{"content": ..., "reward": r}``, rlhf.agents.tools; veRL's ``BaseTool.execute`` step reward).
They are summed into the sample's reward (the advantage estimators take one reward per sample), not placed on the
turn's tokens; ``scores`` (dynamic filtering, accuracy) stay the reward function's.  The rows carry the reward like
an agent environment's (the trainer's agent mode).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from rlhf.agents import episode_stats
from rlhf.agents.base import AgentExecutorBase
from rlhf.agents.openrlhf_agent import AsyncEngine, OpenRLHFSamplingParams
from rlhf.agents.tool_parsers import Parsed
from rlhf.agents.tools import ToolSet, run_call
from rlhf.engines.rollout import Batch, SamplingParams, batch_from_rows

MARK = "RLHFTOOLMARK"  # an assistant turn's stand-in text when the template's pieces are measured


@dataclass
class ToolLimits:
    max_turns: int          # --max_steps
    max_tool_calls: int     # --max_tool_calls
    timeout_s: float        # --tool_timeout_s
    max_chars: int          # --tool_output_max_chars
    max_episode_tokens: int  # --max_episode_tokens (default --generate_max_len x --max_steps)


@dataclass
class EpisodeRow:
    response: List[int] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    truncated: bool = False
    turns: int = 0
    calls: int = 0
    statuses: List[str] = field(default_factory=list)
    malformed: int = 0
    over_limit: int = 0
    tool_s: float = 0.0
    tool_reward: float = 0.0  # the sum of its tool calls' own rewards (rlhf.agents.tools: {"content", "reward"})


def tool_turn_text(tokenizer, messages: List[dict]) -> str:
    """The text the chat template puts after an assistant turn for these tool messages, up to the next assistant
    turn's opening, less the turn's end-of-turn token (the model's own stop token ends its turn):

        tail = render(u, a, *tools, add_generation_prompt=True) after a's content
        text = tail after its first eos text   where the template closes an assistant turn with eos (ChatML's
               <|im_end|>: the text starts with the newline after it), else the whole tail

    TRL cuts the same way at the eos (trl/trainer/grpo_trainer.py ``_get_tool_suffix_ids``: a dummy conversation,
    its ids trimmed after the last eos, must prefix the one with the tool messages); here the cut is made after the
    assistant's content in each rendering, so templates that render the last assistant turn apart (Qwen3's empty
    think block) work too."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]
    a = tokenizer.apply_chat_template(base, tokenize=False)
    b = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
    if MARK not in a or MARK not in b:
        raise ValueError("the chat template does not render an assistant message's content, so a tool turn cannot "
                         "be placed after the model's turn; use a chat template that renders role 'assistant' and "
                         "role 'tool' messages")
    closing, tail = a[a.rindex(MARK) + len(MARK):], b[b.rindex(MARK) + len(MARK):]
    eos = tokenizer.eos_token
    if eos and eos in closing and eos in tail:
        return tail.split(eos, 1)[1]
    return tail


class ToolStats:
    """Counts over one run of episodes -> the step's ``tool/*`` metrics."""

    def __init__(self):
        self.rows: List[EpisodeRow] = []

    def metrics(self) -> Dict[str, float]:
        rows = self.rows
        if not rows:
            return {}
        calls = sum(r.calls for r in rows)
        st = [s for r in rows for s in r.statuses]
        rate = (lambda *k: sum(s in k for s in st) / calls) if calls else (lambda *k: 0.0)
        return {"tool/calls_per_episode": calls / len(rows), "tool/turns_per_episode": sum(r.turns for r in rows)
                / len(rows), "tool/error_rate": rate("error", "unknown", "bad_args"), "tool/timeout_rate":
                rate("timeout"), "tool/malformed_calls": float(sum(r.malformed for r in rows)),
                "tool/over_limit_calls": float(sum(r.over_limit for r in rows)),
                "tool/time_s": sum(r.tool_s for r in rows),
                "tool/reward_per_episode": sum(r.tool_reward for r in rows) / len(rows)}


class ToolAgentExecutor(AgentExecutorBase):
    """The executor contract (``run(prompt_ids, prompts, labels, params) -> Batch``, rlhf.agents.base) over tool
    episodes; ``parser``: rlhf.agents.tool_parsers (``extract(text) -> Parsed``) over the --tools_path file's
    schemas; ``parser_for(schemas)``: a parser over a row's own ``tools`` schemas (vLLM's parsers read them, e.g.
    qwen3_coder types the arguments from them), one per distinct schema list (None: ``parser`` for every row);
    ``reward_fn``: a RewardSource
    (``(queries, prompts, labels) -> {rewards, scores, valid, ...}``)."""

    def __init__(self, tools: ToolSet, parser, limits: ToolLimits, engine, tokenizer, reward_fn,
                 parser_for: Optional[Callable[[list], object]] = None):
        super().__init__(None, limits.max_turns, limits.max_episode_tokens, engine, tokenizer)
        self.tools, self.parser, self.limits, self.reward_fn = tools, parser, limits, reward_fn
        self.parser_for, self.parsers = parser_for, {}
        self.tool_stats = ToolStats()

    def row_parser(self, schemas: Optional[list]):
        """The parser of a row offering ``schemas`` (its ``tools`` column; None or the file's: ``parser``)."""
        if not schemas or self.parser_for is None or schemas == self.tools.schemas:
            return self.parser
        key = json.dumps(schemas, sort_keys=True)
        if key not in self.parsers:
            self.parsers[key] = self.parser_for(schemas)
        return self.parsers[key]
        self.tool_stats = ToolStats()

    def take_metrics(self) -> Dict[str, float]:
        """The engine's occupancy (``agent/*``, the base's) and the tool metrics (``tool/*``) since the last call."""
        m, self.tool_stats = {**super().take_metrics(), **self.tool_stats.metrics()}, ToolStats()
        return m

    def run_items(self, items, params: SamplingParams) -> Batch:
        """``run``, each row's episodes limited to the tools its prompt offered (its ``tools`` column, if any)."""
        offered = [None if not p.tools else {t["function"]["name"] for t in p.tools} for p in items]
        return self.run([p.ids for p in items], [p.prompt for p in items], [p.label for p in items], params, offered,
                        [self.row_parser(p.tools) for p in items])

    def run(self, prompt_ids, prompts, labels, params: SamplingParams, offered=None, parsers=None) -> Batch:
        """Every sample's episode concurrently (``n`` per prompt, prompt-major), then the reward function on all of
        them outside the event loop (where its deadline and an async reward function work as in a plain call).
        ``offered``: per prompt, the tool names it may call (None: every tool of --tools_path); ``parsers``: per
        prompt, the parser of its calls (None: ``parser``)."""
        p_ids = [list(ids) for ids in prompt_ids for _ in range(params.n)]
        names = [o for o in (offered or [None] * len(prompt_ids)) for _ in range(params.n)]
        readers = [q for q in (parsers or [self.parser] * len(prompt_ids)) for _ in range(params.n)]
        rows: List[EpisodeRow] = asyncio.run(self._episodes(p_ids, names, params, readers))
        self.tool_stats.rows += rows
        rewards, scores = self.score([t for t in prompts for _ in range(params.n)], [r.response for r in rows],
                                     [lab for lab in labels for _ in range(params.n)])
        rewards = [r + row.tool_reward for r, row in zip(rewards, rows)]  # reward = reward function + tool rewards
        return batch_from_rows(p_ids, [r.response for r in rows], [r.logprobs for r in rows],
                               [r.truncated for r in rows], self.tokenizer.pad_token_id,
                               action_masks=[r.mask for r in rows], rewards=rewards, scores=scores)

    async def _episodes(self, p_ids: List[List[int]], names, params: SamplingParams, readers) -> List[EpisodeRow]:
        """Each sample's episode as its own task, inside ``episode_stats.episode(k)``: its requests get the
        episode's own seed per turn (``seed_for``; one shared seed would make the ``n`` samples of a prompt equal on
        a seeded engine) and its turns and latency count in the ``agent/*`` metrics (``run_episodes``)."""
        eng = AsyncEngine(self.engine, self.tokenizer, params.max_new_tokens)
        sp = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
                  stop_token_ids=tuple(params.stop_token_ids))

        async def one(k: int, ids: List[int], offered, parser):
            with episode_stats.episode(k) as st:
                return await self.episode(ids, eng, sp, params.max_new_tokens, offered, parser), st

        return await self.run_episodes([one(k, *job) for k, job in enumerate(zip(p_ids, names, readers))])

    def score(self, prompts: List[str], responses: List[List[int]], labels: List):
        """The reward function on prompt + the whole episode (tool messages included); invalid rewards NaN."""
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        res = self.reward_fn([p + r for p, r in zip(prompts, texts)], list(prompts), list(labels))
        r = torch.as_tensor(res["rewards"], dtype=torch.float32).reshape(-1)
        s = torch.as_tensor(res["scores"], dtype=torch.float32).reshape(-1)
        valid = torch.as_tensor(res.get("valid", torch.isfinite(r)), dtype=torch.bool).reshape(-1)
        return (torch.where(valid, r, torch.full_like(r, math.nan)).tolist(),
                torch.where(valid, s, torch.full_like(s, math.nan)).tolist())

    async def episode(self, prompt: List[int], eng: AsyncEngine, sp: dict, max_new_tokens: int,
                      offered: Optional[set] = None, parser=None) -> EpisodeRow:
        lim, row, parser = self.limits, EpisodeRow(), parser or self.parser
        stop = set(sp["stop_token_ids"]) or {self.tokenizer.eos_token_id}  # a turn ends at its stop token
        context = self.engine.max_model_len or math.inf
        while True:
            room = min(lim.max_episode_tokens - len(row.response), context - len(prompt) - len(row.response))
            if room <= 0:
                row.truncated = True
                return row
            out = (await eng.generate(prompt + row.response, OpenRLHFSamplingParams(
                max_tokens=int(min(max_new_tokens, room)), **sp))).outputs[0]
            action = list(out.token_ids)
            row.response += action
            row.mask += [1] * len(action)
            row.logprobs += [lp[t].logprob for t, lp in zip(action, out.logprobs)]
            row.turns += 1
            if out.finish_reason == "length" or not action or action[-1] not in stop:
                row.truncated = out.finish_reason == "length"
                return row
            text = self.tokenizer.decode(action[:-1], skip_special_tokens=False)
            parsed = parser.extract(text)
            if (not parsed.calls and not parsed.malformed) or row.turns >= lim.max_turns:
                return row
            feedback = self.tokenizer(tool_turn_text(self.tokenizer, await self.run_tools(parsed, row, offered)),
                                      add_special_tokens=False)["input_ids"]
            if len(row.response) + len(feedback) >= min(lim.max_episode_tokens, context - len(prompt)):
                row.truncated = True
                return row
            row.response += feedback
            row.mask += [0] * len(feedback)
            row.logprobs += [0.0] * len(feedback)

    async def run_tools(self, parsed: Parsed, row: EpisodeRow, offered: Optional[set] = None) -> List[dict]:
        """The tool messages for one turn's calls (run concurrently), counted in ``row``; ``offered``: the names
        this episode's prompt offered (None: all)."""
        lim = self.limits
        if parsed.malformed:
            row.malformed += 1
            return [{"role": "tool", "content": "Error: the tool call could not be read (it must be valid JSON with "
                                                "a 'name' and 'arguments', in the model's tool-call format)"}]
        room = max(0, lim.max_tool_calls - row.calls)
        run, refused = parsed.calls[:room], parsed.calls[room:]
        t0 = time.perf_counter()
        results = await asyncio.gather(*[run_call(self.tools, c.name, c.arguments, lim.timeout_s, lim.max_chars,
                                                  offered) for c in run])
        row.tool_s += time.perf_counter() - t0
        row.calls += len(run)
        row.over_limit += len(refused)
        row.statuses += [r.status for r in results]
        row.tool_reward += sum(r.reward for r in results)
        msgs = [{"role": "tool", "name": c.name, "content": r.content} for c, r in zip(run, results)]
        return msgs + [{"role": "tool", "name": c.name, "content": f"Error: tool call limit reached "
                        f"({lim.max_tool_calls} per episode, --max_tool_calls); {c.name!r} was not run"}
                       for c in refused]

