"""HuggingFace exports (--save_path, the LoRA combiner): ``save_hf`` and the export record ``.rlhf-export.json``
that lets an export replace only files an earlier export wrote (``begin_export`` / ``install_export``).
"""
from __future__ import annotations

import fnmatch
import json
import os
import shutil
import time
from typing import List, Optional, Tuple

from rlhf.checkpoint.manifest import _walk
from rlhf.errors import ExportError
from rlhf.models.vision import copy_processor_files


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
    from rlhf.utils.quiet import quiet_save

    base = getattr(model, "module", model)  # a peft model saves its adapter from the full state dict
    with quiet_save():  # no DeepSpeed import (and its "Setting accelerator to CPU") under --backend fsdp2
        base.save_pretrained(tmp, state_dict=drop_tied_copies(model_state, base), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    copy_processor_files(base, tmp)  # a vision-language model's image processor travels with it
    install_export(tmp, path)


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
