"""Load rows from local files, folders, saved data sets and hub data sets, with mixtures.

Spelling and meaning follow OpenRLHF's ``blending_datasets`` (openrlhf/datasets/utils.py): ``spec`` is comma
separated and each part is one source:

* a file: ``.jsonl`` / ``.json`` are read with the standard library (no ``datasets`` import); ``.parquet``,
  ``.csv`` and ``.arrow`` with ``datasets.load_dataset(<kind>, data_files=...)``. A file is the split "train".
* a folder: one written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``load_from_disk``), or data
  files (a flat folder of .jsonl/.json files whose names carry no split keyword is read with the standard library,
  as one "train" split, exactly what ``datasets`` makes of it; anything else goes through
  ``datasets.load_dataset(folder)``, which infers the splits from the file and folder names).
* a hub name: ``name`` (``datasets.load_dataset(name)``).
* ``@`` names a **data_dir**, a folder inside the data set, for folders and hub names alike:
  ``openai/gsm8k@main`` reads the files under ``main/`` (OpenRLHF's ``load_dataset(name, data_dir=...)``).
  Before this, ``name@split`` named a split here: that spelling is refused with the flag to use instead.
* ``:`` names a **config** of a data set whose configs are not folders (ours; OpenRLHF has no spelling for it):
  ``name:config`` is ``datasets.load_dataset(name, config)``. A data set with several configs and no default,
  given without one, is refused with the list of its configs.

The split is ``--prompt_split`` (RL prompts), ``--dataset_split`` (SFT/RM/DPO) or ``--eval_split``
(``--eval_dataset``), "train" by default, as in OpenRLHF. Mixtures (``--dataset_probs``) interleave as
``datasets.interleave_datasets(..., stopping_strategy="all_exhausted")`` does, row for row (same seed, same rows).
"""
from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional

from rlhf.console import print0
from rlhf.errors import DataError

EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
STDLIB_EXT = (".jsonl", ".json")
# datasets' split keywords in file names (datasets/data_files.py SPLIT_KEYWORDS): a flat folder whose file names
# carry none of them is one "train" split (DEFAULT_PATTERNS_ALL); otherwise datasets splits it by name
SPLIT_KEYWORDS = ("train", "training", "validation", "valid", "dev", "val", "test", "testing", "eval", "evaluation")
_SPLIT_IN_NAME = re.compile(r"(^|[-._ 0-9])(" + "|".join(SPLIT_KEYWORDS) + r")[-._ 0-9]")
# what `@` meant before it named a data_dir: a split, possibly sliced (train[:100])
OLD_SPLIT_SPELLING = re.compile(r"^(" + "|".join(SPLIT_KEYWORDS) + r")(\[.*\])?$")


@dataclass(frozen=True)
class Source:
    """One part of a data spec: ``path`` (file, folder or hub name), ``data_dir`` (after ``@``), ``config``
    (after ``:``)."""
    path: str
    data_dir: Optional[str] = None
    config: Optional[str] = None


def parse_source(part: str, split_flag: str = "--dataset_split") -> Source:
    """``path[:config][@data_dir]`` -> Source. ``name@train`` (the old split spelling) is refused, naming
    ``split_flag``; a folder really named like a split is written with a trailing slash (``name@train/``)."""
    part = part.strip()
    base, at, data_dir = part.partition("@")
    base, data_dir = os.path.expanduser(base.strip()), data_dir.strip() or None
    if at and not data_dir:
        raise DataError(f"{part}: nothing after '@'; '@' names a data_dir (a folder inside the data set, as in "
                        f"OpenRLHF: openai/gsm8k@main); drop it to read the whole data set")
    config = None
    if not os.path.exists(base) and ":" in base:
        base, config = (s.strip() for s in base.rsplit(":", 1))
        if not config:
            raise DataError(f"{part}: nothing after ':'; ':' names a config of the data set (name:config)")
    if data_dir and OLD_SPLIT_SPELLING.match(data_dir) and not os.path.isdir(os.path.join(base, data_dir)):
        split = data_dir
        raise DataError(
            f"{part}: '@' now names a data_dir (a folder inside the data set), as in OpenRLHF's blending_datasets "
            f"(openai/gsm8k@main), no longer a split; give the split with {split_flag} {split} and the data set as "
            f"{base}" + (f":{config}" if config else "") + f" (a folder that is really named {split!r}: write "
            f"{base}@{split}/)")
    return Source(base, data_dir.rstrip("/") if data_dir else None, config)


# ---------------------------------------------------------------- JSON with the standard library

def read_jsonl(path: str) -> List[Dict]:
    """The objects of a JSON-lines file; a line that is not a JSON object is a DataError naming file and line."""
    rows = []
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
            rows.append(row)
    return rows


def read_json(path: str) -> List[Dict]:
    """A .json file as ``datasets``' json builder reads it: a list of objects, an object of equal-length columns,
    or JSON lines."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except ValueError:
        return read_jsonl(path)
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
        return data
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        n = {len(v) for v in data.values()}
        if len(n) == 1:
            return [dict(zip(data, vals)) for vals in zip(*data.values())]
    if isinstance(data, dict):
        return [data]
    raise DataError(f"{path}: the file is a JSON {type(data).__name__}, not rows; give a list of objects "
                    f"[{{\"key\": value}}, ...], an object of columns, or JSON lines")


def fill_missing(rows: List[Dict]) -> List[Dict]:
    """Every row with every column (first-seen order), absent values None: the table ``datasets`` builds."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return [r if len(r) == len(cols) else {k: r.get(k) for k in cols} for r in rows]


def columns(rows: List[Dict]) -> List[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


# ---------------------------------------------------------------- datasets, only where needed

def _datasets():
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def _pick_split(data, split: str, what: str, split_flag: str):
    """A Dataset as it is; a DatasetDict's ``split`` (OpenRLHF: ``data[dataset_split]``), else a DataError
    listing the splits it has."""
    if not hasattr(data, "keys"):
        return data
    if split in data:
        return data[split]
    raise DataError(f"{what} has the splits {', '.join(data.keys())}; {split_flag} {split} names none of them: "
                    f"give {split_flag} one of those")


def _configs_in(message: str) -> List[str]:
    m = re.search(r"(?:available configs|Available): (\[.*?\])", message)
    try:
        return [str(c) for c in ast.literal_eval(m.group(1))] if m else []
    except (ValueError, SyntaxError):
        return []


def _load_dataset(src: Source, what: str):
    """``datasets.load_dataset(path, config, data_dir=...)`` with the config errors turned into fixes."""
    ds = _datasets()
    try:
        return ds.load_dataset(src.path, src.config, data_dir=src.data_dir)
    except ValueError as e:
        msg = str(e)
        configs = _configs_in(msg)
        if "Config name is missing" in msg:
            first = configs[0] if configs else "CONFIG"
            raise DataError(f"{what} has several configs and no default ({', '.join(configs)}): name one as "
                            f"{src.path}:{first} (or, where that config's files lie in a folder of the same name, "
                            f"OpenRLHF's data_dir spelling {src.path}@{first})") from None
        if "BuilderConfig" in msg and "not found" in msg:
            raise DataError(f"{what}: no config {src.config!r}; its configs are {', '.join(configs)}: give "
                            f"{src.path}:{configs[0] if configs else 'CONFIG'}") from None
        raise DataError(f"could not load {what}: {type(e).__name__}: {e}") from e
    except FileNotFoundError as e:
        raise DataError(f"could not load {what}: {e}" + ("" if os.path.isdir(src.path) else
                        " (a local path that does not exist is looked up on the hub as a data set name)")) from e
    except Exception as e:  # noqa: BLE001 - hub/offline/cast errors: said with the source named
        raise DataError(f"could not load {what}: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------- one source

def _is_saved(folder: str) -> bool:
    """A folder written by ``save_to_disk`` (``load_from_disk`` reads it)."""
    return os.path.isfile(os.path.join(folder, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(folder, "state.json")) and os.path.isfile(os.path.join(folder, "dataset_info.json")))


def _plain_json_files(folder: str) -> Optional[List[str]]:
    """The .jsonl/.json files of a flat folder that ``datasets`` would read as one "train" split (no README, no
    sub-folders, no other data files, no split keyword in a name), else None."""
    names = [n for n in sorted(os.listdir(folder)) if not n.startswith((".", "_"))]
    if not names or "README.md" in names or any(os.path.isdir(os.path.join(folder, n)) for n in names):
        return None
    data = [n for n in names if os.path.splitext(n)[1] in EXT]
    if not data or any(os.path.splitext(n)[1] not in STDLIB_EXT for n in data):
        return None
    if any(_SPLIT_IN_NAME.search(n.lower()) for n in data):
        return None
    return [os.path.join(folder, n) for n in data]


def _data_dirs(folder: str) -> List[str]:
    return sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)) and not n.startswith("."))


def _read_file(path: str) -> List[Dict]:
    if os.path.getsize(path) == 0:
        raise DataError(f"data set {path} is empty")
    return read_jsonl(path) if path.endswith(".jsonl") else read_json(path)


def _file_rows(src: Source, split: str, split_flag: str) -> List[Dict]:
    path, ext = src.path, os.path.splitext(src.path)[1]
    if src.data_dir or src.config:
        raise DataError(f"{path} is a file: '@' (a data_dir) and ':' (a config) name parts of a folder or hub data "
                        f"set; give the file alone")
    if not os.path.isfile(path):
        raise DataError(f"data file {path} does not exist")
    if split != "train":
        raise DataError(f"{path} is one file, read as the split 'train' (as datasets reads data_files); {split_flag} "
                        f"{split} names no split of it: drop {split_flag}, or give the file that holds that split")
    if ext in STDLIB_EXT:
        return fill_missing(_read_file(path))
    if os.path.getsize(path) == 0:
        raise DataError(f"data set {path} is empty")
    try:
        data = _datasets().load_dataset(EXT[ext], data_files=path, split="train")
    except Exception as e:  # noqa: BLE001 - a bad file: said with its name
        raise DataError(f"could not read {path} as {EXT[ext]}: {type(e).__name__}: {e}") from e
    return data.to_list()


def _folder_rows(src: Source, what: str, split: str, split_flag: str) -> List[Dict]:
    folder = os.path.join(src.path, src.data_dir) if src.data_dir else src.path
    if not os.path.isdir(folder):
        raise DataError(f"{what}: {src.path} has no folder {src.data_dir!r} (its folders: "
                        f"{', '.join(_data_dirs(src.path)) or 'none'}); '@' names a data_dir inside the data set")
    if _is_saved(folder) and not src.config:
        return _pick_split(_datasets().load_from_disk(folder), split, what, split_flag).to_list()
    files = None if src.config else _plain_json_files(folder)
    if files is not None:
        if split != "train":
            raise DataError(f"{what}: its files form the one split 'train' (no split keyword in their names); "
                            f"{split_flag} {split} names no split of it: drop {split_flag}, or name the files "
                            f"train.jsonl / {split}.jsonl")
        return fill_missing([r for f in files for r in _read_file(f)])
    subdirs = _data_dirs(folder)
    try:
        data = _load_dataset(src, what)
    except DataError as e:
        if subdirs and not src.data_dir and not src.config and "several configs" not in str(e):
            raise DataError(f"{e}; {src.path} holds the data dirs {', '.join(subdirs)}: read one with "
                            f"{src.path}@{subdirs[0]}") from None
        raise
    return _pick_split(data, split, what, split_flag).to_list()


def load_source(part: str, split: str = "train", split_flag: str = "--dataset_split") -> List[Dict]:
    """The rows of one part of a data spec (see the module docstring), as dicts."""
    src = parse_source(part, split_flag)
    what = f"data set {part.strip()}"
    if os.path.splitext(src.path)[1] in EXT and not os.path.isdir(src.path):
        return _file_rows(src, split, split_flag)
    if os.path.isdir(src.path):
        return _folder_rows(src, what, split, split_flag)
    data = _load_dataset(src, what)
    return _pick_split(data, split, what, split_flag).to_list()


# ---------------------------------------------------------------- mixtures

def interleave(sets: List[List[Dict]], probabilities: List[float], seed: int) -> List[Dict]:
    """``datasets.interleave_datasets(sets, probabilities, seed, stopping_strategy="all_exhausted")`` on lists:
    the same source draws (numpy ``default_rng(seed).choice`` in blocks of 1000) and the same rows
    (datasets/arrow_dataset.py ``_interleave_map_style_datasets``)."""
    import numpy as np

    lengths = np.asarray([len(s) for s in sets], dtype=np.int64)
    rng = np.random.default_rng(seed)
    blocks, counts = [], np.zeros(len(sets), dtype=np.int64)
    while not (counts >= lengths).all():
        block = rng.choice(len(sets), size=1000, p=probabilities)
        blocks.append(block)
        counts += np.bincount(block, minlength=len(sets))
    draws = np.concatenate(blocks)
    stop_at = max(int(np.flatnonzero(draws == s)[lengths[s] - 1]) for s in range(len(sets)))
    used = draws[:stop_at + 1]
    seen = [0] * len(sets)
    out = []
    for s in used.tolist():
        out.append(sets[s][seen[s] % len(sets[s])])
        seen[s] += 1
    return out


def _check_keys(part: str, rows: List[Dict], required_keys: Dict[str, Optional[str]]) -> None:
    cols = columns(rows)
    optional = {"input_key"} if "chosen_key" in required_keys else set()  # preference rows without a prompt column
    for flag, key in required_keys.items():
        if key and key not in cols and flag not in optional:
            fix = f"set --{flag} to one of those"
            if flag == "label_key":
                fix += (", or, if the data has no labels, leave --label_key out (OpenRLHF's default: the reward then "
                        'gets None labels; --label_key "" says the same)')
            raise DataError(f"data set {part} has no key {key!r} (it has {', '.join(cols)}); {fix}")


def load_rows(spec: str, required_keys: Dict[str, Optional[str]], probs: Optional[str] = None, max_samples: int = 10**9,
              seed: int = 42, split: str = "train", split_flag: str = "--dataset_split") -> List[Dict]:
    """Rows of the (mixed) data set as dicts.

    ``required_keys`` maps the flag that names a key (``input_key``) to the key; every source must have every key,
    else the error names the source, the key and the flag (preference data may lack ``--input_key``: OpenRLHF's
    chosen/rejected conversations without a prompt column). At most ``max_samples`` rows of each source.
    """
    parts = [p.strip() for p in (spec or "").split(",") if p.strip()]
    if not parts:
        raise DataError("empty --dataset / --prompt_data")
    sets = []
    for part in parts:
        rows = load_source(part, split, split_flag)
        if not rows:
            raise DataError(f"data set {part} is empty")
        _check_keys(part, rows, required_keys)
        sets.append(rows[:max_samples])
    if probs:
        weights = [float(p) for p in probs.split(",")]
        if len(weights) != len(sets):
            raise DataError(f"--dataset_probs has {len(weights)} weights for {len(sets)} data sets")
        if any(not w > 0 for w in weights):  # datasets refuses too: all_exhausted never exhausts an unsampled set
            raise DataError(f"--dataset_probs {probs}: every weight must be > 0 (a data set with weight 0 is never "
                            f"sampled); leave that data set out instead")
        if len(sets) > 1:
            total = sum(weights)
            return fill_missing(interleave(sets, [w / total for w in weights], seed))
    return fill_missing([r for s in sets for r in s]) if len(sets) > 1 else sets[0]


# ---------------------------------------------------------------- train / eval

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
    """The eval hold-out said once, with the flag that asked for it (it takes rows out of training)."""
    flag = "--prompt_data" if prompts else "--dataset"
    return (f"[data] --eval_holdout {frac:g}: holding out {n_eval} of {n_rows} rows of {flag} for eval (they are not "
            f"trained on)")


def load_train_eval(cfg_data, keys: Dict[str, Optional[str]], train: Optional[str], train_probs: Optional[str],
                    kit_files: Optional[tuple], missing: str, seed: int):
    """(train rows, eval rows) for every trainer, as OpenRLHF: ``train`` (files / folders / hub names, split
    --prompt_split or --dataset_split) and --eval_dataset (split --eval_split) when given; without an eval data set
    every row trains and eval is off, unless --eval_holdout asks for a random fraction of the rows instead. Without
    ``train``, the built-in kit's (train, eval) files; else DataError(missing)."""
    d = cfg_data
    prompts = train is not None and train == getattr(d, "prompt_data", None)
    split, flag = (d.prompt_split, "--prompt_split") if prompts else (d.dataset_split, "--dataset_split")
    if train:
        rows = load_rows(train, keys, train_probs, d.max_samples, seed, split, flag)
        if d.eval_dataset:
            return rows, load_rows(d.eval_dataset, keys, None, d.max_samples, seed, d.eval_split, "--eval_split")
        kept, ev = split_eval(rows, d.eval_holdout, seed)
        if ev:
            print0(holdout_note(prompts, len(ev), len(rows), d.eval_holdout))
        return kept, ev
    if kit_files is None:
        raise DataError(missing)
    return load_rows(kit_files[0], keys, None, d.max_samples), load_rows(kit_files[1], keys, None, d.max_samples)
