"""OpenAI's wire format for the in-job endpoint: reading a request's fields (with a 400 naming the field where one
is wrong) and writing the ``chat.completion`` / ``text_completion`` bodies.  Pure functions: no engine, no session.

Field names follow OpenAI's API and vLLM's server (vllm/entrypoints/openai/protocol.py: ``max_tokens`` /
``max_completion_tokens``, ``logprobs`` / ``top_logprobs``, the extras ``top_k``, ``stop_token_ids``,
``session_id``); each choice also carries ``token_ids`` and the body ``prompt_token_ids`` (vLLM's
``return_token_ids`` fields; OpenRLHF's openai-server executor returns them under ``token_ids``)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Dict, List, Optional

from rlhf.agents.endpoint.sessions import EndpointError

SESSION_HEADER = "X-Session-Id"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k")


def bad(message: str, param: Optional[str] = None, code: str = "invalid_request") -> EndpointError:
    e = EndpointError(400, message, code)
    e.param = param
    return e


def session_id(body: Dict[str, Any], headers) -> Optional[str]:
    """The call's session: OpenRLHF's ``session_id`` body field (extra_body) or the ``X-Session-Id`` header."""
    a, b = body.get("session_id"), headers.get(SESSION_HEADER)
    if a is not None and not isinstance(a, str):
        raise bad(f"session_id must be a string, got {type(a).__name__}", "session_id")
    if a and b and a != b:
        raise bad(f"session_id {a!r} in the body and {SESSION_HEADER} {b!r} differ: send one", "session_id")
    return a or b or None


def _text_of(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # OpenAI's content parts: text only here
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise bad(f"messages[{i}].content: only text parts are served here (got a {kind!r} part)",
                          f"messages[{i}].content")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}",
              f"messages[{i}].content")


def messages_of(body: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The chat messages, content parts joined to text (the chat template gets strings)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {'role', 'content'} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
        out.append({**m, "content": _text_of(m.get("content"), i)})
    return out


def render_chat(tokenizer, messages, tools=None) -> str:
    """The prompt text: the tokenizer's chat template with the generation prompt (tools passed to the template)."""
    kw = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    except Exception as e:  # a template that refuses these messages (roles out of order, no template...)
        raise bad(f"the chat template could not render these messages: {type(e).__name__}: {e}", "messages") from e


def _number(body, name: str, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    if not lo <= v <= hi:
        raise bad(f"{name} must lie in [{lo}, {hi}], got {v}", name)
    return v


def requested(body: Dict[str, Any]) -> Dict[str, Any]:
    """The sampling fields the caller set (absent ones left out); refuses what the endpoint does not serve."""
    if body.get("n", 1) != 1:
        raise bad(f"n must be 1 (one completion per call; a session is one conversation), got {body.get('n')!r}", "n")
    if body.get("stop"):
        raise bad("'stop' strings are not served here (the engines stop on token ids): pass stop_token_ids "
                  "(extra_body) or leave stop out", "stop")
    out = {"max_tokens": _number(body, "max_completion_tokens", 1, 1 << 31, True)
           or _number(body, "max_tokens", 1, 1 << 31, True),
           "temperature": _number(body, "temperature", 0.0, 100.0), "top_p": _number(body, "top_p", 0.0, 1.0),
           "top_k": _number(body, "top_k", -1, 1 << 31, True), "seed": _number(body, "seed", -(1 << 63), 1 << 63, True)}
    if isinstance(body.get("skip_special_tokens"), bool):
        out["skip_special_tokens"] = body["skip_special_tokens"]
    stops = body.get("stop_token_ids")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
            raise bad("stop_token_ids must be a list of token ids", "stop_token_ids")
        out["stop_token_ids"] = tuple(stops)
    return {k: v for k, v in out.items() if v is not None}


def _logprob_entries(tokenizer, ids: List[int], lps: List[float]) -> List[Dict[str, Any]]:
    out = []
    for t, lp in zip(ids, lps):
        tok = tokenizer.decode([t])
        out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "token_id": t,
                    "top_logprobs": [{"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                                      "token_id": t}]})
    return out


def _usage(prompt: List[int], ids: List[int]) -> Dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}


def chat_body(model: str, prompt: List[int], ids: List[int], lps: List[float], content: Optional[str],
              calls: Optional[list], finish: str, tokenizer, body: Dict[str, Any],
              session: Optional[str]) -> Dict[str, Any]:
    """OpenAI's chat.completion; ``calls``: the turn's tool calls (rlhf.agents.endpoint.tool_turns) or None."""
    msg: Dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"], finish = calls, "tool_calls"
    logprobs = {"content": _logprob_entries(tokenizer, ids, lps)} if body.get("logprobs") else None
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "session_id": session, "prompt_token_ids": prompt,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": logprobs,
                         "token_ids": ids}],
            "usage": _usage(prompt, ids)}


def completion_body(model: str, prompt: List[int], ids: List[int], lps: List[float], text: str, finish: str,
                    tokenizer, body: Dict[str, Any], session: Optional[str]) -> Dict[str, Any]:
    logprobs = None
    if body.get("logprobs") is not None:
        toks = [tokenizer.decode([t]) for t in ids]
        offsets, at = [], 0
        for tok in toks:
            offsets.append(at)
            at += len(tok)
        logprobs = {"tokens": toks, "token_logprobs": lps, "text_offset": offsets,
                    "top_logprobs": [{tok: lp} for tok, lp in zip(toks, lps)]}
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": model, "session_id": session, "prompt_token_ids": prompt,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs, "token_ids": ids}],
            "usage": _usage(prompt, ids)}


def stream_chunks(full: Dict[str, Any], usage: bool) -> List[Dict[str, Any]]:
    """A finished ``chat.completion`` / ``text_completion`` as the chunks of OpenAI's stream (``stream=True``): the
    whole text in one chunk (generation is not streamed token by token), then the finish reason (and ``usage``
    when ``stream_options.include_usage``); the token-id fields ride on the first chunk."""
    chat = full["object"] == "chat.completion"
    c = full["choices"][0]
    head = {k: full[k] for k in ("id", "created", "model", "session_id", "prompt_token_ids")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        delta = {"role": "assistant", "content": c["message"]["content"]}
        if c["message"].get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **t} for i, t in enumerate(c["message"]["tool_calls"])]
        first = {"index": 0, "delta": delta, "logprobs": c["logprobs"], "finish_reason": None, "token_ids": c["token_ids"]}
        last = {"index": 0, "delta": {}, "finish_reason": c["finish_reason"]}
    else:
        first = {"index": 0, "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None, "token_ids": c["token_ids"]}
        last = {"index": 0, "text": "", "finish_reason": c["finish_reason"]}
    out = [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if usage:
        out.append({**head, "choices": [], "usage": full["usage"]})
    return out


def error_body(e: EndpointError) -> Dict[str, Any]:
    return {"error": {"message": e.message, "type": e.type, "code": e.code, "param": getattr(e, "param", None)}}
