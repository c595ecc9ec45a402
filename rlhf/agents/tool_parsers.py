"""Reading the model's tool calls from the text of its turn (``--tool_call_parser``).

Where vLLM is installed the parser is vLLM's own (``vllm.tool_parsers.ToolParserManager``, read at vLLM 0.32.0:
vllm/tool_parsers/abstract_tool_parser.py): ``ToolParserManager.get_tool_parser(name)(tokenizer, tools)`` and
``extract_tool_calls(model_output, request) -> ExtractedToolCallInformation(tools_called, tool_calls, content)``,
each call ``ToolCall(function=FunctionCall(name, arguments: JSON text))``.  Without vLLM, one parser of our own:
hermes (``HermesParser``), the same rules as vLLM's vllm/tool_parsers/hermes_tool_parser.py
``Hermes2ProToolParser.extract_tool_calls`` (tests/unit/test_tool_agent.py checks both give the same answer).

A turn that opens a tool call the parser cannot read (bad JSON, no name, a name that is not text, ...) comes back
with ``malformed`` set: the episode feeds an error message back to the model and counts it.  vLLM's parsers say
only "no tool call" then (hermes returns ``tools_called=False`` and the whole text as content); ``OPENERS`` names
the text that opens a call for the parsers this module knows, so such a turn is told from a final answer.
"""
from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from typing import List, Optional

from rlhf.errors import ConfigError

# the text that opens a tool call, per parser (vllm/tool_parsers/*: tool_call_start_token / bot_token)
OPENERS = {"hermes": "<tool_call>", "qwen3_json": "<tool_call>", "qwen3_xml": "<tool_call>",
           "qwen3_coder": "<tool_call>", "llama3_json": "<|python_tag|>", "llama4_json": "<|python_start|>"}
OWN = ("hermes",)  # the parsers this module has of its own (used only where vLLM is absent)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text (vLLM's FunctionCall.arguments)


@dataclass
class Parsed:
    """A turn read: the text before the calls (``content``), the calls, and whether a call was opened but could not
    be read (``malformed``: then ``calls`` is empty, as vLLM returns it)."""
    content: Optional[str]
    calls: List[ToolCall] = field(default_factory=list)
    malformed: bool = False


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2 Pro, Qwen2.5 / Qwen3), as vLLM's
    Hermes2ProToolParser.extract_tool_calls: every ``<tool_call>`` block (the last may be unclosed) must hold a
    JSON object with a text ``name`` and an ``arguments`` value (any JSON, re-dumped to text); one bad block makes the
    whole turn "no call" (content = the whole text), which here is also ``malformed``."""

    opener = "<tool_call>"
    pattern = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> Parsed:
        if self.opener not in text:
            return Parsed(text)
        try:
            calls = []
            for closed, open_ in self.pattern.findall(text):
                obj = json.loads(closed if closed else open_)
                if not isinstance(obj["name"], str):  # vLLM's FunctionCall(name: str) refuses it
                    raise TypeError("name is not text")
                calls.append(ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
        except Exception:
            return Parsed(text, [], True)
        content = text[:text.find(self.opener)]
        return Parsed(content if content else None, calls)


class VLLMParser:
    """One of vLLM's tool parsers under this module's ``extract``; ``tools``: the OpenAI function schemas offered
    (some parsers read them to type the arguments)."""

    def __init__(self, name: str, tokenizer, tools: Optional[list] = None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        self.name, self.opener = name, OPENERS.get(name)
        self.request = ChatCompletionRequest(messages=[], model="rlhf", tools=tools or None)
        self.parser = ToolParserManager.get_tool_parser(name)(tokenizer, self.request.tools)

    def extract(self, text: str) -> Parsed:
        info = self.parser.extract_tool_calls(text, self.request)
        calls = [ToolCall(c.function.name, c.function.arguments) for c in info.tool_calls]
        if info.tools_called and calls:
            return Parsed(info.content, calls)
        return Parsed(info.content, [], self.opener is not None and self.opener in text)


def has_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def parser_names() -> List[str]:
    """The names --tool_call_parser takes here: vLLM's registry where vLLM is installed, else ours."""
    if not has_vllm():
        return list(OWN)
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def check_parser_name(name: str) -> None:
    names = parser_names()
    if name not in names:
        where = "vLLM's ToolParserManager" if has_vllm() else "this build without vLLM (rlhf's own parser)"
        raise ConfigError("tool_call_parser", f"--tool_call_parser {name!r} is not a tool parser of {where}; use "
                                              f"one of {', '.join(names[:60])} (e.g. --tool_call_parser hermes)")


def make_parser(name: str, tokenizer, tools: Optional[list] = None):
    """vLLM's parser ``name`` where vLLM is installed, else ours (hermes only)."""
    check_parser_name(name)
    if has_vllm():
        return VLLMParser(name, tokenizer, tools)
    return HermesParser()
