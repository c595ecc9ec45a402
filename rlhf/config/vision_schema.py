"""Vision-language inputs: images in the data, the processor, the vision tower (issue 46).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``vision:``), as in schema.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VisionConfig:
    """The ``vision`` flag group (fields are added by the feature that reads them; see docs/FLAGS.md)."""
