"""Crash-safe checkpoint directories: ckpt_path/global_step_N/, written under a temporary name and renamed.

A directory only gets its final name after every rank finished writing, so a
crash mid-save leaves a ``.tmp-global_step_N-<run>`` that resume ignores (and the next
save removes).  Every checkpoint holds ``manifest.json``: the size and a fast hash of every file (each rank hashes
the files it wrote, rank 0 assembles them before the rename) and the run's identity (``run_identity``).
``pick_checkpoint`` verifies the newest checkpoint against its manifest and falls back to the newest intact one;
``resume_path`` does so collectively, every rank hashing a share (``verify_shared``).
``acquire_lock`` keeps two runs off one --ckpt_path.
"""
from __future__ import annotations

import atexit
import fcntl
import fnmatch
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
from rlhf.errors import CheckpointError, ExportError

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


def step_dirs(root: str):
    """Every ``global_step_N`` directory, oldest first, as (step, path) -- complete or not (a checkpoint gets its
    final name only after its trainer state is written, so one without it lost that file afterwards)."""
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)), os.path.join(root, n)) for n in os.listdir(root)
                  for m in [STEP_RE.match(n)] if m and os.path.isdir(os.path.join(root, n)))


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


def remove_cut_short_saves(root: str) -> List[Tuple[str, int]]:
    """Remove the ``.tmp-global_step_*`` directories of saves cut short -- only while this process holds the
    folder's lock (without it, a ``.tmp-*`` may be another live run's save in progress; with it, every other
    run that could be writing one is gone).  Returns (name, bytes) of what was removed."""
    if os.path.abspath(root) not in _HELD_LOCKS or not os.path.isdir(root):
        return []
    removed = []
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if name.startswith(".tmp-global_step_") and os.path.isdir(d):
            size = sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(d) for f in fs
                       if os.path.isfile(os.path.join(b, f)))
            shutil.rmtree(d, ignore_errors=True)
            removed.append((name, size))
    return removed


# ---------------------------------------------------------------- manifest: sizes and hashes of every file

def _hasher():
    """xxh3-128 when xxhash is installed (several GB/s), else blake2b (about 1 GB/s)."""
    try:
        import xxhash

        return "xxh3_128", xxhash.xxh3_128
    except ImportError:
        return "blake2b", lambda: hashlib.blake2b(digest_size=16)


def _walk(d: str, leave_out: str = MANIFEST) -> List[str]:
    """Files under ``d`` as sorted paths relative to it ('/'-separated), ``leave_out`` (the manifest) left out."""
    out = []
    for base, _, names in os.walk(d):
        for n in names:
            rel = os.path.relpath(os.path.join(base, n), d).replace(os.sep, "/")
            if rel != leave_out:
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


# ---------------------------------------------------------------- the run's identity

SHAPE_FLAGS = ("pretrain_shape", "lora_rank", "needs_critic", "critic_pretrain_shape")
SAME_RUN_FLAGS = ("pretrain", "ref_pretrain", "critic_pretrain", "reward_pretrain", "dataset", "prompt_data",
                  "advantage_estimator")
REPORTED_FLAGS = ("learning_rate", "actor_learning_rate", "critic_learning_rate", "max_epochs", "num_episodes",
                  "max_global_steps", "train_batch_size")
# the data stream: step N's prompts (samples) are a slice of a --seed shuffle at N x the batch, so another value
# on resume re-trains some and skips others; {flag: why}
RL_STREAM_FLAGS = {
    "seed": "the prompt order of each episode is a shuffle drawn from --seed",
    "rollout_batch_size": "step N's prompts are positions N x --rollout_batch_size of the episode's shuffle",
    "n_samples_per_prompt": "each step's samples, its optimizer steps and the learning-rate schedule (and any "
                            "queued async rollouts) were made with it"}
SUPERVISED_STREAM_FLAGS = {
    "seed": "the sample order of each epoch is a shuffle drawn from --seed",
    "train_batch_size": "step N's samples are positions N x --train_batch_size of the epoch's shuffle"}


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
    """What makes a checkpoint this run's: shapes, models and data, the objective, and harmless settings.

    The one function outside rlhf/config/ that reads the whole config, on purpose: a run's identity is a record of
    its flags across five groups (model, data, algorithm, optim and, for the data stream, rollout), written into
    every checkpoint's manifest and compared field by field on resume (``compare_identity``), as the config's own
    ``to_dict`` records all of it; passing the five groups one by one would say the same thing longer."""
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
    groups = list(vars(cfg).values())
    ident["data_stream"] = {k: _flag_value(groups, k) for k in stream_flags(d)}
    return ident


def stream_flags(data) -> Dict[str, str]:
    """The flags that place each step in the data stream: RL (``data``, the --data flag group, names
    --prompt_data) or supervised."""
    return RL_STREAM_FLAGS if getattr(data, "prompt_data", None) else SUPERVISED_STREAM_FLAGS


def _flag_value(groups: List, name: str):
    """Flag ``name``'s value in the first of the flag ``groups`` that has it (None when none does)."""
    for grp in groups:
        if hasattr(grp, name):
            return getattr(grp, name)
    return None


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
    check_stream(path, saved.get("data_stream") or {}, now.get("data_stream") or {})
    changed = [f"--{k} {saved[k]} -> {now.get(k)}" for k in REPORTED_FLAGS if k in saved and saved[k] != now.get(k)
               and k not in (now.get("data_stream") or {})]
    return [f"[resume] {path}: changed since the save: {', '.join(changed)}"] if changed else []


def check_stream(path: str, saved: dict, now: dict) -> None:
    """CheckpointError naming the flag when a data-stream flag differs from the checkpoint's (a checkpoint saved
    before these were recorded is not checked)."""
    why = {**SUPERVISED_STREAM_FLAGS, **RL_STREAM_FLAGS}
    for k, v in saved.items():
        if k in now and now[k] != v:
            raise CheckpointError(
                f"checkpoint {path} was saved with --{k} {v}, this run has --{k} {now[k]}: {why.get(k, k)}, so "
                f"resuming with another value would train some of the data again and skip the rest. Resume with --{k} "
                f"{v}, or give this run its own --ckpt_path to start over with --{k} {now[k]}")


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
    # the lock proves every earlier run on this folder dead: their cut-short saves go now, before this run's
    # first save needs the space (a disk filled by a save that failed stays full otherwise)
    removed = remove_cut_short_saves(root)
    if removed:
        notices.append(f"[ckpt] removed {len(removed)} save(s) cut short by an earlier run in {root} "
                       f"({', '.join(n for n, _ in removed)}; {sum(b for _, b in removed) / 2 ** 20:.1f} MiB freed)")
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


def check_hashes(path: str, files: Dict[str, dict], rels: List[str]) -> Dict[str, str]:
    """{relative path: what is wrong} for the files ``rels`` of checkpoint ``path`` whose bytes differ from the
    manifest's hash (or that vanished or changed size since the size check)."""
    bad = {}
    for rel in rels:
        f, want = os.path.join(path, rel), files[rel]
        try:
            size = os.path.getsize(f)
            if size != want["size"]:
                bad[rel] = f"{rel} has {size} bytes, the manifest says {want['size']} (truncated or rewritten)"
            elif file_digest(f) != want["hash"]:
                bad[rel] = f"{rel} does not match its checksum (the bytes changed after the save)"
        except OSError as e:
            bad[rel] = f"{rel} is unreadable ({e.strerror or e})"
    return bad


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
    """Rank 0: write an HF model (safetensors) + tokenizer beside ``path``, then put it in place (``install_export``:
    only an earlier export's files are replaced; nothing else in ``path`` is touched)."""
    if model_state is None:
        return
    tmp = begin_export(path)
    from .quiet import quiet_save

    base = getattr(model, "module", model)  # a peft model saves its adapter from the full state dict
    with quiet_save():  # no DeepSpeed import (and its "Setting accelerator to CPU") under --backend fsdp2
        base.save_pretrained(tmp, state_dict=drop_tied_copies(model_state, base), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    install_export(tmp, path)


# ---------------------------------------------------------------- the final export: never delete what we did not write
#
# OpenRLHF writes its model into --save_path with ``os.makedirs(exist_ok=True)`` + ``save_pretrained``
# (openrlhf/utils/deepspeed/deepspeed.py ``save_model``), and its own scripts keep checkpoints and logs under the same
# folder (``--save_path ./ckpt --ckpt_path ./ckpt/checkpoints_ppo_ray``).  An export here is written beside the target
# and moved in file by file; ``EXPORT_RECORD`` in the target lists the files an export wrote, so the next export
# replaces those (and drops the ones it no longer writes) and never touches anything else.  A file the export would
# overwrite that no export wrote is refused at start (``export_conflicts``).

EXPORT_RECORD = ".rlhf-export.json"
# top-level names an HF / peft / critic export may write (save_pretrained's weights, config and model card, the
# tokenizer's files, the critic's value head)
EXPORT_PATTERNS = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin",
                   "*.bin.index.json", "*.pt", "adapter_config.json", "tokenizer*", "special_tokens_map.json",
                   "added_tokens.json", "vocab.*", "merges.txt", "spiece.model", "chat_template.*", "README.md",
                   "preprocessor_config.json", "processor_config.json")


def export_record(path: str) -> Optional[List[str]]:
    """The files the last export into ``path`` wrote; None when ``path`` holds no record."""
    try:
        with open(os.path.join(path, EXPORT_RECORD)) as fh:
            return list(json.load(fh).get("files", []))
    except (OSError, ValueError, AttributeError):
        return None


def _write_record(path: str, files: List[str], partial: bool = False) -> None:
    tmp = os.path.join(path, EXPORT_RECORD + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"files": sorted(set(files)), "partial": partial,
                   "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, fh, indent=1)
    os.replace(tmp, os.path.join(path, EXPORT_RECORD))


def export_conflicts(path: str, extra: Tuple[str, ...] = ()) -> List[str]:
    """Top-level files in ``path`` an export may overwrite (``EXPORT_PATTERNS`` and ``extra``) that no export of
    this project wrote (they are not in its record)."""
    if not os.path.isdir(path):
        return []
    ours = set(export_record(path) or [])
    return sorted(n for n in os.listdir(path)
                  if n not in ours and n != EXPORT_RECORD and os.path.isfile(os.path.join(path, n))
                  and any(fnmatch.fnmatch(n, p) for p in EXPORT_PATTERNS + tuple(extra)))


def check_export_target(path: str, flag: str, extra: Tuple[str, ...] = ()) -> None:
    """ExportError naming ``--flag`` when ``path`` is a file, or holds files an export would overwrite that no
    export wrote (a model, a tokenizer, a README of someone else's): checked before training, not after."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ExportError(f"--{flag} {path} is a file; the model is saved as a folder: give a folder path")
    clash = export_conflicts(path, extra)
    if clash:
        shown = ", ".join(clash[:8]) + (f" and {len(clash) - 8} more" if len(clash) > 8 else "")
        raise ExportError(
            f"--{flag} {path} holds {shown}, which the final export would overwrite and which no export of this "
            f"project wrote (no {EXPORT_RECORD} lists them): nothing there is deleted or overwritten. Give an empty "
            f"or new folder, e.g. --{flag} {os.path.join(path.rstrip('/') or '.', 'model')}, or move those files "
            f"away (the folder's other contents, such as --ckpt_path or --log_dir under it, are fine)")


def begin_export(path: str) -> str:
    """A fresh temporary folder beside ``path`` (``<path>.tmp``) for the export, marked as this project's; an earlier
    export's cut-short temporary folder (marked) is replaced, a foreign folder of that name is refused."""
    tmp = path.rstrip("/") + ".tmp"
    if os.path.lexists(tmp):
        if not (os.path.isdir(tmp) and export_record(tmp) is not None):
            raise ExportError(f"{tmp} exists and was not written by an export of this project; the export of {path} "
                              f"is written there first: move it away")
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    _write_record(tmp, [], partial=True)
    return tmp


def install_export(tmp: str, path: str) -> None:
    """Put the finished export ``tmp`` (from ``begin_export``) at ``path``.  A new ``path``: one rename.  An existing
    one: the export's files are moved in one by one, replacing only the files the previous export's record lists;
    the previous export's files this one does not write are removed; nothing else in ``path`` is touched.  The
    record lists every file written before any is moved, so a crash midway leaves no file unaccounted for.  A file
    that would be overwritten and is not in the record: ExportError, the export left complete in ``tmp``."""
    new = _walk(tmp, leave_out=EXPORT_RECORD)
    _write_record(tmp, new)
    if not os.path.lexists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        os.replace(tmp, path)
        return
    if not os.path.isdir(path):
        raise ExportError(f"{path} is a file, so the export cannot be put there; it is complete in {tmp}")
    old = export_record(path) or []
    clash = [f for f in new if os.path.lexists(os.path.join(path, f)) and f not in old]
    if clash:
        raise ExportError(f"{path} holds {', '.join(clash[:8])}, which no export of this project wrote: nothing was "
                          f"overwritten; the export is complete in {tmp} (move it where you want it)")
    _write_record(path, old + new, partial=True)
    for f in new:
        dst = os.path.join(path, f)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(os.path.join(tmp, f), dst)
    for f in sorted(set(old) - set(new)):
        _remove_exported(path, f)
    _write_record(path, new)
    shutil.rmtree(tmp, ignore_errors=True)


def _remove_exported(path: str, rel: str) -> None:
    """Remove a file an earlier export wrote, and the folders it leaves empty up to ``path``."""
    f = os.path.join(path, rel)
    if os.path.isfile(f) or os.path.islink(f):
        os.remove(f)
    d = os.path.dirname(f)
    while os.path.abspath(d) != os.path.abspath(path):
        try:
            os.rmdir(d)
        except OSError:
            break
        d = os.path.dirname(d)
