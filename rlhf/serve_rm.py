"""HTTP reward server:  python -m rlhf.serve_rm --reward_pretrain DIR [--port 5000]

POST /get_reward  {"query": [str, ...], "prompts": [...]?, "labels": [...]?}
  -> 200 {"rewards": [float], "scores": [float], "extra_logs": {}}
``query`` is the key OpenRLHF's client sends and its serve_rm reads (openrlhf/utils/remote_rm_utils.py
``remote_rm_fn``; openrlhf/cli/serve_rm.py ``data.get("query")``); ``queries`` (this library's older clients) is
accepted too.
Malformed requests get 400 with a message; scoring is batched (--batch_size).
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import click
import torch

MAX_BODY = 64 * 2**20


class RewardScorer:
    def __init__(self, path: str, batch_size: int = 16, max_len: int = 2048, value_head_prefix=None):
        from rlhf.models.load import load_reward_model, load_tokenizer
        from rlhf.rewards.reward_model import score_sequences

        self.model, self.stats = load_reward_model(path, value_head_prefix=value_head_prefix)
        self.tok = load_tokenizer(path, padding_side="left")
        self.batch_size, self.max_len = batch_size, max_len
        self._score = score_sequences
        self.lock = threading.Lock()

    def __call__(self, queries):
        enc = self.tok(queries, return_tensors="pt", padding=True, truncation=True, max_length=self.max_len,
                       add_special_tokens=False)
        with self.lock:
            r = self._score(self.model, enc["input_ids"], enc["attention_mask"], self.stats, self.batch_size)
        return r.tolist()


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


def make_server(scorer, host: str = "127.0.0.1", port: int = 5000, request_timeout_s: float = 30.0) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        timeout = request_timeout_s  # socket timeout: a client that stops sending is dropped, not waited on forever

        def _send(self, code: int, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {"status": "ok"})
            self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            if self.path not in ("/get_reward", "/"):
                return self._send(404, {"error": f"no route {self.path}; POST /get_reward"})
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return self._send(400, {"error": f"Content-Length {self.headers.get('Content-Length')!r} is not a number"})
            if n <= 0 or n > MAX_BODY:
                return self._send(400 if n <= 0 else 413, {"error": "missing or oversized body"})
            try:
                body = self.rfile.read(n)
            except (TimeoutError, OSError):
                self.close_connection = True
                return self._send(408, {"error": f"request body not received within {request_timeout_s:g}s"})
            if len(body) < n:
                self.close_connection = True
                return self._send(400, {"error": f"body has {len(body)} of the {n} bytes Content-Length announced"})
            try:
                req = validate_request(body)
            except ValueError as e:
                return self._send(400, {"error": str(e)})
            try:
                rewards = scorer(req["queries"])
            except Exception as e:  # scoring failure is the server's fault
                return self._send(500, {"error": f"{type(e).__name__}: {e}"})
            self._send(200, {"rewards": rewards, "scores": rewards, "extra_logs": {}})

        def log_message(self, *args):
            return None

    return ThreadingHTTPServer((host, port), Handler)


@click.command()
@click.option("--reward_pretrain", required=True, help="HF reward model dir")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=5000, show_default=True)
@click.option("--batch_size", default=16, show_default=True)
@click.option("--max_len", default=2048, show_default=True)
@click.option("--request_timeout_s", default=30.0, show_default=True,
              help="drop a connection that sends nothing for this long (half-sent requests)")
@click.option("--value_head_prefix", default=None, help="name of the reward head's weights (default: config.json's, "
                                                         "else score)")
def main(reward_pretrain, host, port, batch_size, max_len, request_timeout_s, value_head_prefix):
    from rlhf.models.load import ModelKindError, check_model_dir

    try:
        check_model_dir(reward_pretrain, "reward", "reward_pretrain", need_tokenizer=True,
                        value_head_prefix=value_head_prefix)
    except ModelKindError as e:
        raise click.UsageError(str(e)) from None
    torch.set_grad_enabled(False)
    server = make_server(RewardScorer(reward_pretrain, batch_size, max_len, value_head_prefix), host, port,
                         request_timeout_s)
    click.echo(f"reward server on http://{host}:{server.server_address[1]}/get_reward")
    server.serve_forever()


if __name__ == "__main__":
    main()
