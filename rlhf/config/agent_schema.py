"""Multi-turn agents: tools, tool-call parsing, episode limits and the OpenAI-compatible endpoint (issue 44).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``agent:``), as in schema.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AgentConfig:
    """The ``agent`` flag group (fields are added by the feature that reads them; see docs/FLAGS.md)."""
