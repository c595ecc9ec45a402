"""A --ckpt_path folder's layout: ``global_step_N/`` directories, each with ``trainer_state.json`` and
one ``rank_N.pt`` per rank that saved it; listing them and reading the trainer state.
"""
from __future__ import annotations

import json
import os
import re

STEP_RE = re.compile(r"^global_step_(\d+)$")


STATE_FILE = "trainer_state.json"


def list_checkpoints(root: str):
    """Complete checkpoints, oldest first, as (step, path)."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, STATE_FILE)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def step_dirs(root: str):
    """Every ``global_step_N`` directory, oldest first, as (step, path) -- complete or not (a checkpoint gets its
    final name only after its trainer state is written, so one without it lost that file afterwards)."""
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root)
                  for m in [STEP_RE.match(n)] if m and os.path.isdir(os.path.join(root, n)))


def load_trainer_state(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE)) as fh:
        return json.load(fh)


def saved_world_size(path: str) -> int:
    """Ranks that wrote checkpoint ``path`` (trainer_state's world_size, else its rank_N.pt files)."""
    try:
        ws = load_trainer_state(path).get("world_size")
    except (OSError, ValueError):
        ws = None
    return int(ws) if ws else len([f for f in os.listdir(path) if re.match(r"^rank_\d+\.pt$", f)])


def derived_seed(path: str, rank: int) -> int:
    """A fixed seed for a rank the checkpoint has no rng state for (resume on more ranks than saved)."""
    m = STEP_RE.match(os.path.basename(os.path.normpath(path)))
    step = int(m.group(1)) if m else 0
    return (1_000_003 * (step + 1) + 7919 * rank) % (2 ** 31 - 1)
