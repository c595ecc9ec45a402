"""Crash-safe checkpoint directories: ckpt_path/global_step_N/, written under a temporary name and renamed.

A directory only gets its final name after every rank finished writing, so a
crash mid-save leaves a ``.tmp-global_step_N`` that resume ignores (and the next
save removes).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Callable, Optional

import numpy as np
import torch

from rlhf.distributed import comm

STEP_RE = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.json"


def _barrier():
    comm.barrier()


def _rank() -> int:
    return comm.rank()


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


def latest_checkpoint(root: str) -> Optional[str]:
    cks = list_checkpoints(root)
    return cks[-1][1] if cks else None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


def save_checkpoint(root: str, step: int, write: Callable[[str], None], trainer_state: dict, max_keep: int = 3,
                    extra_rank_state: Optional[dict] = None) -> str:
    """Collective.  ``write(tmp_dir)`` saves the engines (all ranks); rank 0 writes the trainer state."""
    final = os.path.join(root, f"global_step_{step}")
    tmp = os.path.join(root, f".tmp-global_step_{step}")
    rank = _rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier()
    write(tmp)
    torch.save({"rng": rng_state(), **(extra_rank_state or {})}, os.path.join(tmp, f"rank_{rank}.pt"))
    _barrier()
    if rank == 0:
        world = comm.world_size()
        with open(os.path.join(tmp, STATE_FILE), "w") as fh:
            json.dump({**trainer_state, "world_size": world}, fh)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-max_keep] if max_keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


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


def load_rank_state(path: str) -> dict:
    """Restore this rank's rng state; a rank the checkpoint has no file for (resumed on more ranks) gets rng states
    seeded from (step, rank) -- deterministic, said once -- and an empty state."""
    rank = _rank()
    f = os.path.join(path, f"rank_{rank}.pt")
    if not os.path.isfile(f):
        seed = derived_seed(path, rank)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        print(f"[resume] {path} has no rank_{rank}.pt (saved by {saved_world_size(path)} ranks): rank {rank} "
              f"rng seeded with {seed}, derived from the step and the rank", flush=True)
        return {"rng": None, "derived_seed": seed}
    s = torch.load(f, weights_only=False)
    set_rng_state(s["rng"])
    return s


def drop_tied_copies(state: dict, model) -> dict:
    """The state dict without the copies of tied weights, so a tied matrix is stored once (a full state dict from
    FSDP2's ``get_model_state_dict`` or a gather holds ``lm_head.weight`` and ``model.embed_tokens.weight`` as two
    tensors, which ``save_pretrained`` can no longer recognise as one).  Tied pairs: the model's own
    ``_tied_weights_keys`` (transformers 5: {tied name: source name}) when ``config.tie_word_embeddings``, and
    any parameter the model reaches under two names; a copy is dropped only when its source key is kept.
    from_pretrained re-ties on load."""
    from rlhf.distributed.weight_sync import tied_aliases

    pairs = {alias: src for src, names in tied_aliases(model).items() for alias in names}
    tied_keys = getattr(model, "_tied_weights_keys", None)
    if isinstance(tied_keys, dict) and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        pairs.update(tied_keys)
    drop = {a for a, src in pairs.items() if a in state and src in state and a != src}
    return {k: v for k, v in state.items() if k not in drop} if drop else state


def save_hf(model_state: Optional[dict], model, tokenizer, path: str) -> None:
    """Rank 0: write an HF model (safetensors) + tokenizer under a temp name, then rename."""
    if model_state is None:
        return
    tmp = path.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    base = getattr(model, "module", model)  # a peft model saves its adapter from the full state dict
    base.save_pretrained(tmp, state_dict=drop_tied_copies(model_state, base), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)
