"""``opt``: a flag as a dataclass field (its help, choices, nargs, type in the field's metadata), shared by
rlhf/config/schema.py and the flag-group files it imports (agent, parallel, teacher, vision), which cannot import
schema.py itself (it imports them)."""
from __future__ import annotations

from dataclasses import field


def opt(default, help: str, choices=None, nargs=None, flag_type=None, optional_value=None):
    meta = {"help": help}
    if optional_value is not None:
        meta["optional_value"] = optional_value  # the flag alone means this value; --flag VALUE gives another
    if choices is not None:
        meta["choices"] = tuple(choices)
    if nargs is not None:
        meta["nargs"] = nargs
    if flag_type is not None:
        meta["type"] = flag_type
    return field(default=default, metadata=meta)
