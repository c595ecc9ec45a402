"""The endpoint's engines and sessions: requests arrive on the server's thread and are run on the event loop that
owns an engine, through the llm_engine contract (``await llm_engine.generate(prompt_token_ids, sampling_params)``
returning a vLLM ``RequestOutput``-like object; rlhf.agents.openrlhf_agent).

* ``LoopBridge``: an llm_engine whose ``generate`` may be awaited on any thread's loop; the call itself runs on the
  loop that owns the engine (``asyncio.run_coroutine_threadsafe``), the caller's loop only waits.
* ``Hub``: the engine slots (one per engine this process drives), the session table, the session -> engine map (a
  session is placed on the slot with the fewest open sessions, or the slot its episode runs on, and stays there), and
  ``chat`` / ``complete``: one request from its body to its response body.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from copy import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from rlhf.agents.base import say_once
from rlhf.agents.endpoint import protocol as wire
from rlhf.agents.endpoint.sessions import EndpointError, Session, SessionTable, next_prompt, record
from rlhf.agents.endpoint.tool_turns import make_tool_parser, own_tool_turns, read_calls
from rlhf.agents.openrlhf_agent import OpenRLHFSamplingParams


class LoopBridge:
    """``generate`` on the loop that owns the engine, awaited from any loop.  ``bind`` re-targets it (a rollout
    step's loop and llm_engine replace the last step's)."""

    def __init__(self, llm_engine=None, loop: Optional[asyncio.AbstractEventLoop] = None):
        self.llm_engine, self.loop = llm_engine, loop

    def bind(self, llm_engine, loop: asyncio.AbstractEventLoop) -> LoopBridge:
        self.llm_engine, self.loop = llm_engine, loop
        return self

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        engine, loop = self.llm_engine, self.loop
        if engine is None:
            raise EndpointError(503, "no rollout is running on this engine (the endpoint serves while the job's "
                                     "rollout runs its episodes)", "engine_idle", "server_error")
        if asyncio.get_running_loop() is loop:
            return await engine.generate(prompt_token_ids, sampling_params, multi_modal_data)
        coro = engine.generate(prompt_token_ids, sampling_params, multi_modal_data)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the step's loop has closed: between rollouts
            coro.close()
            raise EndpointError(503, "the engine's rollout has ended (the endpoint serves while the job's rollout "
                                     "runs its episodes)", "engine_idle", "server_error") from None
        return await asyncio.wrap_future(fut)


@dataclass
class Settings:
    """Where the endpoint binds (--agent_endpoint_host, --agent_endpoint_port; 0: a free port), the engine's
    context limit (prompt + completion tokens of one sequence; None: only the session's own budget), and ``score``:
    the job's reward function (--remote_rm_url), for an OpenRLHF executor result without a reward."""
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: Optional[int] = None
    score: Optional[Callable] = None
    tool_call_parser: Optional[str] = None  # --tool_call_parser (rlhf/agents/tool_parsers.py): tool_calls replies


class Hub:
    def __init__(self, tokenizer, model_name: str, settings: Settings):
        self.tokenizer, self.model_name, self.settings = tokenizer, model_name, settings
        self.table = SessionTable()
        self.slots: Dict[str, LoopBridge] = {}
        self.slot_lock = threading.Lock()
        self.default = OpenRLHFSamplingParams(max_tokens=None)

    # ---- engines and sessions ----------------------------------------------------------------------------------
    def attach(self, name: str, llm_engine, loop: asyncio.AbstractEventLoop) -> str:
        with self.slot_lock:
            self.slots.setdefault(name, LoopBridge()).bind(llm_engine, loop)
        return name

    def place(self) -> str:
        """The slot for a new session or a sessionless call: of the engines whose rollout is running, the one with
        the fewest open sessions (ties: the first attached)."""
        with self.slot_lock:
            names = [n for n, b in self.slots.items() if b is None or (b.loop is not None and b.loop.is_running())]
        if not names:
            raise EndpointError(503, "no engine is rolling out now (the endpoint serves while the job's rollout "
                                     "runs its episodes)", "engine_idle", "server_error")
        load = self.table.per_engine()
        return min(names, key=lambda n: load.get(n, 0))

    def open_session(self, engine: Optional[str] = None, limit: Optional[int] = None, sampling=None,
                     session_id: Optional[str] = None, tool_call_parser: Optional[str] = None) -> Session:
        cap = self.settings.max_model_len
        lim = min(x for x in (limit, cap) if x) if (limit or cap) else None
        return self.table.add(Session(session_id or uuid.uuid4().hex, engine or self.place(), lim, sampling,
                                      tool_call_parser or self.settings.tool_call_parser))

    def finish(self, sid: str) -> Optional[Session]:
        return self.table.finish(sid)

    # ---- tokens -------------------------------------------------------------------------------------------------
    def encode(self, text: str) -> List[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # ---- requests -----------------------------------------------------------------------------------------------
    async def chat(self, body: Dict[str, Any], sid: Optional[str]) -> Dict[str, Any]:
        msgs, tools = wire.messages_of(body), body.get("tools")

        def render(s: Optional[Session]):
            text = wire.render_chat(self.tokenizer, own_tool_turns(msgs, s), tools)
            return text, self.encode(text)

        def respond(model, prompt, ids, lps, text, finish, s: Optional[Session]):
            name = s.tool_call_parser if s is not None else self.settings.tool_call_parser
            parser = make_tool_parser(name, self.tokenizer, tools)
            content, calls, malformed = read_calls(text, parser, sid, len(s.turns) - 1 if s is not None else 0)
            if malformed:
                self.table.count(malformed_tool_calls=1)
            return wire.chat_body(model, prompt, ids, lps, content, calls, finish, self.tokenizer, body, sid)

        return await self._call(body, sid, render, respond)

    async def complete(self, body: Dict[str, Any], sid: Optional[str]) -> Dict[str, Any]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # OpenAI's batch form with one prompt
        if isinstance(p, str) and p:
            render = lambda s: (p, self.encode(p))  # noqa: E731
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            render = lambda s: (self.decode(p), list(p))  # noqa: E731
        else:
            raise wire.bad("'prompt' must be a non-empty string or a list of token ids (one prompt per call)", "prompt")

        def respond(model, prompt, ids, lps, text, finish, s):
            return wire.completion_body(model, prompt, ids, lps, text, finish, self.tokenizer, body, sid)

        return await self._call(body, sid, render, respond)

    async def _call(self, body, sid, render, respond) -> Dict[str, Any]:
        """One engine call: the session acquired (one call at a time), its prompt rendered and extended from the
        recorded ids (``next_prompt``), the engine's answer recorded, ``respond`` writing the body."""
        req = wire.requested(body)
        s = self.table.acquire(sid) if sid else None
        try:
            text, full = render(s)
            if s is not None:
                prompt, repaired = next_prompt(s, text, full, self.encode, self.decode)
                if repaired:
                    s.repairs += 1
                    self.table.count(drift_repairs=1)
                bridge, limit = self.slots[s.engine], s.limit
            else:
                prompt, bridge, limit = full, self.slots[self.place()], self.settings.max_model_len
            sp = self._sampling(req, s, len(prompt), limit, sid)
            t0 = time.perf_counter()
            out = (await bridge.generate(prompt, sp)).outputs[0]
            if s is not None:
                s.gen_s += time.perf_counter() - t0
            ids = list(out.token_ids)
            lps = [d[t].logprob for t, d in zip(ids, out.logprobs or [])]
            if len(lps) != len(ids):
                raise EndpointError(500, f"the engine returned {len(lps)} log-probs for {len(ids)} tokens",
                                    "engine_contract", "server_error")
            finish = out.finish_reason or "stop"
            if s is not None:
                record(s, prompt, ids, lps, finish, out.text or "")
            self.table.count(requests=1)
            return respond(body.get("model") or self.model_name, prompt, ids, lps, out.text or "", finish, s)
        finally:
            if s is not None:
                self.table.release(s)

    def _sampling(self, req: Dict[str, Any], s: Optional[Session], n_prompt: int, limit: Optional[int], sid):
        """The call's sampling params: a session samples as its rollout does (its temperature / top_p / top_k: the
        trainer's log-probs assume them; a caller's other value is ignored, counted and said once); max_tokens is
        the caller's or the rollout's, within what the context limit leaves."""
        base = s.sampling if s is not None and s.sampling is not None else self.default
        sp = copy(base)
        sp.logprobs, sp.skip_special_tokens = 1, bool(req.get("skip_special_tokens", True))  # vLLM's server default
        for k in ("seed", "stop_token_ids"):
            if k in req:
                setattr(sp, k, req[k])
        for k in wire.SAMPLING_FIELDS:
            if k not in req:
                continue
            if s is None:
                setattr(sp, k, req[k])
            elif req[k] != getattr(base, k):
                self.table.count(ignored_sampling=1)
                say_once("endpoint:sampling", f"[endpoint] session {sid}: the request's {k}={req[k]} is ignored; "
                                              f"a training session samples with the rollout's settings ({k}="
                                              f"{getattr(base, k)}), so the recorded log-probs are the trained "
                                              f"policy's. Said once; later ones are counted "
                                              f"(endpoint/ignored_sampling_overrides)")
        if limit is not None and n_prompt >= limit:
            who = f"session {sid}: " if sid else ""
            raise EndpointError(400, f"{who}the prompt is {n_prompt} tokens; this endpoint's maximum context length "
                                     f"is {limit} tokens (prompt + completion; the episode's budget, "
                                     f"--generate_max_len x --max_steps past the first prompt, within the engine's "
                                     f"max_model_len). Shorten the conversation", "context_length_exceeded")
        mt = req.get("max_tokens") or base.max_tokens or 16
        sp.max_tokens = mt if limit is None else min(mt, limit - n_prompt)
        return sp
