"""Load rows from local jsonl/json/parquet files or dirs, or hub data sets, with mixtures.

``spec`` is comma separated; each part is a file, a directory (its data files),
or a hub name (``name`` or ``name@split``) loaded with ``datasets.load_dataset``.
"""
from __future__ import annotations

import glob
import os
from typing import Dict, List, Optional

EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    pass


def check_jsonl(path: str) -> None:
    """Every non-blank line of a .jsonl file must be a JSON object; the error names the file and the line."""
    import json

    with open(path, encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{i}: line {i} is not valid JSON ({e}): {line.strip()[:120]!r}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{i}: line {i} is a JSON {type(row).__name__}, not an object "
                                f"{{\"key\": value, ...}}")


def _load_one(part: str, split: str = "train"):
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    part = os.path.expanduser(part)
    if os.path.isdir(part):
        files = sorted(f for f in glob.glob(os.path.join(part, "*")) if os.path.splitext(f)[1] in EXT)
        if not files:
            raise DataError(f"directory {part} holds no .jsonl/.json/.parquet/.csv files")
        kinds = {EXT[os.path.splitext(f)[1]] for f in files}
        if len(kinds) > 1:
            raise DataError(f"directory {part} mixes file types {sorted(kinds)}; use one")
        return datasets.load_dataset(kinds.pop(), data_files=files, split="train")
    ext = os.path.splitext(part)[1]
    if ext in EXT:
        if not os.path.isfile(part):
            raise DataError(f"data file {part} does not exist")
        if os.path.getsize(part) == 0:
            raise DataError(f"data set {part} is empty")
        if ext == ".jsonl":
            check_jsonl(part)
        try:
            return datasets.load_dataset(EXT[ext], data_files=part, split="train")
        except Exception as e:
            raise DataError(f"could not read {part} as {EXT[ext]}: {type(e).__name__}: {e}") from e
    name, _, sp = part.partition("@")
    return datasets.load_dataset(name, split=sp or split)


def load_rows(spec: str, required_keys: Dict[str, Optional[str]], probs: Optional[str] = None, max_samples: int = 10**9,
              seed: int = 42) -> List[Dict]:
    """Rows of the (mixed) data set as dicts.

    ``required_keys`` maps the flag that names a key (``input_key``) to the key; every
    source must have every key, else the error names the source, the key and the flag.
    """
    import datasets

    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise DataError("empty --dataset / --prompt_data")
    sets = []
    for part in parts:
        ds = _load_one(part)
        if len(ds) == 0:
            raise DataError(f"data set {part} is empty")
        for flag, key in required_keys.items():
            if key and key not in ds.column_names:
                fix = f"set --{flag} to one of those"
                if flag == "label_key":
                    fix += ', or --label_key "" if the data has no labels (the reward then gets None labels)'
                raise DataError(f"data set {part} has no key {key!r} (it has {', '.join(ds.column_names)}); {fix}")
        sets.append(ds.select(range(min(max_samples, len(ds)))))
    if len(sets) == 1:
        return list(sets[0])
    if probs:
        weights = [float(p) for p in probs.split(",")]
        if len(weights) != len(sets):
            raise DataError(f"--dataset_probs has {len(weights)} weights for {len(sets)} data sets")
        total = sum(weights)
        cols = [k for k in required_keys.values() if k]
        sel = [s.select_columns(cols) for s in sets]
        sel = [sel[0]] + [s.cast(sel[0].features) for s in sel[1:]]  # jsonl 'string' vs parquet 'large_string'
        mixed = datasets.interleave_datasets(sel, probabilities=[w / total for w in weights], seed=seed,
                                             stopping_strategy="all_exhausted")
        return list(mixed)
    return [r for s in sets for r in s]


def split_eval(rows: List[Dict], frac: float, seed: int):
    import random

    if frac <= 0:
        return rows, []
    idx = list(range(len(rows)))
    random.Random(seed).shuffle(idx)
    n_eval = max(1, int(len(rows) * frac))
    ev = set(idx[:n_eval])
    return [r for i, r in enumerate(rows) if i not in ev], [rows[i] for i in sorted(ev)]


def holdout_note(prompts: bool, n_eval: int, n_rows: int, frac: float) -> str:
    """The eval hold-out said once, with the flags that change it (it takes rows out of training)."""
    flag = "--prompt_data" if prompts else "--dataset"
    return (f"[data] no --eval_dataset: holding out {n_eval} of {n_rows} rows of {flag} for eval (--eval_split "
            f"{frac:g}); set --eval_dataset to evaluate on other data, or --eval_split 0 to train on every row")


def load_train_eval(cfg_data, keys: Dict[str, Optional[str]], train: Optional[str], train_probs: Optional[str],
                    kit_files: Optional[tuple], missing: str, seed: int):
    """(train rows, eval rows) for every trainer: ``train`` (files / dirs / hub names) with --eval_dataset or a
    --eval_split of it; without ``train``, the built-in kit's (train, eval) files; else DataError(missing)."""
    d = cfg_data
    if train:
        rows = load_rows(train, keys, train_probs, d.max_samples, seed)
        if d.eval_dataset:
            return rows, load_rows(d.eval_dataset, keys, None, d.max_samples, seed)
        kept, ev = split_eval(rows, d.eval_split, seed)
        if ev and os.environ.get("RANK", "0") == "0":
            print(holdout_note(train == getattr(d, "prompt_data", None), len(ev), len(rows), d.eval_split), flush=True)
        return kept, ev
    if kit_files is None:
        raise DataError(missing)
    return load_rows(kit_files[0], keys, None, d.max_samples), load_rows(kit_files[1], keys, None, d.max_samples)
