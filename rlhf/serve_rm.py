"""HTTP reward server:  python -m rlhf.serve_rm --reward_pretrain DIR [--port 5000] [--api_key KEY]

POST /get_reward  {"query": [str, ...], "prompts": [...]?, "labels": [...]?}
  -> 200 {"rewards": [float], "scores": [float], "extra_logs": {"rm_query_truncated": [0.0 | 1.0]}}
GET /health -> 200 {"status": "ok"}
``query`` is the key OpenRLHF's client sends and its serve_rm reads (openrlhf/utils/remote_rm_utils.py
``remote_rm_fn``; openrlhf/cli/serve_rm.py ``data.get("query")``); ``queries`` (this library's older clients) is
accepted too.

Served by uvicorn (an ASGI server, as OpenRLHF's serve_rm; here a bare ASGI app, no web framework) with bounds a
shared training job needs (issue 27 item 6):
- a listen backlog of 2048 (the stdlib server's 5 reset 17-31% of 100 clients connecting at once);
- ``--request_timeout_s``: a request's headers, then its body, must arrive within it, and an idle keep-alive
  connection is closed after it: a client that trickles bytes is dropped (408), it does not hold a connection;
- ``--max_queries_per_request`` (413 beyond), ``--max_pending_queries`` queued over all requests (503 beyond,
  with Retry-After: the clients retry 5xx) and ``--max_connections`` (uvicorn's 503 beyond);
- scoring in micro-batches of ``--batch_size`` on one model thread, taken in turn: each request queues one
  micro-batch at a time, so a small request waits for about one micro-batch per active request, not for a
  large request to finish;
- ``--request_deadline_s``: a request not scored by then gets 504 and its remaining micro-batches are dropped;
  a client that disconnects has its remaining micro-batches dropped at once;
- ``--api_key`` (or RLHF_RM_API_KEY): requests to /get_reward without ``Authorization: Bearer <key>`` get 401;
  for a server bound beyond localhost in a multi-node job.  The trainer's client sends RLHF_RM_API_KEY.

Queries longer than ``--max_len`` tokens keep their last ``--max_len`` tokens (the response and the end of the
prompt; the score is read at the last token) and are flagged per row in ``extra_logs.rm_query_truncated`` (the
trainers log it as ``reward_rm_query_truncated``).  OpenRLHF's serve_rm truncates from the right (tokenizer
default), which cuts the response: every answer to one long prompt then gets the same reward.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import click
import h11
import torch
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_BODY = 64 * 2**20
API_KEY_ENV = "RLHF_RM_API_KEY"  # the same variable the trainer's client reads (rlhf/rewards/reward_func.py)


def encode_left_truncated(tok, queries: Sequence[str], max_len: int, pad_id: int
                          ) -> Tuple[torch.Tensor, torch.Tensor, List[bool]]:
    """Token ids (B, L) left-padded, attention mask (B, L), and which rows were cut: a query over ``max_len``
    tokens keeps its last ``max_len`` (the response end, where the score is read), never its first."""
    ids = tok(list(queries), add_special_tokens=False)["input_ids"]
    cut = [len(x) > max_len for x in ids]
    ids = [x[-max_len:] for x in ids]
    width = max(len(x) for x in ids)
    out = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        if x:
            out[i, width - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[i, width - len(x):] = 1
    return out, mask, cut


class RewardScorer:
    """The reward model; ``score_batch`` scores one micro-batch (called from one thread at a time)."""

    def __init__(self, path: str, batch_size: int = 16, max_len: int = 2048, value_head_prefix=None, log=None):
        from rlhf.models.load import load_reward_model, load_tokenizer
        from rlhf.rewards.reward_model import score_sequences

        self.model, self.stats = load_reward_model(path, value_head_prefix=value_head_prefix)
        self.tok = load_tokenizer(path, padding_side="left")
        self.batch_size, self.max_len = batch_size, max_len
        self._score = score_sequences
        self.lock = threading.Lock()
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.truncated_total = 0

    def score_batch(self, queries: Sequence[str]) -> Tuple[List[float], List[bool]]:
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        ids, mask, cut = encode_left_truncated(self.tok, queries, self.max_len, pad)
        with self.lock, torch.inference_mode():
            r = self._score(self.model, ids, mask, self.stats, self.batch_size)
        if any(cut):
            if not self.truncated_total:
                i = cut.index(True)
                self.log(f"[serve_rm] a query has more than --max_len {self.max_len} tokens: scored on its last "
                         f"{self.max_len} (the start of the prompt is cut; flagged per row in "
                         f"extra_logs.rm_query_truncated). Query: {queries[i][:200]!r}...")
            self.truncated_total += sum(cut)
        return r.tolist(), cut

    def __call__(self, queries: Sequence[str]) -> List[float]:
        out = []
        for s in range(0, len(queries), self.batch_size):
            out += self.score_batch(queries[s:s + self.batch_size])[0]
        return out


def validate_request(body: bytes):
    try:
        req = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"body is not JSON: {e}")
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
        try:
            req = validate_request(body)
        except ValueError as e:
            return await _respond(send, 400, {"error": str(e)})
        queries = req["queries"]
        cap = self.limits.max_queries_per_request
        if len(queries) > cap:
            return await _respond(send, 413, {
                "error": f"{len(queries)} queries in one request; this server takes at most {cap} "
                         f"(--max_queries_per_request): send smaller batches, or give the trainer several servers "
                         f"(--remote_rm_url URL1,URL2 splits each batch across them)"})
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
            r, c = await loop.run_in_executor(self.pool, self.scorer.score_batch, queries[s:s + bs])
            self.batches_scored += 1
            rewards += r
            cut += c
        return rewards, cut


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


class _DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers: a connection that has not sent a whole request
    head within ``timeout`` of connecting (or of its previous response) gets 408 and is closed.  uvicorn times out
    only idle keep-alive connections, so without this a client that connects and trickles a header byte now and
    then holds its connection forever."""

    header_timeout_s = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        if not self.transport.is_closing():
            self._header_task = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _cancel_header_deadline(self) -> None:
        task = getattr(self, "_header_task", None)
        if task is not None:
            task.cancel()
            self._header_task = None

    def _header_deadline_passed(self) -> None:
        self._header_task = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # a request is in (its body has its own deadline in the app)
        body = json.dumps({"error": f"request headers not received within {self.header_timeout_s:g}s "
                                    f"(--request_timeout_s)"}).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


class RewardServer:
    """uvicorn serving ``RewardApp`` on a socket bound at construction (port 0 picks a free one).
    ``serve_forever()`` blocks (run it in a thread in tests); ``shutdown()`` stops it from another thread."""

    def __init__(self, app: RewardApp, host: str = "127.0.0.1", port: int = 5000):
        limits = app.limits
        self.app = app
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(limits.backlog)
        self.server_address = self.sock.getsockname()[:2]
        protocol = type("RewardServerProtocol", (_DeadlineProtocol,), {"header_timeout_s": limits.request_timeout_s})
        config = uvicorn.Config(app, http=protocol, lifespan="off", log_level="warning", access_log=False,
                                backlog=limits.backlog, limit_concurrency=limits.max_connections,
                                timeout_keep_alive=max(1, int(limits.request_timeout_s)),
                                timeout_graceful_shutdown=5)  # Ctrl-C / TERM: in-flight requests get 5 s
        self.server = uvicorn.Server(config)
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self._stopped.set()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._stopped.wait(timeout_s)
        self.app.pool.shutdown(wait=False, cancel_futures=True)
        self.sock.close()


def make_server(scorer, host: str = "127.0.0.1", port: int = 5000, request_timeout_s: float = 30.0,
                limits: Optional[Limits] = None) -> RewardServer:
    limits = limits or Limits(request_timeout_s=request_timeout_s)
    return RewardServer(RewardApp(scorer, limits), host, port)


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@click.command()
@click.option("--reward_pretrain", required=True, help="HF reward model dir")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=5000, show_default=True)
@click.option("--batch_size", default=16, show_default=True, help="queries per forward (micro-batch)")
@click.option("--max_len", default=2048, show_default=True,
              help="tokens per query; longer ones keep their last max_len tokens")
@click.option("--request_timeout_s", default=30.0, show_default=True,
              help="a request's headers, then its body, must arrive within this; idle connections are closed "
                   "after it")
@click.option("--request_deadline_s", default=300.0, show_default=True,
              help="a request not scored within this gets 504 and its remaining work is dropped")
@click.option("--max_queries_per_request", default=4096, show_default=True, help="413 beyond")
@click.option("--max_pending_queries", default=65536, show_default=True,
              help="queries queued over all requests; 503 (retry) beyond")
@click.option("--max_connections", default=512, show_default=True, help="open connections; 503 beyond")
@click.option("--api_key", default=None, envvar=API_KEY_ENV, show_envvar=True,
              help="require 'Authorization: Bearer <key>' (the trainer sends $RLHF_RM_API_KEY)")
@click.option("--value_head_prefix", default=None, help="name of the reward head's weights (default: config.json's, "
                                                         "else score)")
def main(reward_pretrain, host, port, batch_size, max_len, request_timeout_s, request_deadline_s,
         max_queries_per_request, max_pending_queries, max_connections, api_key, value_head_prefix):
    from rlhf.models.load import ModelKindError, check_model_dir

    for name, v in (("--batch_size", batch_size), ("--max_len", max_len), ("--max_connections", max_connections),
                    ("--max_queries_per_request", max_queries_per_request),
                    ("--max_pending_queries", max_pending_queries)):
        if v < 1:
            raise click.UsageError(f"{name} must be >= 1, got {v}")
    if request_timeout_s <= 0 or request_deadline_s <= 0:
        raise click.UsageError("--request_timeout_s and --request_deadline_s must be > 0")
    try:
        check_model_dir(reward_pretrain, "reward", "reward_pretrain", need_tokenizer=True,
                        value_head_prefix=value_head_prefix)
    except ModelKindError as e:
        raise click.UsageError(str(e)) from None
    torch.set_grad_enabled(False)
    limits = Limits(request_timeout_s, request_deadline_s, max_queries_per_request, max_pending_queries,
                    max_connections, api_key=api_key or None)
    server = RewardServer(RewardApp(RewardScorer(reward_pretrain, batch_size, max_len, value_head_prefix), limits),
                          host, port)
    if not api_key and not _loopback(host):
        click.echo(f"[serve_rm] warning: listening on {host} without --api_key: anyone who reaches this port can "
                   f"use it; set --api_key (or ${API_KEY_ENV}) here and {API_KEY_ENV} for the trainer", err=True)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"reward server on http://{shown}:{server.server_address[1]}/get_reward"
               + (" (API key required)" if api_key else ""))
    sys.stdout.flush()
    os.environ.pop(API_KEY_ENV, None)  # not inherited by anything this process starts
    server.serve_forever()


if __name__ == "__main__":
    main()
