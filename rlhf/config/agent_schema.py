"""Multi-turn agents: tools, tool-call parsing, episode limits and the OpenAI-compatible endpoint (issue 44).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``agent:``), as in schema.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlhf.config.fields import opt


@dataclass
class AgentConfig:
    """The ``agent`` flag group (fields are added by the feature that reads them; see docs/FLAGS.md)."""
    # ---- tool calls (rlhf.agents.tool_agent) ----
    tools_path: Optional[str] = opt(None, "python file of tools (its TOOLS list, else its public functions; schemas "
                                           "from signatures and Google-style docstrings): with no --agent_func_path "
                                           "the rollout runs multi-turn tool episodes (turns: --max_steps)")
    tool_call_parser: str = opt("hermes", "vLLM tool parser that reads the model's tool calls (any name in vLLM's "
                                           "ToolParserManager: hermes, qwen3_xml, qwen3_coder, llama3_json, ...); "
                                           "without vLLM only hermes (rlhf's own parser)")
    max_tool_calls: int = opt(8, "tool calls per episode; calls beyond it get an error message instead of running")
    tool_timeout_s: float = opt(30.0, "seconds one tool call may run; a call cut there returns an error message")
    tool_output_max_chars: int = opt(4000, "characters of a tool's output kept in its tool message (the rest cut)")
    max_episode_tokens: Optional[int] = opt(None, "response tokens of one episode (model turns + tool messages); "
                                                   "default --generate_max_len x --max_steps")

    # ---- the OpenAI-compatible endpoint (rlhf.agents.endpoint; a --agent_func_path file defining run_agent) -----
    agent_endpoint_host: str = opt("127.0.0.1", "address the in-job OpenAI-compatible endpoint binds on each engine's "
                                   "first rank (/v1/chat/completions, /v1/completions, /v1/models, /tokenize, "
                                   "/health); 0.0.0.0 exposes it to the network")
    agent_endpoint_port: int = opt(0, "port of that endpoint; 0 picks a free port (printed at start); P > 0: engine i "
                                      "binds P + i")
