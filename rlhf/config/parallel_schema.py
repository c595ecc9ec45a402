"""Parallelism inside a role's mesh: tensor, expert and hybrid sharding, MoE kernels, routing replay (issue 45).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``parallel:``), as in schema.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    """The ``parallel`` flag group (fields are added by the feature that reads them; see docs/FLAGS.md)."""
