"""Collective, crash-safe save: every rank writes into ``.tmp-global_step_N-<host>-<pid>``, hashes its share,
rank 0 writes the trainer state and the manifest, renames, and keeps the newest ``max_keep``; the rng states.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
from typing import Callable, Dict, Optional

import numpy as np
import torch

from rlhf.checkpoint.layout import STATE_FILE, list_checkpoints
from rlhf.checkpoint.lock import remove_cut_short_saves
from rlhf.checkpoint.manifest import MANIFEST, _walk, hash_files, write_manifest
from rlhf.distributed import comm


def _barrier():
    comm.barrier()


def rng_state() -> dict:
    """Python, numpy and torch CPU generators, and every visible CUDA device's generator when CUDA is there
    (dropout and sampling on the GPU draw from those; ``torch.cuda.random.get_rng_state_all``, as
    transformers' trainer.py ``_save_rng_state`` keeps them under a distributed run)."""
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    cuda = s.get("cuda")
    if cuda and torch.cuda.is_available():
        # per device: a resume on a node that shows fewer devices restores the ones it has
        for i, state in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)


def save_checkpoint(root: str, step: int, write: Callable[[str], None], trainer_state: dict, max_keep: int = 3,
                    extra_rank_state: Optional[dict] = None, identity: Optional[dict] = None) -> str:
    """Collective.  ``write(tmp_dir)`` saves the engines (all ranks); rank 0 writes the trainer state.

    The temporary directory's name is unique to this run (host and pid of rank 0), so two runs never share one.
    Every rank hashes the files it wrote; rank 0 gathers them into ``manifest.json`` (with ``identity``) before
    the rename, so a checkpoint with its final name always has a manifest."""
    final = os.path.join(root, f"global_step_{step}")
    rank = comm.rank()
    tmp = comm.broadcast_object(
        os.path.join(root, f".tmp-global_step_{step}-{socket.gethostname()}-{os.getpid()}") if rank == 0 else None, 0)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier()
    before = set(_walk(tmp))
    write(tmp)
    torch.save({"rng": rng_state(), **(extra_rank_state or {})}, os.path.join(tmp, f"rank_{rank}.pt"))
    _barrier()
    # each rank hashes a 1/world share of the engine files (every file once, in parallel) and its own rank file;
    # rank 0 then hashes whatever no rank could see (trainer state, files outside the shares)
    new = [f for f in _walk(tmp) if f not in before and not re.match(r"^rank_\d+\.pt$", f)]
    mine = new[rank::comm.world_size()] + [f"rank_{rank}.pt"]
    gathered = comm.all_gather_object(hash_files(tmp, mine))
    if rank == 0:
        world = comm.world_size()
        with open(os.path.join(tmp, STATE_FILE), "w") as fh:
            json.dump({**trainer_state, "world_size": world, "manifest": MANIFEST}, fh)
        files: Dict[str, dict] = {}
        for part in gathered:
            files.update(part)
        files.update(hash_files(tmp, [f for f in _walk(tmp) if f not in files]))
        write_manifest(tmp, files, identity)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-max_keep] if max_keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        remove_cut_short_saves(root)
    _barrier()
    return final
