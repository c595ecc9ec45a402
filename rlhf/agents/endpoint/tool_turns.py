"""Tool calls through the endpoint: the model's turn read into OpenAI ``tool_calls`` (the parser is
rlhf/agents/tool_parsers.py's ``make_parser``: vLLM's where installed, else its own hermes; ``--tool_call_parser``),
and the caller's assistant messages that carry those calls rendered back from what the model produced.

Why the second part: a harness sends the assistant's tool call back as ``{"role": "assistant", "tool_calls":
[...]}``, and the chat template renders that from the parsed JSON (``{"name": "add", "arguments": {...}}``), not
from the model's own text (its spacing, key order, the text around the call): the re-rendered conversation would
no longer start with the session's recorded tokens (a prefix break).  So the ids this endpoint gives its tool calls
(``call_<turn>_<i>_<session>``) name the session's turn, and an assistant message carrying them is rendered as that
turn's text, exactly as the model wrote it (what the template's assistant content then renders around it is what
the session's stitching rules check).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Optional, Tuple

from rlhf.agents.endpoint.sessions import Session


def call_id(sid: str, turn: int, i: int) -> str:
    return f"call_{turn}_{i}_{sid}"


def turn_of(cid: str, sid: str) -> Optional[int]:
    """The session turn a tool-call id of ours names; None for another id."""
    head, _, rest = cid.partition("_")
    parts = rest.split("_", 2)
    if head != "call" or len(parts) != 3 or parts[2] != sid or not parts[0].isdigit():
        return None
    return int(parts[0])


def own_tool_turns(messages: List[Dict[str, Any]], s: Optional[Session]) -> List[Dict[str, Any]]:
    """``messages`` with each assistant message whose tool calls are this session's replaced by the text of that
    turn, as the parser read it (no ``tool_calls`` field: the template renders the content as it is)."""
    if s is None:
        return messages
    out = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        turns = {turn_of(c.get("id", ""), s.id) for c in calls if isinstance(c, dict)} if calls else set()
        if len(turns) == 1 and None not in turns and next(iter(turns)) < len(s.turns):
            m = {"role": "assistant", "content": s.turns[next(iter(turns))].text}
        out.append(m)
    return out


def read_calls(text: str, parser, sid: Optional[str], turn: int) -> Tuple[Optional[str], Optional[list], bool]:
    """(content, OpenAI tool_calls or None, malformed) of a completion's text; ``parser``: tool_parsers' object
    (``extract(text) -> Parsed(content, calls, malformed)``) or None (no tools offered / no --tool_call_parser)."""
    if parser is None:
        return text, None, False
    p = parser.extract(text)
    if not p.calls:
        return (text if p.content is None else p.content), None, bool(p.malformed)
    sid = sid or uuid.uuid4().hex[:12]
    calls = [{"id": call_id(sid, turn, i), "type": "function",
              "function": {"name": c.name, "arguments": c.arguments if isinstance(c.arguments, str)
                           else json.dumps(c.arguments)}} for i, c in enumerate(p.calls)]
    return p.content, calls, False


def make_tool_parser(name: Optional[str], tokenizer, tools):
    """rlhf/agents/tool_parsers.py's parser ``name`` for these tools; None without a name or without tools."""
    if not name or not tools:
        return None
    from rlhf.agents.tool_parsers import make_parser

    return make_parser(name, tokenizer, tools)
