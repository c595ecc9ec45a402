"""The reward server's ASGI app and wire format: POST /get_reward {"query": [...]} -> {"rewards", "scores",
"extra_logs"}, GET /health; the bounds on requests (``Limits``: size, queue, deadline, API key) and the
turn-taking of micro-batches on one model thread (``RewardApp``).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Optional

MAX_BODY = 64 * 2**20


API_KEY_ENV = "RLHF_RM_API_KEY"  # the same variable the trainer's client reads (rlhf/rewards/remote.py)


def validate_request(body: bytes):
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"body is not JSON: {e}")
    except RecursionError:  # issue 42 item 8: a body nested ~100,000 deep escaped as a 500
        raise ValueError(f"body is nested deeper than the JSON parser allows (Python's recursion limit "
                         f"{sys.getrecursionlimit()}); send " + '{"query": ["<prompt + response>", ...]}') from None
    if not isinstance(req, dict):
        raise ValueError("body must be a JSON object")
    key = request_queries_key(req)
    q = req[key]
    if not isinstance(q, list) or not q or not all(isinstance(x, str) for x in q):
        raise ValueError(f"'{key}' must be a non-empty list of strings")
    empty = [i for i, x in enumerate(q) if not x.strip()]
    if empty:
        raise ValueError(f"'{key}' {empty[:5]} are empty strings; each query is prompt + response text")
    for other in ("prompts", "labels"):
        if other in req and (not isinstance(req[other], list) or len(req[other]) != len(q)):
            raise ValueError(f"'{other}' must be a list as long as '{key}' ({len(q)})")
    return {**req, "queries": q}


def request_queries_key(req: dict) -> str:
    """Which key of a request body holds the texts to score: ``query`` (OpenRLHF's client and server,
    openrlhf/utils/remote_rm_utils.py, openrlhf/cli/serve_rm.py) or ``queries``; ValueError if neither."""
    for key in ("query", "queries"):
        if key in req:
            return key
    raise ValueError(f"body has no 'query' (keys: {sorted(req)[:10]}); send "
                     '{"query": ["<prompt + response>", ...], "prompts": [...], "labels": [...]}')


PARSE_OFF_LOOP_BYTES = 256 * 2**10   # bodies over this are parsed on a worker thread, not the event loop


MIN_RATE_TOKENS = 1024               # micro-batches smaller than this (padded tokens) do not set the scoring rate


@dataclass
class Limits:
    request_timeout_s: float = 30.0       # headers, then body, must arrive within it; idle keep-alive closed after it
    request_deadline_s: float = 300.0     # scoring of one request
    max_queries_per_request: int = 4096
    max_pending_queries: int = 65536      # queued or being scored, over all requests
    max_connections: int = 512
    backlog: int = 2048
    api_key: Optional[str] = None


class _Disconnected(Exception):
    pass


class _BodyTooLarge(Exception):
    pass


class RewardApp:
    """The ASGI app (uvicorn's ``scope, receive, send`` contract, https://asgi.readthedocs.io/en/latest/specs/
    www.html): routes, auth, body read under a deadline, and scoring in turns on one model thread."""

    def __init__(self, scorer, limits: Limits):
        self.scorer, self.limits = scorer, limits
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reward_model")
        self.pending = 0
        self.batches_scored = 0     # micro-batches run (tests: a gone client's work stops)
        self.cancelled = 0          # requests whose remaining work was dropped (client gone or deadline)
        self.s_per_token: Optional[float] = None  # fastest rate seen on micro-batches of >= MIN_RATE_TOKENS

    def record_rate(self, padded_tokens: int, seconds: float) -> None:
        """Keep the fastest seconds per padded token seen on a micro-batch big enough to amortise a call's fixed
        cost: estimates from it are optimistic, so only work that cannot finish in time is refused."""
        if padded_tokens >= MIN_RATE_TOKENS and seconds > 0:
            rate = seconds / padded_tokens
            self.s_per_token = rate if self.s_per_token is None else min(self.s_per_token, rate)

    def too_much_work(self, queries: List[str]) -> Optional[str]:
        """Why a request cannot be scored within --request_deadline_s at the fastest rate measured (None if it
        can, or nothing is measured yet): refused up front (413) instead of accepted and dropped at the deadline
        (504).  Counts the padded tokens of its micro-batches (each query's tokens after the cut to --max_len)."""
        bs = max(int(getattr(self.scorer, "batch_size", 16)), 1)
        if self.s_per_token is None or len(queries) <= bs:
            return None
        count = getattr(self.scorer, "count_tokens", None)
        lens = count(queries) if count else [len(q) for q in queries]
        padded = sum(len(lens[s:s + bs]) * max(lens[s:s + bs]) for s in range(0, len(lens), bs))
        need = padded * self.s_per_token
        deadline = self.limits.request_deadline_s
        if need <= deadline:
            return None
        fits = max(int(len(queries) * deadline / need), 1)
        return (f"{len(queries)} queries ({padded} padded tokens) need about {need:.0f}s to score at this server's "
                f"fastest measured rate ({1 / self.s_per_token:.0f} tokens/s), over --request_deadline_s "
                f"{deadline:g}: send at most about {fits} queries of this length per request, or give the trainer "
                f"several servers (--remote_rm_url URL1,URL2 splits each batch), or raise --request_deadline_s")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        t0 = time.monotonic()
        path, method = scope["path"], scope["method"]
        if path == "/health" and method in ("GET", "HEAD"):
            return await _respond(send, 200, {"status": "ok"})
        if path not in ("/get_reward", "/"):
            return await _respond(send, 404, {"error": f"no route {path}; POST /get_reward"})
        if method != "POST":
            return await _respond(send, 405, {"error": f"{method} {path}: POST a JSON body"})
        headers = dict(scope["headers"])
        if self.limits.api_key and not _key_ok(headers.get(b"authorization", b""), self.limits.api_key):
            return await _respond(send, 401, {"error": f"missing or wrong API key: send 'Authorization: Bearer "
                                                       f"<key>' (the trainer sends ${API_KEY_ENV})"},
                                  [(b"www-authenticate", b"Bearer")])
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        n = int(headers.get(b"content-length", b"0") or 0)  # h11 has already refused a malformed one with 400
        if n <= 0 and not chunked:
            return await _respond(send, 400, {"error": "missing body (Content-Length 0)"})
        if n > MAX_BODY:
            return await _respond(send, 413, {"error": f"body of {n} bytes is over {MAX_BODY}"}, close=True)
        budget = self.limits.request_timeout_s - (time.monotonic() - t0)
        try:
            body = await asyncio.wait_for(_read_body(receive), max(budget, 0.001))
        except asyncio.TimeoutError:
            return await _respond(send, 408, {"error": f"request body not received within "
                                                       f"{self.limits.request_timeout_s:g}s (--request_timeout_s)"},
                                  close=True)
        except _BodyTooLarge:
            return await _respond(send, 413, {"error": f"body is over {MAX_BODY} bytes"}, close=True)
        except _Disconnected:
            return None
        loop = asyncio.get_running_loop()
        try:  # a big body is parsed (and its work counted) on a worker thread: other clients are served meanwhile
            req = await loop.run_in_executor(None, validate_request, body) if len(body) > PARSE_OFF_LOOP_BYTES \
                else validate_request(body)
        except ValueError as e:
            return await _respond(send, 400, {"error": str(e)})
        queries = req["queries"]
        cap = self.limits.max_queries_per_request
        if len(queries) > cap:
            return await _respond(send, 413, {
                "error": f"{len(queries)} queries in one request; this server takes at most {cap} "
                         f"(--max_queries_per_request): send smaller batches, or give the trainer several servers "
                         f"(--remote_rm_url URL1,URL2 splits each batch across them)"})
        why = await loop.run_in_executor(None, self.too_much_work, queries) if self.s_per_token is not None \
            else None
        if why:
            return await _respond(send, 413, {"error": why})
        if self.pending + len(queries) > self.limits.max_pending_queries:
            return await _respond(send, 503, {
                "error": f"server busy: {self.pending} queries queued (--max_pending_queries "
                         f"{self.limits.max_pending_queries}); retry"}, [(b"retry-after", b"1")])
        self.pending += len(queries)
        work = asyncio.ensure_future(self._score_all(queries))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            done, _ = await asyncio.wait({work, gone}, timeout=self.limits.request_deadline_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                work.cancel()
                self.cancelled += 1
                if gone in done:
                    return None
                return await _respond(send, 504, {
                    "error": f"{len(queries)} queries not scored within {self.limits.request_deadline_s:g}s "
                             f"(--request_deadline_s); the rest of the work was dropped"})
            try:
                rewards, cut = work.result()
            except Exception as e:  # scoring failure is the server's fault
                return await _respond(send, 500, {"error": f"{type(e).__name__}: {e}"})
            return await _respond(send, 200, {"rewards": rewards, "scores": rewards,
                                              "extra_logs": {"rm_query_truncated": [float(c) for c in cut]}})
        except asyncio.CancelledError:  # uvicorn shutting down past its grace: drop the work, tell the client
            work.cancel()
            self.cancelled += 1
            return await _respond(send, 503, {"error": "the reward server is shutting down; retry"}, close=True)
        finally:
            gone.cancel()
            self.pending -= len(queries)

    async def _score_all(self, queries: List[str]):
        """One micro-batch at a time on the model thread: other requests' micro-batches queue in between."""
        loop = asyncio.get_running_loop()
        rewards: List[float] = []
        cut: List[bool] = []
        bs = max(int(getattr(self.scorer, "batch_size", 16)), 1)
        for s in range(0, len(queries), bs):
            r, c = await loop.run_in_executor(self.pool, self._timed_batch, queries[s:s + bs])
            self.batches_scored += 1
            rewards += r
            cut += c
        return rewards, cut


    def _timed_batch(self, queries: List[str]):
        """score_batch, timed: the rate ``too_much_work`` estimates with (a scorer without ``last_padded``
        counts one token per character)."""
        t0 = time.monotonic()
        out = self.scorer.score_batch(queries)
        padded = getattr(self.scorer, "last_padded", None) or len(queries) * max(len(q) for q in queries)
        self.record_rate(padded, time.monotonic() - t0)
        return out


def _key_ok(header: bytes, key: str) -> bool:
    scheme, _, given = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


async def _read_body(receive) -> bytes:
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _Disconnected()
        chunks.append(msg.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY:  # a chunked body announces no length
            raise _BodyTooLarge()
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(send, code: int, obj, extra_headers=(), close: bool = False) -> None:
    data = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
               *extra_headers]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": data})
