"""The reward server's model side: where the model goes (``resolve_placement``), queries cut to their last
``--max_len`` tokens (``tokenize_tails``, ``encode_left_truncated``), and ``RewardScorer``, which scores them in
micro-batches (``python -m rlhf.serve_rm``; the HTTP side is rlhf/rm_server/app.py).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

CHARS_PER_TOKEN_GUESS = 8   # the first character cap per query is max_len * this; doubled while too few tokens


CUT_MARGIN = 8              # tokens a character cut must leave beyond max_len (the cut may split a token or a word)


def tokenize_tails(tok, queries: Sequence[str], max_len: int) -> Tuple[List[List[int]], List[bool]]:
    """Each query's last ``max_len`` token ids, and whether it had more, without tokenizing more of a long query
    than needed (issue 42 item 9: a 10 MB query was tokenized whole before the cut, 24 s on the model thread).

    A query is first cut to its last ``max_len * CHARS_PER_TOKEN_GUESS`` characters; if that tail has more than
    ``max_len + CUT_MARGIN`` tokens its last ``max_len`` are the whole text's (a cut changes only the tokens of the
    word it splits, at the tail's start), else the cap doubles until it does or the query is whole."""
    ids: List[Optional[List[int]]] = [None] * len(queries)
    cut = [False] * len(queries)
    todo = list(range(len(queries)))
    cap = max_len * CHARS_PER_TOKEN_GUESS
    while todo:
        texts = [queries[i] if len(queries[i]) <= cap else queries[i][-cap:] for i in todo]
        got = tok(texts, add_special_tokens=False)["input_ids"]
        again = []
        for i, text, x in zip(todo, texts, got):
            whole = len(text) == len(queries[i])
            if whole or len(x) > max_len + CUT_MARGIN:
                ids[i], cut[i] = x[-max_len:], len(x) > max_len
            else:
                again.append(i)
        todo, cap = again, cap * 2
    return ids, cut


def encode_left_truncated(tok, queries: Sequence[str], max_len: int, pad_id: int
                          ) -> Tuple[torch.Tensor, torch.Tensor, List[bool]]:
    """Token ids (B, L) left-padded, attention mask (B, L), and which rows were cut: a query over ``max_len``
    tokens keeps its last ``max_len`` (the response end, where the score is read), never its first."""
    ids, cut = tokenize_tails(tok, queries, max_len)
    width = max(len(x) for x in ids)
    out = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        if x:
            out[i, width - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[i, width - len(x):] = 1
    return out, mask, cut


def reward_norm_stats(path: str) -> Optional[Tuple[float, float]]:
    """(mean, std) saved with a reward model: train_rm's reward_norm.json, else config.json's ``mean`` / ``std``
    (OpenRLHF's; its model reads them whenever present, openrlhf/models/model.py ``RewardModel.__init__``); None
    when neither is there."""
    from rlhf.models.load import RM_NORM_FILE

    f = os.path.join(path, RM_NORM_FILE)
    if os.path.isfile(f):
        with open(f) as fh:
            d = json.load(fh)
        return float(d["mean"]), float(d["std"])
    cfg_file = os.path.join(path, "config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as fh:
            cfg = json.load(fh)
        if "mean" in cfg and "std" in cfg:
            return float(cfg["mean"]), float(cfg["std"])
    return None


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Placement:
    """Where and how the reward model is served: ``device_map`` for ``from_pretrained`` ("auto": over every
    visible GPU, as OpenRLHF's serve_rm; {"": "cuda:N"}: one GPU; None: the CPU), ``dtype`` and
    ``attn_implementation``; ``notes`` are one-line notices of what was changed from the request."""
    device_map: Optional[object]
    dtype: torch.dtype
    attn_implementation: str
    notes: List[str]


def resolve_placement(device: str = "auto", param_dtype: str = "auto", attn_implementation: str = "auto",
                      cuda_available: Optional[bool] = None, flash_available: Optional[bool] = None) -> Placement:
    """OpenRLHF's serve_rm loads the model with ``device_map="auto"`` and ``param_dtype`` bf16 (default) on its
    GPUs, attention ``flash_attention_2`` (openrlhf/cli/serve_rm.py ``RewardModelProxy``; openrlhf/models/model.py
    ``get_llm_for_sequence_regression``).  Here: ``--device auto`` is that when CUDA is there, else the CPU;
    ``--param_dtype auto`` is bf16 on a GPU, fp32 on the CPU (bf16 matmuls are emulated, slowly, on most CPUs);
    a flash attention implementation without CUDA or the flash_attn package falls back to sdpa, with a notice."""
    notes: List[str] = []
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    if device.startswith("cuda") and not cuda_available:
        raise ValueError(f"--device {device}: no CUDA device is visible here (torch.cuda.is_available() is False); "
                         f"use --device cpu, or --device auto")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device {device!r}: give auto, cpu, cuda (every visible GPU, device_map='auto') or "
                         f"cuda:N (one GPU)")
    device_map = "auto" if device == "cuda" else (None if device == "cpu" else {"": device})
    if param_dtype == "auto":
        param_dtype = "fp32" if device == "cpu" else "bf16"
    if param_dtype not in DTYPES:
        raise ValueError(f"--param_dtype {param_dtype!r}: give bf16, fp16, fp32 or auto")
    attn = attn_implementation
    if attn == "auto":
        attn = "flash_attention_2" if device != "cpu" and _flash_importable(flash_available) else "sdpa"
    elif "flash" in attn and (device == "cpu" or not _flash_importable(flash_available)):
        why = "the model is on the CPU" if device == "cpu" else "the flash_attn package is not installed"
        notes.append(f"[serve_rm] --attn_implementation {attn}: {why}; using sdpa (the same scores up to rounding)")
        attn = "sdpa"
    return Placement(device_map, DTYPES[param_dtype], attn, notes)


def _flash_importable(known: Optional[bool]) -> bool:
    if known is not None:
        return known
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


class RewardScorer:
    """The reward model; ``score_batch`` scores one micro-batch (called from one thread at a time).

    ``normalize``: OpenRLHF's ``--normalize_reward`` / ``--reward.normalize_enable``: scores become
    (score - mean) / std with the mean and std saved with the model (``reward_norm_stats``); without it the raw
    score is served, as OpenRLHF serves it."""

    def __init__(self, path: str, batch_size: int = 16, max_len: int = 2048, value_head_prefix=None, log=None,
                 normalize: bool = False, placement: Optional[Placement] = None, **from_pretrained):
        from rlhf.models.load import load_reward_model, load_tokenizer
        from rlhf.rewards.reward_model import score_sequences

        placement = placement or resolve_placement("cpu")
        kwargs = {"dtype": placement.dtype, "attn_implementation": placement.attn_implementation, **from_pretrained}
        if placement.device_map is not None:
            kwargs["device_map"] = placement.device_map
        self.model, _ = load_reward_model(path, value_head_prefix=value_head_prefix, **kwargs)
        self.placement = placement
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        saved = reward_norm_stats(path)
        self.stats = saved if normalize and saved else (0.0, 1.0)
        if normalize and not saved:
            self.log(f"[serve_rm] --normalize_reward: {path} has no saved mean/std (reward_norm.json or config.json's "
                     f"mean, std); serving raw scores")
        elif saved and not normalize:
            self.log(f"[serve_rm] {path} has a saved mean {saved[0]:.4g} / std {saved[1]:.4g}; serving raw scores "
                     f"(OpenRLHF's default): add --normalize_reward to serve (score - mean) / std")
        self.tok = load_tokenizer(path, padding_side="left")
        self.batch_size, self.max_len = batch_size, max_len
        self._score = score_sequences
        self.lock = threading.Lock()
        self.truncated_total = 0
        self.last_padded = 0  # padded tokens of the last micro-batch scored (RewardApp's rate)

    @property
    def device(self) -> torch.device:
        """Where inputs go: the first parameter's device (the embeddings; with device_map="auto" accelerate's
        hooks move activations between the GPUs holding the layers)."""
        return next(self.model.parameters()).device

    def devices(self) -> List[str]:
        return sorted({str(p.device) for p in self.model.parameters()})

    def count_tokens(self, queries: Sequence[str]) -> List[int]:
        """Each query's token count after the cut to --max_len (the work it makes).  Called off the model thread,
        so on a tokenizer of its own (a fast tokenizer is one Rust object; two threads may not reconfigure it)."""
        if getattr(self, "_count_tok", None) is None:
            import copy

            self._count_tok = copy.deepcopy(self.tok)
        return [len(x) for x in tokenize_tails(self._count_tok, queries, self.max_len)[0]]

    def warm_up(self, rows: int, length: int) -> Tuple[int, float]:
        """Score one micro-batch of ``rows`` x ``length`` tokens (on a GPU twice: the first call's set-up cost is
        paid, and a model that does not fit fails now, not at the first request); returns (padded tokens,
        seconds of the timed call)."""
        ids = torch.full((rows, length), self.tok.eos_token_id or 0, dtype=torch.long)
        mask = torch.ones_like(ids)
        with self.lock, torch.inference_mode():
            if self.device.type != "cpu":
                self._score(self.model, ids, mask, self.stats, self.batch_size)
            t0 = time.monotonic()
            self._score(self.model, ids, mask, self.stats, self.batch_size)
            return ids.numel(), time.monotonic() - t0

    def score_batch(self, queries: Sequence[str]) -> Tuple[List[float], List[bool]]:
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        ids, mask, cut = encode_left_truncated(self.tok, queries, self.max_len, pad)
        with self.lock, torch.inference_mode():
            r = self._score(self.model, ids, mask, self.stats, self.batch_size)
        self.last_padded = ids.numel()
        if any(cut):
            if not self.truncated_total:
                i = cut.index(True)
                self.log(f"[serve_rm] a query has more than --max_len {self.max_len} tokens: scored on its last "
                         f"{self.max_len} (the start of the prompt is cut; flagged per row in "
                         f"extra_logs.rm_query_truncated). Query: {queries[i][:200]!r}...")
            self.truncated_total += sum(cut)
        return r.float().tolist(), cut

    def __call__(self, queries: Sequence[str]) -> List[float]:
        out = []
        for s in range(0, len(queries), self.batch_size):
            out += self.score_batch(queries[s:s + self.batch_size])[0]
        return out
