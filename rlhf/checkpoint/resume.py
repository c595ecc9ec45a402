"""Which checkpoint a run resumes from: the newest intact one (``pick_checkpoint``), verified collectively with
every rank hashing a share (``resume_path``, ``verify_shared``); then this rank's rng state (``load_rank_state``).
"""
from __future__ import annotations

import os
import random
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from rlhf.checkpoint.errors import CheckpointError
from rlhf.checkpoint.layout import derived_seed, saved_world_size, step_dirs
from rlhf.checkpoint.manifest import _hasher, check_hashes, read_manifest, verify_checkpoint
from rlhf.checkpoint.save import set_rng_state
from rlhf.distributed import comm


def _rank() -> int:
    return comm.rank()


def pick_checkpoint(root: str, strict: bool = False, hashes: bool = True,
                    verify: Optional[Callable[[str], Optional[str]]] = None,
                    dirs: Optional[List[str]] = None) -> Tuple[Optional[str], List[str]]:
    """(the newest intact checkpoint or None when there is none at all, notices).  A damaged newer checkpoint is
    named in a notice and skipped; with ``strict`` a damaged newest checkpoint raises ``CheckpointError``, as does
    a folder whose every checkpoint is damaged (even with --start_fresh_if_no_checkpoint).  ``hashes=False``
    checks presence and sizes only (cheap: preflight on every rank).  ``verify`` (path -> what is wrong, or None)
    replaces ``verify_checkpoint`` and ``dirs`` (newest first) the listing of ``root``: ``resume_path`` passes its
    collective check and rank 0's listing."""
    notices: List[str] = []
    check = verify or (lambda p: verify_checkpoint(p, hashes))
    for path in dirs if dirs is not None else [p for _, p in reversed(step_dirs(root))]:
        why = check(path)
        if why is None:
            if notices:
                notices.append(f"[resume] falling back to {path}, the newest intact checkpoint")
            return path, notices
        if strict:
            raise CheckpointError(f"checkpoint {path} is damaged: {why}. --strict_resume refuses to fall back; "
                                  f"drop --strict_resume to resume from the newest intact checkpoint, or delete "
                                  f"{path}")
        notices.append(f"[resume] checkpoint {path} is damaged ({why}); skipping it")
    if notices:  # checkpoints exist but none is intact: starting fresh would silently train from scratch
        raise CheckpointError(f"no intact checkpoint in --ckpt_path {root}: {'; '.join(notices)}. Move the damaged "
                              f"checkpoints away (or give another --ckpt_path) to start from step 0")
    return None, notices


def resume_path(root: str, strict: bool = False) -> Optional[str]:
    """Collective: the checkpoint every rank resumes from (``pick_checkpoint`` with ``verify_shared``: every rank
    hashes a share of each candidate, so a 70B checkpoint's ~2 TB is read once, spread over the ranks, rather than
    by rank 0 alone while the others wait in a collective bounded by --dist_timeout_s).  Rank 0 lists the
    candidates and prints the fallback lines; every rank reaches the same verdict (a path, None, or the same
    ``CheckpointError``) after the same collectives in the same order."""
    dirs = comm.broadcast_object([p for _, p in reversed(step_dirs(root))] if _rank() == 0 else None, 0)
    path, notices = pick_checkpoint(root, strict, verify=verify_shared, dirs=dirs)
    if _rank() == 0:
        for n in notices:
            print(n, flush=True)
    return path


def hash_shares(files: Dict[str, dict], world: int) -> List[List[str]]:
    """The manifest's files split into ``world`` shares of about equal bytes (largest first, each to the share
    with the fewest bytes so far; ties to the lower rank): the same on every rank, since it depends on the
    manifest alone."""
    shares: List[List[str]] = [[] for _ in range(world)]
    load = [0] * world
    for rel in sorted(files, key=lambda r: (-int(files[r].get("size", 0)), r)):
        r = min(range(world), key=lambda i: (load[i], i))
        shares[r].append(rel)
        load[r] += int(files[rel].get("size", 0))
    return shares


def verify_shared(path: str) -> Optional[str]:
    """Collective ``verify_checkpoint``: rank 0 checks the manifest, presence and sizes and broadcasts the verdict
    with the file list; then every rank hashes its ``hash_shares`` share and one all_gather brings every rank the
    damaged files, the first in manifest (sorted) order named -- the message ``verify_checkpoint`` gives on one
    rank.  Every rank issues the same two collectives whatever it finds."""
    head = None
    if _rank() == 0:
        why = verify_checkpoint(path, hashes=False)
        man = read_manifest(path) if why is None else None
        same_algo = man is not None and man.get("hash") == _hasher()[0]
        head = (why, man.get("files", {}) if same_algo else {})
    why, files = comm.broadcast_object(head, 0)
    mine = hash_shares(files, comm.world_size())[_rank()] if why is None else []
    bad: Dict[str, str] = {}
    for part in comm.all_gather_object(check_hashes(path, files, mine)):
        bad.update(part)
    return why if why is not None else (bad[min(bad)] if bad else None)


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
