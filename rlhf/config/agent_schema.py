"""Multi-turn agents: tools, tool-call parsing, episode limits and the OpenAI-compatible endpoint (issue 44).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``agent:``), as in schema.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AgentConfig:
    """The ``agent`` flag group (fields are added by the feature that reads them; see docs/FLAGS.md)."""

    # ---- the OpenAI-compatible endpoint (rlhf.agents.endpoint; a --agent_func_path file defining run_agent) -----
    agent_endpoint_host: str = field(default="127.0.0.1", metadata={
        "help": "address the in-job OpenAI-compatible endpoint binds on each engine's first rank (/v1/chat/"
                "completions, /v1/completions, /v1/models, /tokenize, /health); 0.0.0.0 exposes it to the network"})
    agent_endpoint_port: int = field(default=0, metadata={
        "help": "port of that endpoint; 0 picks a free port (printed at start); P > 0: engine i binds P + i"})
