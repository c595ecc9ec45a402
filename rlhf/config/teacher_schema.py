"""A frozen teacher role and on-policy / offline distillation (issue 46).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``teacher:``), as in schema.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TeacherConfig:
    """The ``teacher`` flag group (fields are added by the feature that reads them; see docs/FLAGS.md)."""
