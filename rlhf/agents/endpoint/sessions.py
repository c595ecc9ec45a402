"""A session of the in-job endpoint: one agent episode's model calls, recorded as token ids and log-probs and
stitched into one training sample token-exactly.

The session holds ``ids``: every token the engine has seen or produced so far (the first call's prompt, each
completion, and the new tokens of each later prompt).  A later call's prompt is ``ids`` + the tokens of what its
messages add (``next_prompt``): the engine is always given the recorded ids, so the stitched sample is exactly what
the engine saw and produced, whatever a fresh tokenisation of the re-rendered conversation would give.

OpenRLHF's examples/python/agent_func_openai_server_executor.py (``_session_buffers``, ``_stitch_session``) is the
model; it asserts that the re-tokenised prompt starts with the recorded ids.  Here that is the first rule, and two
repairs follow it (both counted as drift repairs):

1. ``encode(text)[:n] == ids``                       -> ``ids + encode(text)[n:]``     (no drift)
2. ``decode(ids)`` is a prefix of ``text``            -> ``ids + encode(text[len(decode(ids)):])``  (BPE drift)
3. the session as the client saw it is a prefix of ``text``: the prompt tokens decoded, each completion as the
   text the client was sent (``Turn.text``: without special tokens such as the eos that ended it, which chat
   templates do not render after an assistant message, or a special token a model emitted mid-turn)
   -> ``ids + encode(rest)``, the model's tokens kept
4. otherwise: a prefix break, ``EndpointError`` 409 naming the session and where the texts part.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple


class EndpointError(Exception):
    """An HTTP error of the endpoint: ``status`` (4xx / 5xx), OpenAI's error ``type`` and ``code``."""

    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type_


@dataclass
class Turn:
    """One model call of a session: its completion starts at ``start`` in the session's ids."""
    start: int
    ids: List[int]
    logprobs: List[float]
    finish_reason: str
    text: str = ""  # the completion's text as the client was sent it


@dataclass
class Session:
    id: str
    engine: str                       # the engine slot every call of this session runs on
    limit: Optional[int] = None       # prompt + completion tokens of the whole sample (the context limit)
    sampling: Any = None              # the rollout's sampling params (OpenRLHF's / vLLM's fields)
    tool_call_parser: Optional[str] = None  # its executor's --tool_call_parser
    ids: List[int] = field(default_factory=list)
    prompt_len: Optional[int] = None  # the first call's prompt: the training sample's prompt
    turns: List[Turn] = field(default_factory=list)
    repairs: int = 0
    busy: bool = False
    finished: bool = False
    gen_s: float = 0.0                # seconds its calls waited for the engine (the episode's agent/gen_s)


def _common_text(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def client_text(s: Session, decode: Callable[[List[int]], str]) -> str:
    """The session as its client saw it: the tokens between completions decoded (special tokens kept), each
    completion as the text it was sent."""
    parts, at = [], 0
    for t in s.turns:
        parts += [decode(s.ids[at:t.start]), t.text]
        at = t.start + len(t.ids)
    parts.append(decode(s.ids[at:]))
    return "".join(parts)


def next_prompt(s: Session, text: str, full: List[int], encode: Callable[[str], List[int]],
                decode: Callable[[List[int]], str]) -> Tuple[List[int], bool]:
    """(prompt ids for the session's next call, whether a drift repair was needed); ``text`` is the call's rendered
    prompt and ``full`` its fresh tokenisation.  The rules are the module docstring's."""
    n = len(s.ids)
    if not n:
        return list(full), False
    if full[:n] == s.ids:
        return list(full), False
    for seen in (decode(s.ids), client_text(s, decode)):
        if text.startswith(seen):
            return s.ids + encode(text[len(seen):]), True
    seen = client_text(s, decode)
    at = _common_text(seen, text)
    raise EndpointError(
        409, f"session {s.id}: prefix break at call {len(s.turns) + 1}: the conversation sent no longer starts with "
             f"the session's recorded tokens ({n} tokens; the texts part at character {at}: recorded "
             f"{seen[at:at + 40]!r}, sent {text[at:at + 40]!r}). A session is one growing conversation: send the "
             f"earlier messages and the model's replies unchanged, or start a new session", "prefix_break")


def record(s: Session, prompt: List[int], completion: List[int], logprobs: List[float], finish: str,
           text: str = "") -> None:
    """A call's result into its session: ids = prompt + completion; ``text``: what the client was sent."""
    if s.prompt_len is None:
        s.prompt_len = len(prompt)
    s.turns.append(Turn(len(prompt), list(completion), list(logprobs), finish, text))
    s.ids = list(prompt) + list(completion)


def stitched(s: Session) -> Dict[str, Any]:
    """The session as one sample in OpenRLHF's executor-result fields: ``observation_tokens`` (all ids),
    ``action_ranges`` ([start, end) of each completion: the model's tokens only), ``rollout_log_probs`` (one per
    observation token; 0 outside the actions) and ``truncated`` (the last call hit its length limit)."""
    lps = [0.0] * len(s.ids)
    for t in s.turns:
        lps[t.start:t.start + len(t.ids)] = t.logprobs
    return {"observation_tokens": list(s.ids), "action_ranges": [(t.start, t.start + len(t.ids)) for t in s.turns],
            "rollout_log_probs": lps, "truncated": bool(s.turns) and s.turns[-1].finish_reason == "length"}


@dataclass
class EndpointMetrics:
    """Counters of one endpoint (all its engines): ``snapshot()`` gives the logged names."""
    requests: int = 0
    sessions: int = 0
    session_requests: List[int] = field(default_factory=list)
    stitched_lens: List[int] = field(default_factory=list)
    drift_repairs: int = 0
    errors: Dict[int, int] = field(default_factory=dict)
    failed_episodes: int = 0
    ignored_sampling: int = 0
    malformed_tool_calls: int = 0

    def snapshot(self) -> Dict[str, float]:
        mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
        return {"endpoint/requests": self.requests, "endpoint/sessions": self.sessions,
                "endpoint/requests_per_session": mean(self.session_requests),
                "endpoint/stitched_len_mean": mean(self.stitched_lens),
                "endpoint/stitched_len_max": max(self.stitched_lens, default=0),
                "endpoint/drift_repairs": self.drift_repairs,
                "endpoint/4xx": sum(v for k, v in self.errors.items() if 400 <= k < 500),
                "endpoint/5xx": sum(v for k, v in self.errors.items() if k >= 500),
                "endpoint/failed_episodes": self.failed_episodes,
                "endpoint/ignored_sampling_overrides": self.ignored_sampling,
                "endpoint/malformed_tool_calls": self.malformed_tool_calls}


class SessionTable:
    """Open sessions by id, the ids of finished ones (a late call gets 410, not 404), and the metrics; one lock, held
    for dictionary work only (never across an engine call), so no session waits for another."""

    KEEP_FINISHED = 100_000

    def __init__(self):
        self.lock = threading.Lock()
        self.open: Dict[str, Session] = {}
        self.finished: Dict[str, None] = {}
        self.metrics = EndpointMetrics()  # since the endpoint started (GET /metrics)
        self.step = EndpointMetrics()     # since the last ``take`` (the trainer's step metrics)

    def add(self, s: Session) -> Session:
        with self.lock:
            if s.id in self.open or s.id in self.finished:
                raise EndpointError(409, f"session {s.id} exists already", "session_exists")
            self.open[s.id] = s
            for m in (self.metrics, self.step):
                m.sessions += 1
        return s

    def acquire(self, sid: str) -> Session:
        """The open session ``sid``, marked busy (one call at a time: a conversation is a sequence)."""
        with self.lock:
            s = self.open.get(sid)
            if s is None:
                if sid in self.finished:
                    raise EndpointError(410, f"session {sid} is finished (its episode has been stitched into a "
                                             f"training sample); open a new session", "session_finished")
                raise EndpointError(404, f"unknown session {sid!r}: sessions are opened by the job for each episode "
                                         f"(run_agent's client carries its id)", "session_not_found")
            if s.busy:
                raise EndpointError(409, f"session {sid} has a call in flight; a session is one conversation, its "
                                         f"calls one after another", "session_busy")
            s.busy = True
            return s

    def release(self, s: Session) -> None:
        with self.lock:
            s.busy = False

    def finish(self, sid: str) -> Optional[Session]:
        """Close ``sid`` (its later calls get 410) and count its sample; None if it was not open."""
        with self.lock:
            s = self.open.pop(sid, None)
            self.finished[sid] = None
            if len(self.finished) > self.KEEP_FINISHED:
                self.finished.pop(next(iter(self.finished)))
            if s is not None:
                for m in (self.metrics, self.step):
                    m.session_requests.append(len(s.turns))
                    m.stitched_lens.append(len(s.ids))
            return s

    def count(self, **inc) -> None:
        with self.lock:
            for m in (self.metrics, self.step):
                for k, v in inc.items():
                    if k == "error":
                        m.errors[v] = m.errors.get(v, 0) + 1
                    else:
                        setattr(m, k, getattr(m, k) + v)

    def take(self) -> Dict[str, float]:
        """The metrics since the last call (a rollout step's), then reset."""
        with self.lock:
            out, self.step = self.step.snapshot(), EndpointMetrics()
        return out

    def per_engine(self) -> Dict[str, int]:
        with self.lock:
            out: Dict[str, int] = {}
            for s in self.open.values():
                out[s.engine] = out.get(s.engine, 0) + 1
            return out
