"""The in-job OpenAI-compatible endpoint: a FastAPI app served by uvicorn on a thread of its own, one per process
(the engine's first rank; the engines this process drives attach to it).

Routes (OpenAI's and vLLM's server's: vllm/entrypoints/openai/api_server.py): ``POST /v1/chat/completions``,
``POST /v1/completions`` (``stream=True``: server-sent events once the completion is done), ``GET /v1/models``,
``POST /tokenize``, ``GET /health``, and ``GET /metrics`` (the endpoint's counters as JSON).  A call joins a session
by OpenRLHF's ``session_id`` body field or the ``X-Session-Id`` header; errors are OpenAI's error body with a 4xx /
5xx status (the ``openai`` client raises its NotFoundError, ConflictError, BadRequestError ... from them).
OpenRLHF's examples/python/agent_func_openai_server_executor.py starts its server the same way (``uvicorn.run`` on
a daemon thread)."""

import json
import socket
import sys
import threading
import time
from typing import Optional

from rlhf.agents.endpoint import protocol as wire
from rlhf.agents.endpoint.hub import Hub, Settings
from rlhf.agents.endpoint.sessions import EndpointError


def build_app(hub: Hub):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="rlhf agent endpoint")

    def failed(e: EndpointError) -> JSONResponse:
        hub.table.count(error=e.status)
        return JSONResponse(wire.error_body(e), status_code=e.status)

    @app.exception_handler(EndpointError)
    async def _endpoint_error(request, e: EndpointError):
        return failed(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e):
        return failed(wire.bad(f"invalid request: {e.errors()}"))

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except Exception:
            raise wire.bad("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise wire.bad("the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": hub.model_name, "engines": sorted(hub.slots)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": hub.model_name, "object": "model", "created": 0,
                                            "owned_by": "rlhf", "max_model_len": hub.settings.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return hub.table.metrics.snapshot()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's /tokenize: ``messages`` (rendered with the chat template; add_generation_prompt default True) or
        ``prompt`` (add_special_tokens default True) -> {tokens, count, max_model_len}."""
        body = await body_of(request)
        if "messages" in body:
            msgs = wire.messages_of(body)
            try:
                text = hub.tokenizer.apply_chat_template(msgs, tokenize=False, tools=body.get("tools"),
                                                         add_generation_prompt=body.get("add_generation_prompt", True))
            except Exception as e:
                raise wire.bad(f"the chat template could not render these messages: {e}", "messages") from e
            ids = hub.encode(text)
        elif isinstance(body.get("prompt"), str):
            ids = hub.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        else:
            raise wire.bad("/tokenize takes 'messages' (a chat) or 'prompt' (a string)", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": hub.settings.max_model_len}

    def answer(full: dict, body: dict):
        """The body, or with ``stream=True`` OpenAI's server-sent events of it (``wire.stream_chunks``)."""
        if not body.get("stream"):
            return full
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = [f"data: {json.dumps(c)}\n\n" for c in wire.stream_chunks(full, usage)] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        return answer(await hub.chat(body, wire.session_id(body, request.headers)), body)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        return answer(await hub.complete(body, wire.session_id(body, request.headers)), body)

    return app


class Server:
    """uvicorn on a daemon thread, its socket bound before the thread starts (port 0: the system's free port, no
    race with another process picking the same one)."""

    def __init__(self, app, host: str, port: int):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise RuntimeError(f"the agent endpoint cannot bind {host}:{port} ({e}); pass --agent_endpoint_port 0 "
                               f"(a free port) or another port") from None
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="rlhf-agent-endpoint")

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0):
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.host}:{self.port} within {timeout_s}s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


_LOCK = threading.Lock()
_RUNNING: Optional[tuple] = None  # (Hub, Server) of this process


def endpoint(tokenizer, settings: Settings, model_name: Optional[str] = None):
    """This process's (Hub, Server), started on first use (the first episode that needs it)."""
    global _RUNNING
    with _LOCK:
        if _RUNNING is None:
            hub = Hub(tokenizer, model_name or getattr(tokenizer, "name_or_path", None) or "policy", settings)
            server = Server(build_app(hub), settings.host, settings.port).start()
            print(f"[endpoint] OpenAI-compatible endpoint at {server.url}/v1 (model {hub.model_name!r}; sessions "
                  f"by session_id or the {wire.SESSION_HEADER} header)", file=sys.stderr, flush=True)
            _RUNNING = (hub, server)
        return _RUNNING


def take_metrics() -> dict:
    """This process's endpoint metrics since the last call (``endpoint/*``); {} if no endpoint has started."""
    with _LOCK:
        running = _RUNNING
    return running[0].table.take() if running is not None else {}


def shutdown() -> None:
    """Stop this process's endpoint (tests; the job's ends with the process)."""
    global _RUNNING
    with _LOCK:
        if _RUNNING is not None:
            _RUNNING[1].stop()
            _RUNNING = None
