"""Tools from a Python file (``--tools_path``) and running one tool call: a timeout, an output cap, errors as text.

The file: its ``TOOLS`` list of functions, or else every public function defined in it (not imported), sync or
``async def``.  Each tool's OpenAI function schema comes from its signature and Google-style docstring through
transformers' ``get_json_schema`` (transformers/utils/chat_template_utils.py), as TRL's GRPOTrainer(tools=[...])
builds them (trl/trainer/grpo_trainer.py); a tool without a description of every argument is refused at load,
naming it.  A file may also give ``TOOL_SCHEMAS``, a list of OpenAI schemas, to use instead of the derived ones
(one per tool, by name).

A tool may also give a reward with its output, as veRL's ``BaseTool.execute`` returns ``(response, step_reward,
metrics)`` (verl/tools/base_tool.py): it returns ``{"content": ..., "reward": float}`` (exactly those two keys);
the model sees ``content`` and the call's ``reward`` is kept (``ToolResult.reward``).  The tool executor adds an
episode's tool rewards to its reward (rlhf.agents.tool_agent).  A reward that is not a finite number makes the
call an ``error``.

A call (``run_call``) never raises: what the model gets back is always a tool message, and ``status`` says how it
went (``ok``, ``error``: the tool raised, ``timeout``: cut at --tool_timeout_s, ``unknown``: no such tool,
``bad_args``: arguments that are not a JSON object or do not fit the signature).  Sync tools run in a daemon
thread (a hung one is left behind and cannot stall the episode loop or the process exit); async tools are awaited
under ``asyncio.wait_for`` (cancelled at the timeout; an ``async def`` that blocks without awaiting cannot be cut).
"""
from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set

from rlhf.errors import ConfigError

STATUSES = ("ok", "error", "timeout", "unknown", "bad_args")


@dataclass
class ToolSet:
    functions: Dict[str, Callable]
    schemas: List[dict]  # OpenAI function schemas, in the file's order
    path: str = ""


@dataclass
class ToolResult:
    content: str  # the tool message's text (capped)
    status: str   # one of STATUSES
    seconds: float
    reward: float = 0.0  # the tool's own reward for this call ({"content": ..., "reward": r}); 0 without one


def _tool_functions(mod) -> List[Callable]:
    if "TOOLS" in vars(mod):
        return list(vars(mod)["TOOLS"])
    return [f for n, f in vars(mod).items() if not n.startswith("_") and inspect.isfunction(f)
            and f.__module__ == mod.__name__]


def schema_of(fn: Callable, path: str) -> dict:
    """The OpenAI function schema of ``fn`` from its type hints and docstring (transformers' get_json_schema)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:
        raise ConfigError("tools_path", f"--tools_path {path}: tool {fn.__name__!r} has no schema "
                                        f"({type(e).__name__}: {e}); give it type hints and a Google-style docstring "
                                        f"that describes it and every argument (a summary line, then 'Args:' and "
                                        f"one 'name: what it is' line per argument), or list its schema in "
                                        f"TOOL_SCHEMAS") from e


def load_tools(path: str) -> ToolSet:
    """The tools of a --tools_path file, checked (ConfigError naming the flag and the fix)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ConfigError("tools_path", f"--tools_path {path}: no such file; give a .py file defining the tools "
                                        f"as functions")
    spec = importlib.util.spec_from_file_location("rlhf_user_tools", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise ConfigError("tools_path", f"--tools_path {path} cannot load: {type(e).__name__}: {e}") from e
    fns = _tool_functions(mod)
    bad = [f for f in fns if not callable(f)]
    if bad or not fns:
        why = f"TOOLS holds {bad[0]!r}, not a function" if bad else "no tools (define functions, or a TOOLS list)"
        raise ConfigError("tools_path", f"--tools_path {path}: {why}")
    given = {s["function"]["name"]: s for s in vars(mod).get("TOOL_SCHEMAS", [])}
    schemas = [given.get(f.__name__) or schema_of(f, path) for f in fns]
    return ToolSet({f.__name__: f for f in fns}, schemas, path)


def cap(text: str, max_chars: int) -> str:
    """At most ``max_chars`` characters of ``text``, then a note of how many were cut."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [{len(text) - max_chars} more characters cut]"


def as_text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def with_reward(value):
    """(content, reward) of a tool's return value: ``{"content": c, "reward": r}`` gives (c, float(r)) (ValueError
    when r is not a finite number); anything else is the content, reward 0."""
    if not (isinstance(value, dict) and set(value) == {"content", "reward"}):
        return value, 0.0
    r = value["reward"]
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        raise ValueError(f"its reward must be a finite number, got {r!r} (return {{'content': ..., 'reward': 1.0}})")
    return value["content"], float(r)


def _in_thread(fn: Callable, kwargs: dict) -> asyncio.Future:
    """``fn(**kwargs)`` in a daemon thread, its result in an asyncio future (a thread that never ends is left)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value):
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def work():
        try:
            value, ok = fn(**kwargs), True
        except BaseException as e:  # the tool's error goes back to the model as text (sys.exit in a tool too)
            value, ok = (e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__}: {e}")), False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the event loop is gone (the episode ended long ago)
            pass

    threading.Thread(target=work, name="rlhf-tool", daemon=True).start()
    return fut


def _arguments(fn: Callable, arguments: str):
    """The call's keyword arguments, or an error text (bad JSON, not an object, not the signature's)."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as e:
        return None, f"arguments are not valid JSON ({e})"
    if not isinstance(args, dict):
        return None, f"arguments must be a JSON object, got {type(args).__name__}"
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        return None, str(e)
    return args, None


async def run_call(tools: ToolSet, name: str, arguments: str, timeout_s: float, max_chars: int,
                   offered: Optional[Set[str]] = None) -> ToolResult:
    """One tool call's message text and status (never raises); ``offered``: the names the prompt offered (a call
    to another is ``unknown``; None: every tool of the file)."""
    t0 = time.perf_counter()

    def done(text: str, status: str, reward: float = 0.0) -> ToolResult:
        return ToolResult(cap(text, max_chars), status, time.perf_counter() - t0, reward)

    names = [n for n in tools.functions if offered is None or n in offered]
    fn = tools.functions.get(name) if name in names else None
    if fn is None:
        return done(f"Error: unknown tool {name!r}; the tools are {', '.join(names)}", "unknown")
    args, why = _arguments(fn, arguments)
    if why is not None:
        return done(f"Error: bad arguments for tool {name!r}: {why}", "bad_args")
    try:
        job = fn(**args) if inspect.iscoroutinefunction(fn) else _in_thread(fn, args)
        value, reward = with_reward(await asyncio.wait_for(job, timeout_s))
    except asyncio.TimeoutError:
        return done(f"Error: tool {name!r} timed out after {timeout_s:g} s", "timeout")
    except Exception as e:
        return done(f"Error: tool {name!r} raised {type(e).__name__}: {e}", "error")
    return done(as_text(value), "ok", reward)
