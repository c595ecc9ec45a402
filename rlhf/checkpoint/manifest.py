"""A checkpoint's ``manifest.json``: the size and a fast hash of every file (xxh3-128, else blake2b) and the run's
identity; checking a checkpoint against it.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Optional

from rlhf.checkpoint.layout import STATE_FILE, load_trainer_state

MANIFEST = "manifest.json"


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
