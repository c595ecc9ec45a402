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

Flags: OpenRLHF's serve_rm flags (openrlhf/cli/serve_rm.py), flat (0.9-0.10: ``--reward_pretrain``,
``--normalize_reward``, ``--value_head_prefix``, ``--max_len``, ``--param_dtype``, ``--bf16``, ``--flash_attn``,
``--attn_implementation``, ``--packing_samples``, ``--disable_fast_tokenizer``) and dotted (0.11:
``--reward.model_name_or_path``, ``--reward.normalize_enable``, ``--ds.value_head_prefix``, ``--data.max_len``,
``--ds.param_dtype``, ``--ds.attn_implementation``, ``--ds.experts_implementation``, ``--ds.packing_samples``,
``--data.disable_fast_tokenizer``), with OpenRLHF's meaning: the model on every visible GPU (device_map "auto")
in bf16 by default, flash attention where it exists; the raw score unless ``--normalize_reward`` (then
(score - mean) / std with the mean/std saved with the model).  Differences: ``--host`` defaults to 127.0.0.1
(OpenRLHF 0.0.0.0), ``--batch_size`` to 16 (OpenRLHF: the whole request in one forward), the CPU is served in fp32
with sdpa (``--device``, ``--param_dtype auto``); ``--load_in_4bit`` and ``--use_ms`` are refused.

Bounds on one request's work (issue 42 items 8, 9): a body nested too deep for the JSON parser is a 400; bodies over
256 KiB are parsed on a worker thread; each query is cut to its last ``--max_len * 8`` characters (more only where
that leaves too few tokens) before tokenizing; a request that cannot be scored within ``--request_deadline_s`` at
the fastest rate this server has measured (on a warm-up micro-batch at start, then on requests) is refused up front
with 413, naming how many queries would fit.

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

MAX_BODY = 64 * 2**20
API_KEY_ENV = "RLHF_RM_API_KEY"  # the same variable the trainer's client reads (rlhf/rewards/reward_func.py)


CHARS_PER_TOKEN_GUESS = 8   # the first character cap per query is max_len * this; doubled while too few tokens
CUT_MARGIN = 8              # tokens a character cut must leave beyond max_len (the cut may split a token or a word)


def tokenize_tails(tok, queries: Sequence[str], max_len: int) -> Tuple[List[List[int]], List[bool]]:
    """Each query's last ``max_len`` token ids, and whether it had more, without tokenizing more of a long query
    than needed (issue 42 item 9: a 10 MB query was tokenized whole before the cut, 24 s on the model thread).

    A query is first cut to its last ``max_len * CHARS_PER_TOKEN_GUESS`` characters; if that tail has more than
    ``max_len + CUT_MARGIN`` tokens its last ``max_len`` are the whole text's (a cut changes only the tokens of the
    word it splits, at the tail's start), else the cap doubles until it does or the query is whole."""
    ids: List[Optional[List[int]]] = [None] * len(queries)
    cut = [False] * len(queries)
    todo = list(range(len(queries)))
    cap = max_len * CHARS_PER_TOKEN_GUESS
    while todo:
        texts = [queries[i] if len(queries[i]) <= cap else queries[i][-cap:] for i in todo]
        got = tok(texts, add_special_tokens=False)["input_ids"]
        again = []
        for i, text, x in zip(todo, texts, got):
            whole = len(text) == len(queries[i])
            if whole or len(x) > max_len + CUT_MARGIN:
                ids[i], cut[i] = x[-max_len:], len(x) > max_len
            else:
                again.append(i)
        todo, cap = again, cap * 2
    return ids, cut


def encode_left_truncated(tok, queries: Sequence[str], max_len: int, pad_id: int
                          ) -> Tuple[torch.Tensor, torch.Tensor, List[bool]]:
    """Token ids (B, L) left-padded, attention mask (B, L), and which rows were cut: a query over ``max_len``
    tokens keeps its last ``max_len`` (the response end, where the score is read), never its first."""
    ids, cut = tokenize_tails(tok, queries, max_len)
    width = max(len(x) for x in ids)
    out = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        if x:
            out[i, width - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[i, width - len(x):] = 1
    return out, mask, cut


def reward_norm_stats(path: str) -> Optional[Tuple[float, float]]:
    """(mean, std) saved with a reward model: train_rm's reward_norm.json, else config.json's ``mean`` / ``std``
    (OpenRLHF's; its model reads them whenever present, openrlhf/models/model.py ``RewardModel.__init__``); None
    when neither is there."""
    from rlhf.models.load import RM_NORM_FILE

    f = os.path.join(path, RM_NORM_FILE)
    if os.path.isfile(f):
        with open(f) as fh:
            d = json.load(fh)
        return float(d["mean"]), float(d["std"])
    cfg_file = os.path.join(path, "config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as fh:
            cfg = json.load(fh)
        if "mean" in cfg and "std" in cfg:
            return float(cfg["mean"]), float(cfg["std"])
    return None


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Placement:
    """Where and how the reward model is served: ``device_map`` for ``from_pretrained`` ("auto": over every
    visible GPU, as OpenRLHF's serve_rm; {"": "cuda:N"}: one GPU; None: the CPU), ``dtype`` and
    ``attn_implementation``; ``notes`` are one-line notices of what was changed from the request."""
    device_map: Optional[object]
    dtype: torch.dtype
    attn_implementation: str
    notes: List[str]


def resolve_placement(device: str = "auto", param_dtype: str = "auto", attn_implementation: str = "auto",
                      cuda_available: Optional[bool] = None, flash_available: Optional[bool] = None) -> Placement:
    """OpenRLHF's serve_rm loads the model with ``device_map="auto"`` and ``param_dtype`` bf16 (default) on its
    GPUs, attention ``flash_attention_2`` (openrlhf/cli/serve_rm.py ``RewardModelProxy``; openrlhf/models/model.py
    ``get_llm_for_sequence_regression``).  Here: ``--device auto`` is that when CUDA is there, else the CPU;
    ``--param_dtype auto`` is bf16 on a GPU, fp32 on the CPU (bf16 matmuls are emulated, slowly, on most CPUs);
    a flash attention implementation without CUDA or the flash_attn package falls back to sdpa, with a notice."""
    notes: List[str] = []
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device.startswith("cuda") and not cuda_available:
        raise ValueError(f"--device {device}: no CUDA device is visible here (torch.cuda.is_available() is False); "
                         f"use --device cpu, or --device auto")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device {device!r}: give auto, cpu, cuda (every visible GPU, device_map='auto') or "
                         f"cuda:N (one GPU)")
    device_map = "auto" if device == "cuda" else (None if device == "cpu" else {"": device})
    if param_dtype == "auto":
        param_dtype = "fp32" if device == "cpu" else "bf16"
    if param_dtype not in DTYPES:
        raise ValueError(f"--param_dtype {param_dtype!r}: give bf16, fp16, fp32 or auto")
    attn = attn_implementation
    if attn == "auto":
        attn = "flash_attention_2" if device != "cpu" and _flash_importable(flash_available) else "sdpa"
    elif "flash" in attn and (device == "cpu" or not _flash_importable(flash_available)):
        why = "the model is on the CPU" if device == "cpu" else "the flash_attn package is not installed"
        notes.append(f"[serve_rm] --attn_implementation {attn}: {why}; using sdpa (the same scores up to rounding)")
        attn = "sdpa"
    return Placement(device_map, DTYPES[param_dtype], attn, notes)


def _flash_importable(known: Optional[bool]) -> bool:
    if known is not None:
        return known
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


class RewardScorer:
    """The reward model; ``score_batch`` scores one micro-batch (called from one thread at a time).

    ``normalize``: OpenRLHF's ``--normalize_reward`` / ``--reward.normalize_enable``: scores become
    (score - mean) / std with the mean and std saved with the model (``reward_norm_stats``); without it the raw
    score is served, as OpenRLHF serves it."""

    def __init__(self, path: str, batch_size: int = 16, max_len: int = 2048, value_head_prefix=None, log=None,
                 normalize: bool = False, placement: Optional[Placement] = None, **from_pretrained):
        from rlhf.models.load import load_reward_model, load_tokenizer
        from rlhf.rewards.reward_model import score_sequences

        placement = placement or resolve_placement("cpu")
        kwargs = {"dtype": placement.dtype, "attn_implementation": placement.attn_implementation, **from_pretrained}
        if placement.device_map is not None:
            kwargs["device_map"] = placement.device_map
        self.model, _ = load_reward_model(path, value_head_prefix=value_head_prefix, **kwargs)
        self.placement = placement
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        saved = reward_norm_stats(path)
        self.stats = saved if normalize and saved else (0.0, 1.0)
        if normalize and not saved:
            self.log(f"[serve_rm] --normalize_reward: {path} has no saved mean/std (reward_norm.json or config.json's "
                     f"mean, std); serving raw scores")
        elif saved and not normalize:
            self.log(f"[serve_rm] {path} has a saved mean {saved[0]:.4g} / std {saved[1]:.4g}; serving raw scores "
                     f"(OpenRLHF's default): add --normalize_reward to serve (score - mean) / std")
        self.tok = load_tokenizer(path, padding_side="left")
        self.batch_size, self.max_len = batch_size, max_len
        self._score = score_sequences
        self.lock = threading.Lock()
        self.truncated_total = 0
        self.last_padded = 0  # padded tokens of the last micro-batch scored (RewardApp's rate)

    @property
    def device(self) -> torch.device:
        """Where inputs go: the first parameter's device (the embeddings; with device_map="auto" accelerate's
        hooks move activations between the GPUs holding the layers)."""
        return next(self.model.parameters()).device

    def devices(self) -> List[str]:
        return sorted({str(p.device) for p in self.model.parameters()})

    def count_tokens(self, queries: Sequence[str]) -> List[int]:
        """Each query's token count after the cut to --max_len (the work it makes).  Called off the model thread,
        so on a tokenizer of its own (a fast tokenizer is one Rust object; two threads may not reconfigure it)."""
        if getattr(self, "_count_tok", None) is None:
            import copy

            self._count_tok = copy.deepcopy(self.tok)
        return [len(x) for x in tokenize_tails(self._count_tok, queries, self.max_len)[0]]

    def warm_up(self, rows: int, length: int) -> Tuple[int, float]:
        """Score one micro-batch of ``rows`` x ``length`` tokens (on a GPU twice: the first call's set-up cost is
        paid, and a model that does not fit fails now, not at the first request); returns (padded tokens,
        seconds of the timed call)."""
        ids = torch.full((rows, length), self.tok.eos_token_id or 0, dtype=torch.long)
        mask = torch.ones_like(ids)
        with self.lock, torch.inference_mode():
            if self.device.type != "cpu":
                self._score(self.model, ids, mask, self.stats, self.batch_size)
            t0 = time.monotonic()
            self._score(self.model, ids, mask, self.stats, self.batch_size)
            return ids.numel(), time.monotonic() - t0

    def score_batch(self, queries: Sequence[str]) -> Tuple[List[float], List[bool]]:
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        ids, mask, cut = encode_left_truncated(self.tok, queries, self.max_len, pad)
        with self.lock, torch.inference_mode():
            r = self._score(self.model, ids, mask, self.stats, self.batch_size)
        self.last_padded = ids.numel()
        if any(cut):
            if not self.truncated_total:
                i = cut.index(True)
                self.log(f"[serve_rm] a query has more than --max_len {self.max_len} tokens: scored on its last "
                         f"{self.max_len} (the start of the prompt is cut; flagged per row in "
                         f"extra_logs.rm_query_truncated). Query: {queries[i][:200]!r}...")
            self.truncated_total += sum(cut)
        return r.float().tolist(), cut

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


class _HeaderDeadline:
    """Mixed into uvicorn's h11 protocol (``RewardServer``): a deadline on request headers: a connection that has
    not sent a whole request head within ``timeout`` of connecting (or of its previous response) gets 408 and is
    closed.  uvicorn times out only idle keep-alive connections, so without this a client that connects and
    trickles a header byte now and then holds its connection forever.  (uvicorn is imported only when a server is
    built: the scorer and the app import without it, as on a GPU image that lacks it.)"""

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


class PortUnavailable(OSError):
    """The server's --host / --port cannot be bound: in use (EADDRINUSE) or not allowed / not an address here."""

    def __init__(self, host: str, port: int, err: OSError):
        import errno

        if err.errno == errno.EADDRINUSE:
            why = (f"--port {port} on {host} is in use (another serve_rm, or another program: see `ss -ltnp "
                   f"'sport = :{port}'`); stop it, or pick a free --port (--port 0 picks one and prints it)")
        elif err.errno == errno.EACCES:
            why = f"--port {port} needs privileges on {host}; use a --port of 1024 or above"
        else:
            why = (f"cannot listen on --host {host} --port {port}: {err.strerror or err}; give an address of this "
                   f"machine (127.0.0.1, 0.0.0.0) and a free --port")
        super().__init__(err.errno, why)
        self.message = why

    def __str__(self) -> str:
        return self.message


class RewardServer:
    """uvicorn serving ``RewardApp`` on a socket bound at construction (port 0 picks a free one).
    ``serve_forever()`` blocks (run it in a thread in tests); ``shutdown()`` stops it from another thread."""

    def __init__(self, app: RewardApp, host: str = "127.0.0.1", port: int = 5000):
        try:
            import uvicorn
            from uvicorn.protocols.http.h11_impl import H11Protocol
        except ImportError as e:
            raise ImportError(f"rlhf.serve_rm needs uvicorn to serve ({e}): pip install 'uvicorn>=0.30'") from None
        limits = app.limits
        self.app = app
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise PortUnavailable(host, port, e) from None
        self.sock.listen(limits.backlog)
        self.server_address = self.sock.getsockname()[:2]
        protocol = type("RewardServerProtocol", (_HeaderDeadline, H11Protocol),
                        {"header_timeout_s": limits.request_timeout_s})
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


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class Refused(click.ClickException):
    """A start-up refusal: one line ``Error: <what and the fix>``, exit status 2 (click's usage errors' status,
    without their usage lines)."""
    exit_code = 2


def _alias(flat: str, dotted: Optional[str], *more: str):
    """OpenRLHF's flat (0.10) and dotted (0.11, openrlhf/utils/config.py ``hierarchize``) spellings of one flag."""
    return tuple(x for x in (flat, dotted, *more) if x)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(*_alias("--reward_pretrain", "--reward.model_name_or_path"), "reward_pretrain", default=None,
              help="reward model dir (a *ForSequenceClassification save, this library's or OpenRLHF's)")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (OpenRLHF: 0.0.0.0; here localhost unless asked, see --api_key)")
@click.option("--port", default=5000, show_default=True, help="0 picks a free port and prints it")
@click.option("--batch_size", default=16, show_default=True,
              help="queries per forward (micro-batch); OpenRLHF's default (none) is a whole request at once")
@click.option(*_alias("--max_len", "--data.max_len"), "max_len", default=2048, show_default=True,
              help="tokens per query; longer ones keep their last max_len tokens")
@click.option(*_alias("--normalize_reward", "--reward.normalize_enable"), "normalize_reward", is_flag=True,
              help="serve (score - mean) / std with the mean/std saved with the model (OpenRLHF's meaning); "
                   "without it the raw score")
@click.option(*_alias("--value_head_prefix", "--ds.value_head_prefix"), "value_head_prefix", default=None,
              help="name of the reward head's weights (default: config.json's, else score)")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA when there is one, else cpu), cuda (every visible GPU, device_map='auto' as "
                   "OpenRLHF), cuda:N (one GPU) or cpu")
@click.option(*_alias("--param_dtype", "--ds.param_dtype"), "param_dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "bf16", "fp16", "fp32"]),
              help="weights' dtype; auto: bf16 on a GPU (OpenRLHF's default), fp32 on the CPU")
@click.option("--bf16", is_flag=True, help="= --param_dtype bf16 (OpenRLHF <= 0.9)")
@click.option(*_alias("--attn_implementation", "--ds.attn_implementation"), "attn_implementation", default="auto",
              show_default=True, help="auto: flash_attention_2 on a GPU with flash_attn installed, else sdpa; a "
                                      "flash implementation without them falls back to sdpa with a notice")
@click.option("--flash_attn", is_flag=True, help="= --attn_implementation flash_attention_2 (OpenRLHF <= 0.8)")
@click.option(*_alias("--experts_implementation", "--ds.experts_implementation"), "experts_implementation",
              default=None, type=click.Choice(["eager", "batched_mm", "grouped_mm", "deepgemm"]),
              help="MoE expert kernels, passed to from_pretrained (OpenRLHF's)")
@click.option(*_alias("--packing_samples", "--ds.packing_samples"), "packing_samples", is_flag=True,
              help="accepted (OpenRLHF's): scores are the same padded or packed; this server pads")
@click.option(*_alias("--disable_fast_tokenizer", "--data.disable_fast_tokenizer"), "disable_fast_tokenizer",
              is_flag=True, help="accepted (OpenRLHF's); the fast tokenizer is used (the same token ids)")
@click.option(*_alias("--load_in_4bit", "--ds.load_in_4bit"), "load_in_4bit", is_flag=True,
              help="refused: 4-bit loading (bitsandbytes) is not supported here")
@click.option("--use_ms", is_flag=True, help="refused: ModelScope's hub is not supported; give a local dir")
@click.option("--request_timeout_s", default=30.0, show_default=True,
              help="a request's headers, then its body, must arrive within this; idle connections are closed "
                   "after it")
@click.option("--request_deadline_s", default=300.0, show_default=True,
              help="a request not scored within this gets 504 and its remaining work is dropped; one that cannot "
                   "be scored within it at the measured rate gets 413 up front")
@click.option("--max_queries_per_request", default=4096, show_default=True, help="413 beyond")
@click.option("--max_pending_queries", default=65536, show_default=True,
              help="queries queued over all requests; 503 (retry) beyond")
@click.option("--max_connections", default=512, show_default=True, help="open connections; 503 beyond")
@click.option("--api_key", default=None, envvar=API_KEY_ENV, show_envvar=True,
              help="require 'Authorization: Bearer <key>' (the trainer sends $RLHF_RM_API_KEY)")
@click.option("--warmup/--no_warmup", default=True, show_default=True,
              help="score one micro-batch of --batch_size rows at start (512 tokens on a GPU, 128 on the CPU): a "
                   "model that does not fit fails now, and the rate the 413 check uses is known from the first "
                   "request")
def main(reward_pretrain, host, port, batch_size, max_len, normalize_reward, value_head_prefix, device, param_dtype,
         bf16, attn_implementation, flash_attn, experts_implementation, packing_samples, disable_fast_tokenizer,
         load_in_4bit, use_ms, request_timeout_s, request_deadline_s, max_queries_per_request, max_pending_queries,
         max_connections, api_key, warmup):
    """python -m rlhf.serve_rm --reward_pretrain DIR: serve a reward model over HTTP (OpenRLHF's serve_rm flags,
    flat and dotted, with OpenRLHF's meaning; see the module docstring)."""
    from rlhf.models.load import ModelKindError, check_model_dir

    if not reward_pretrain:
        raise click.UsageError("give the reward model: --reward_pretrain DIR (or --reward.model_name_or_path DIR)")
    if load_in_4bit:
        raise click.UsageError("--load_in_4bit: 4-bit loading (bitsandbytes) is not supported by rlhf.serve_rm; drop "
                               "it (--param_dtype bf16, the default on a GPU, halves fp32's memory)")
    if use_ms:
        raise click.UsageError("--use_ms: ModelScope's hub is not supported; download the model and give its local "
                               "dir as --reward_pretrain")
    if bf16:
        if param_dtype not in ("auto", "bf16"):
            raise click.UsageError(f"--bf16 and --param_dtype {param_dtype} disagree; give one of them")
        param_dtype = "bf16"
    if flash_attn:
        if attn_implementation not in ("auto", "flash_attention_2"):
            raise click.UsageError(f"--flash_attn and --attn_implementation {attn_implementation} disagree; give one")
        attn_implementation = "flash_attention_2"
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
        placement = resolve_placement(device, param_dtype, attn_implementation)
    except (ModelKindError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    limits = Limits(request_timeout_s, request_deadline_s, max_queries_per_request, max_pending_queries,
                    max_connections, api_key=api_key or None)
    try:  # bind first: a port in use is said in one line before minutes of model loading
        server = RewardServer(RewardApp(None, limits), host, port)
    except (PortUnavailable, ImportError) as e:
        raise Refused(str(e)) from None
    for note in placement.notes:
        click.echo(note, err=True)
    torch.set_grad_enabled(False)
    extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
    scorer = RewardScorer(reward_pretrain, batch_size, max_len, value_head_prefix, normalize=normalize_reward,
                          placement=placement, **extra)
    server.app.scorer = scorer
    if warmup:  # shorter rows on the CPU: the cost per token grows with length, so the rate errs fast (no false 413)
        server.app.record_rate(*scorer.warm_up(batch_size, min(max_len, 512 if scorer.device.type != "cpu" else 128)))
    if not api_key and not _loopback(host):
        click.echo(f"[serve_rm] warning: listening on {host} without --api_key: anyone who reaches this port can "
                   f"use it; set --api_key (or ${API_KEY_ENV}) here and {API_KEY_ENV} for the trainer", err=True)
    shown = f"[{host}]" if ":" in host else host
    dtype = str(placement.dtype).replace("torch.", "")
    click.echo(f"reward server on http://{shown}:{server.server_address[1]}/get_reward"
               + (" (API key required)" if api_key else "")
               + f" [{','.join(scorer.devices())}, {dtype}, "
                 f"{placement.attn_implementation}, max_len {max_len}, batch {batch_size}"
               + (", normalized" if scorer.stats != (0.0, 1.0) else "") + "]")
    sys.stdout.flush()
    os.environ.pop(API_KEY_ENV, None)  # not inherited by anything this process starts
    server.serve_forever()


if __name__ == "__main__":
    main()
