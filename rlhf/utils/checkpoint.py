"""Crash-safe checkpoint directories: ckpt_path/global_step_N/, written under a temporary name and renamed.

A directory only gets its final name after every rank finished writing, so a
crash mid-save leaves a ``.tmp-global_step_N-<run>`` that resume ignores (and the next
save removes).  Every checkpoint holds ``manifest.json``: the size and a fast hash of every file (each rank hashes
the files it wrote, rank 0 assembles them before the rename) and the run's identity (``run_identity``).
``pick_checkpoint`` verifies the newest checkpoint against its manifest and falls back to the newest intact one.
``acquire_lock`` keeps two runs off one --ckpt_path.
"""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import socket
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from rlhf.distributed import comm

STEP_RE = re.compile(r"^global_step_(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
LOCK_FILE = ".lock"
_HELD_LOCKS: Dict[str, object] = {}  # abs ckpt_path -> open lock file (held for the life of the process)


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
                    extra_rank_state: Optional[dict] = None, identity: Optional[dict] = None) -> str:
    """Collective.  ``write(tmp_dir)`` saves the engines (all ranks); rank 0 writes the trainer state.

    The temporary directory's name is unique to this run (host and pid of rank 0), so two runs never share one.
    Every rank hashes the files it wrote; rank 0 gathers them into ``manifest.json`` (with ``identity``) before
    the rename, so a checkpoint with its final name always has a manifest."""
    final = os.path.join(root, f"global_step_{step}")
    rank = _rank()
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


def remove_cut_short_saves(root: str) -> None:
    """Remove the ``.tmp-*`` directories of saves cut short -- only while this process holds the folder's lock
    (without it, a ``.tmp-*`` may be another live run's save in progress)."""
    if os.path.abspath(root) not in _HELD_LOCKS:
        return
    for name in os.listdir(root):
        if name.startswith(".tmp-global_step_"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ---------------------------------------------------------------- manifest: sizes and hashes of every file

def _hasher():
    """xxh3-128 when xxhash is installed (several GB/s), else blake2b (about 1 GB/s)."""
    try:
        import xxhash

        return "xxh3_128", xxhash.xxh3_128
    except ImportError:
        return "blake2b", lambda: hashlib.blake2b(digest_size=16)


def _walk(d: str) -> List[str]:
    """Files under ``d`` as sorted paths relative to it ('/'-separated), the manifest left out."""
    out = []
    for base, _, names in os.walk(d):
        for n in names:
            rel = os.path.relpath(os.path.join(base, n), d).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def file_digest(path: str, chunk: int = 8 << 20) -> str:
    """The hex hash of one file, read in 8 MiB chunks."""
    _, make = _hasher()
    h = make()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def hash_files(d: str, rels: List[str]) -> Dict[str, dict]:
    """{relative path: {"size", "hash"}} of the files ``rels`` under ``d`` (those that exist)."""
    return {r: {"size": os.path.getsize(os.path.join(d, r)), "hash": file_digest(os.path.join(d, r))}
            for r in rels if os.path.isfile(os.path.join(d, r))}


def write_manifest(d: str, files: Dict[str, dict], identity: Optional[dict] = None) -> None:
    with open(os.path.join(d, MANIFEST), "w") as fh:
        json.dump({"version": 1, "hash": _hasher()[0], "files": files, "identity": identity or {}}, fh, indent=1)


def read_manifest(path: str) -> Optional[dict]:
    """The checkpoint's manifest, or None when it has none (written before manifests existed) or it is unreadable."""
    try:
        with open(os.path.join(path, MANIFEST)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def verify_checkpoint(path: str, hashes: bool = True) -> Optional[str]:
    """None when every file the manifest lists is there with its size (and hash); else what is wrong, naming
    the file.  A checkpoint saved before manifests existed (its trainer state does not name one) passes
    unchecked."""
    man = read_manifest(path)
    if man is None:
        if os.path.exists(os.path.join(path, MANIFEST)):
            return f"{MANIFEST} is unreadable"
        try:
            wrote_one = load_trainer_state(path).get("manifest")
        except (OSError, ValueError):
            return f"{STATE_FILE} is unreadable"
        return f"{MANIFEST} is missing" if wrote_one else None
    algo = man.get("hash")
    for rel, want in sorted(man.get("files", {}).items()):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            return f"{rel} is missing"
        size = os.path.getsize(f)
        if size != want["size"]:
            return f"{rel} has {size} bytes, the manifest says {want['size']} (truncated or rewritten)"
        if hashes and algo == _hasher()[0] and file_digest(f) != want["hash"]:
            return f"{rel} does not match its checksum (the bytes changed after the save)"
    return None


def pick_checkpoint(root: str, strict: bool = False, hashes: bool = True) -> Tuple[Optional[str], List[str]]:
    """(the newest intact checkpoint or None when there is none at all, notices).  A damaged newer checkpoint is
    named in a notice and skipped; with ``strict`` a damaged newest checkpoint raises ``CheckpointError``, as does
    a folder whose every checkpoint is damaged (even with --start_fresh_if_no_checkpoint).  ``hashes=False``
    checks presence and sizes only (cheap: preflight on every rank)."""
    notices: List[str] = []
    for _, path in reversed(list_checkpoints(root)):
        why = verify_checkpoint(path, hashes)
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


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (damaged, or saved by a different run); the message names it and a fix."""


# ---------------------------------------------------------------- the run's identity

SHAPE_FLAGS = ("pretrain_shape", "lora_rank", "needs_critic", "critic_pretrain_shape")
SAME_RUN_FLAGS = ("pretrain", "ref_pretrain", "critic_pretrain", "reward_pretrain", "dataset", "prompt_data",
                  "advantage_estimator")
REPORTED_FLAGS = ("learning_rate", "actor_learning_rate", "critic_learning_rate", "max_epochs", "num_episodes",
                  "max_global_steps", "train_batch_size")


def _model_shape(path: Optional[str]) -> Optional[dict]:
    """The shape-deciding fields of an HF config.json (None when unreadable)."""
    if not path:
        return None
    try:
        with open(os.path.join(path, "config.json")) as fh:
            c = json.load(fh)
    except (OSError, ValueError):
        return None
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size")
    return {k: c.get(k) for k in keys}


def _norm_path(p):
    return os.path.abspath(os.path.expanduser(p)) if p and os.path.exists(os.path.expanduser(p)) else p


def run_identity(cfg) -> dict:
    """What makes a checkpoint this run's: shapes, models and data, the objective, and harmless settings."""
    m, a, o = cfg.model, cfg.algorithm, cfg.optim
    d = cfg.data
    from rlhf.algorithms import advantages  # noqa: F401 - registers the estimators
    from rlhf.algorithms.registry import ADVANTAGE_ESTIMATORS

    spec = ADVANTAGE_ESTIMATORS.get(a.advantage_estimator)
    needs_critic = getattr(spec, "needs_critic", None)
    ident = {"pretrain_shape": _model_shape(m.pretrain), "lora_rank": m.lora_rank, "needs_critic": needs_critic,
             "critic_pretrain_shape": _model_shape(m.critic_pretrain),
             "pretrain": _norm_path(m.pretrain), "ref_pretrain": _norm_path(m.ref_pretrain),
             "critic_pretrain": _norm_path(m.critic_pretrain), "reward_pretrain": _norm_path(m.reward_pretrain),
             "dataset": getattr(d, "dataset", None), "prompt_data": getattr(d, "prompt_data", None),
             "advantage_estimator": a.advantage_estimator}
    for k in REPORTED_FLAGS:
        for grp in (o, a, d):
            if hasattr(grp, k):
                ident[k] = getattr(grp, k)
                break
    return ident


def compare_identity(path: str, saved: dict, now: dict) -> List[str]:
    """Raise CheckpointError when checkpoint ``path`` was saved by a different run (a shape-changing flag, or a
    different model / data / objective); return notices for harmless changes (learning rate, steps)."""
    if not saved:
        return []
    for k in SHAPE_FLAGS + SAME_RUN_FLAGS:
        if k in saved and saved[k] != now.get(k):
            flag = k.replace("_shape", "").replace("needs_critic", "advantage_estimator")
            kind = "changes the model's shapes" if k in SHAPE_FLAGS else "makes it a different run"
            raise CheckpointError(
                f"checkpoint {path} was saved with --{flag} {_show(saved, k)}, this run has {_show(now, k)}: "
                f"that {kind}, so resuming it would load another run's weights. Give this run its own --ckpt_path, "
                f"or rerun with the saved --{flag}")
    changed = [f"--{k} {saved[k]} -> {now.get(k)}" for k in REPORTED_FLAGS if k in saved and saved[k] != now.get(k)]
    return [f"[resume] {path}: changed since the save: {', '.join(changed)}"] if changed else []


def _show(ident: dict, k: str):
    if k.endswith("_shape"):
        return ident.get(k.replace("_shape", ""), ident.get(k))
    return ident.get(k)


# ---------------------------------------------------------------- one run per --ckpt_path

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder_alive(text: str) -> bool:
    """Whether the lock file's holder (``host=.. pid=..``) is a live process on this host (other hosts: assumed)."""
    kv = dict(p.split("=", 1) for p in text.split() if "=" in p)
    if not kv.get("pid"):
        return False
    return kv.get("host") != socket.gethostname() or _pid_alive(int(kv["pid"]))


def acquire_lock(root: str) -> List[str]:
    """Hold --ckpt_path for this process: an advisory ``flock`` on ``root/.lock``, whose text names the holder
    (host, pid, SLURM job id).  Another live run holding it raises CheckpointError naming it; a lock left by a
    dead process (the flock is released when a process dies) is taken over with a notice.  Idempotent."""
    root = os.path.abspath(root)
    if root in _HELD_LOCKS:
        return []
    os.makedirs(root, exist_ok=True)
    fh = open(os.path.join(root, LOCK_FILE), "a+")
    fh.seek(0)
    prev = fh.read().strip()
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        busy = False
    except BlockingIOError:
        busy = True
    except OSError:  # a file system without flock: judge by the holder's pid when it is on this host
        busy = _holder_alive(prev)
    if busy:
        fh.close()
        raise CheckpointError(f"--ckpt_path {root} is in use by another run ({prev or 'holder unknown'}): two runs "
                              f"on one folder overwrite each other's checkpoints. Give this run its own --ckpt_path, "
                              f"or wait for that run to end") from None
    notices = []
    if prev:
        notices.append(f"[ckpt] taking over the stale lock of {root} ({prev}): that process is gone")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID", ""),
          "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    fh.seek(0)
    fh.truncate()
    fh.write(" ".join(f"{k}={v}" for k, v in me.items()))
    fh.flush()
    _HELD_LOCKS[root] = fh
    atexit.register(release_lock, root)
    return notices


def release_lock(root: str) -> None:
    """Drop this process's lock on ``root`` (the file is emptied, so the next run sees no stale holder)."""
    fh = _HELD_LOCKS.pop(os.path.abspath(root), None)
    if fh is not None:
        fh.seek(0)
        fh.truncate()
        fh.flush()
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        fh.close()


def resume_path(root: str, strict: bool = False) -> Optional[str]:
    """Collective: the checkpoint every rank resumes from.  Rank 0 verifies the hashes (``pick_checkpoint``) and
    prints the fallback lines; the verdict (a path, None, or the error) is broadcast so every rank takes the same
    branch and raises the same error."""
    verdict = None
    if _rank() == 0:
        try:
            path, notices = pick_checkpoint(root, strict)
            for n in notices:
                print(n, flush=True)
            verdict = ("ok", path)
        except CheckpointError as e:
            verdict = ("error", str(e))
    kind, value = comm.broadcast_object(verdict, 0)
    if kind == "error":
        raise CheckpointError(value)
    return value


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
    from rlhf.models.load import quiet_save

    base = getattr(model, "module", model)  # a peft model saves its adapter from the full state dict
    with quiet_save():  # no DeepSpeed import (and its "Setting accelerator to CPU") under --backend fsdp2
        base.save_pretrained(tmp, state_dict=drop_tied_copies(model_state, base), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.replace(tmp, path)
