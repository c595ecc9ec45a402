"""Continuous batching for the HF rollout engine: the running requests decode together, one token per step;
a request admitted between steps joins the batch (its prompt prefilled, its KV cache merged in), a request that
finishes leaves it (vLLM's scheduler does the same with paged KV blocks, vllm/v1/core/sched/scheduler.py).

The batch is left-padded: row b's KV cache holds ``mask[b].sum()`` real positions at the right end of the
``T`` cached columns, pads (mask 0) before them.  Merging two batches left-pads the shorter cache with zero
columns (masked out); leading columns that are padding in every row are cut when rows leave.  Position ids
are counted per row (pos = real tokens before it), so a row's logits are those of the row decoded alone, up
to float rounding of the masked attention (fp32: within 1e-5, tested).

Sampling per row: rows without a seed share one draw per sampling setting (``sampling.next_tokens``); a seeded
request draws from its own ``torch.Generator`` (one per request: its tokens do not depend on which requests
share its steps, and equal a single-request ``HFEngine.generate`` with that seed)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from rlhf.engines.requests import Completion, Request, StepResult
from rlhf.engines.sampling import _new_cache, logits_head, next_tokens


@dataclass
class Row:
    """One running request: its stop ids, its token budget (``limit``), its generator (seeded requests) and what it
    produced so far."""
    request: Request
    stop: Tuple[int, ...]
    limit: int
    generator: Optional[torch.Generator]
    tokens: List[int]
    logprobs: List[float]


def continuous_cache_ok(model) -> bool:
    """Does the model's cache consist of full-attention ``DynamicLayer``s only (what ``merge_caches`` pads)?
    Sliding-window and linear-attention layers keep other state: such models run each admitted request whole."""
    from transformers.cache_utils import DynamicLayer

    _, cache = _new_cache(model)
    layers = getattr(cache, "layers", None)  # transformers' DynamicCache, not an engine: layers or legacy tuples
    return layers is not None and all(type(layer) is DynamicLayer for layer in layers)


def _pad_left(t: torch.Tensor, cols: int, dim: int) -> torch.Tensor:
    if cols == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [cols, 0]
    return F.pad(t, pad)


def merge_caches(a, mask_a: torch.Tensor, b, mask_b: torch.Tensor) -> torch.Tensor:
    """Append cache ``b``'s rows to cache ``a`` (in place): the shorter one left-padded with zero columns; returns
    the merged (Ba + Bb, T) mask."""
    ta, tb = mask_a.size(1), mask_b.size(1)
    t = max(ta, tb)
    for la, lb in zip(a.layers, b.layers):
        la.keys = torch.cat([_pad_left(la.keys, t - ta, 2), _pad_left(lb.keys, t - tb, 2)], 0)
        la.values = torch.cat([_pad_left(la.values, t - ta, 2), _pad_left(lb.values, t - tb, 2)], 0)
    return torch.cat([_pad_left(mask_a, t - ta, 1), _pad_left(mask_b, t - tb, 1)], 0)


def trim_leading(cache, mask: torch.Tensor) -> torch.Tensor:
    """Cut the leading columns that are padding in every row; returns the trimmed mask."""
    real = mask.any(0).nonzero()
    k = int(real[0]) if real.numel() else 0
    if k == 0:
        return mask
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, k:], layer.values[:, :, k:]
    return mask[:, k:]


class ContinuousDecoder:
    """The running batch of one HF engine.  ``step(admit, abort)`` is ``RolloutEngine.step_requests``; at most
    ``max_rows`` requests decode together, admitted ones beyond that wait (first come, first admitted), as vLLM's
    waiting queue holds requests its KV budget cannot take yet."""

    def __init__(self, model, device, pad_id: int, stop_for, max_model_len: Optional[int], max_rows: int = 1 << 30):
        self.model, self.device, self.pad_id = model, device, pad_id
        self.max_rows = max(1, max_rows)  # rows decoded together (the engine's micro batch); the rest wait in order
        self.waiting: List[Request] = []
        self.stop_for, self.max_model_len = stop_for, max_model_len  # stop_for(params) -> stop ids
        self.kw = _new_cache(model)[0]  # the forward's keyword for the cache
        self.rows: List[Row] = []
        self.cache = self.mask = self.logits = self.last = None
        self._head = None   # the logits head, entered while requests run (``sampling.logits_head``)
        self._stack: Optional[contextlib.ExitStack] = None

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    # ---- admission -----------------------------------------------------------------------------------------------
    def _row(self, r: Request) -> Row:
        limit = r.params.max_new_tokens
        if self.max_model_len:  # vLLM: a generation stops at max_model_len (finish reason "length"), at least 1
            limit = min(limit, max(1, self.max_model_len - len(r.prompt_ids)))
        gen = None
        if r.params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(r.params.seed))
        return Row(r, tuple(self.stop_for(r.params)), max(1, int(limit)), gen, [], [])

    def _admit(self, reqs: Sequence[Request]) -> None:
        if not reqs:
            return
        if self._stack is None:
            self._stack = contextlib.ExitStack()
            self._head = self._stack.enter_context(logits_head(self.model))
        P = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), P), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, P - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, P - len(r.prompt_ids):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp_(min=0)
        kw, cache = _new_cache(self.model)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{kw: cache})
        logits, last = self._head(out.logits[:, -1]).float(), pos[:, -1:]
        if self.cache is None:
            self.cache, self.mask, self.logits, self.last = cache, mask, logits, last
        else:
            self.mask = merge_caches(self.cache, self.mask, cache, mask)
            self.logits, self.last = torch.cat([self.logits, logits]), torch.cat([self.last, last])
        self.rows += [self._row(r) for r in reqs]

    def _keep(self, keep: List[int]) -> None:
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.logits = self.last = None
            self._stack.close()
            self._stack = self._head = None
            return
        idx = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.logits, self.last = self.mask[idx], self.logits[idx], self.last[idx]
        self.mask = trim_leading(self.cache, self.mask)

    # ---- one step ------------------------------------------------------------------------------------------------
    def _sample(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """One token and its log-prob per row: unseeded rows of one setting in one draw, seeded rows each alone."""
        B = len(self.rows)
        tok = torch.empty(B, dtype=torch.long, device=self.logits.device)
        lp = torch.empty(B, dtype=torch.float32, device=self.logits.device)
        groups: Dict[tuple, List[int]] = {}
        for i, row in enumerate(self.rows):
            p = row.request.params
            key = (p.temperature, p.top_k, p.top_p, i if row.generator is not None else -1)
            groups.setdefault(key, []).append(i)
        for (temp, top_k, top_p, _), rows in groups.items():
            idx = torch.tensor(rows, device=self.logits.device)
            t, l_ = next_tokens(self.logits[idx], temp, top_k, top_p, self.rows[rows[0]].generator)
            tok[idx], lp[idx] = t.squeeze(1), l_
        return tok, lp

    def step(self, admit: Sequence[Request], abort: Sequence[str] = ()) -> StepResult:
        self.waiting += list(admit)
        if abort:
            gone = set(abort)
            self.waiting = [r for r in self.waiting if r.request_id not in gone]
            self._keep([i for i, r in enumerate(self.rows) if r.request.request_id not in gone])
        room = self.max_rows - len(self.rows)
        now, self.waiting = self.waiting[:room], self.waiting[room:]
        self._admit(now)
        if not self.rows:
            return StepResult([], 0)
        running = len(self.rows)
        tok, lp = self._sample()
        finished, keep = [], []
        for i, (row, t, l_) in enumerate(zip(self.rows, tok.tolist(), lp.tolist())):
            row.tokens.append(t)
            row.logprobs.append(l_)
            if t in row.stop or len(row.tokens) >= row.limit:
                finished.append(Completion(row.request.request_id, row.tokens, row.logprobs,
                                           "stop" if t in row.stop else "length"))
            else:
                keep.append(i)
        self._keep(keep)
        if self.rows:
            self._forward(tok[torch.tensor(keep, device=tok.device)].unsqueeze(1))
        return StepResult(finished, running)

    def _forward(self, tok: torch.Tensor) -> None:
        self.last = self.last + 1
        mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        out = self.model(input_ids=tok, attention_mask=mask, position_ids=self.last, use_cache=True,
                         **{self.kw: self.cache})
        self.mask, self.logits = mask, self._head(out.logits[:, -1]).float()
