"""Rollout-engine contract: prompts in, padded sequences + masks + sampling log-probs out."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from rlhf.trainers.batch import Batch


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: Tuple[int, ...] = ()
    seed: Optional[int] = None


class RolloutEngine(abc.ABC):
    """What the rollout role needs of an engine.  An abstract base: an engine missing a method fails when built."""

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams) -> Optional[Batch]:
        """params.n samples per prompt, rows prompt-major; None on a rank that reports no rows (non-first TP rank
        of an engine in its own processes)."""

    @abc.abstractmethod
    def load_weights(self, named_tensors) -> None:
        """Load (engine name, full tensor) pairs, one bucket at a time."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """After the last bucket: cached prompts' KV came from the old weights."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Release device memory until wake (a no-op where the platform cannot)."""

    @abc.abstractmethod
    def wake(self, tags=None) -> None:
        """Bring back weights (tags ["weights"]) or everything (None)."""

    def close(self) -> None:
        """Stop processes the engine started (default: none)."""


def response_mask(responses: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """1 up to and including the first stop token of each row, 0 after it."""
    is_stop = torch.zeros_like(responses, dtype=torch.bool)
    for s in stop_ids:
        is_stop |= responses == s
    after = (is_stop.long().cumsum(1) - is_stop.long()) > 0
    return (~after).long()


def batch_from_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], logprobs, truncated,
                    pad_id: int, action_masks=None, rewards=None, scores=None) -> Batch:
    """The padded layout from per-row token lists: prompts left-padded to the longest, responses right-padded
    (at least one slot).  ``action_masks`` defaults to 1 on every response token (agents pass theirs: only
    model tokens are actions); ``logprobs`` are per response token."""
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    B = len(prompts)
    seq = torch.full((B, P + R), pad_id, dtype=torch.long)
    att = torch.zeros((B, P + R), dtype=torch.long)
    am = torch.zeros((B, R), dtype=torch.long)
    lp = torch.zeros((B, R), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq[i, P - len(p):P] = torch.tensor(list(p), dtype=torch.long)
        att[i, P - len(p):P] = 1
        n = len(r)
        if n:
            seq[i, P:P + n] = torch.tensor(list(r), dtype=torch.long)
            att[i, P:P + n] = 1
            am[i, :n] = 1 if action_masks is None else torch.tensor(list(action_masks[i]), dtype=torch.long)
            lp[i, :n] = torch.tensor(list(logprobs[i]), dtype=torch.float32)
    as_t = lambda x, dt: None if x is None else torch.tensor(list(x), dtype=dt)  # noqa: E731
    return Batch(sequences=seq, attention_mask=att, action_mask=am, rollout_logprobs=lp, prompt_len=P,
                 truncated=as_t(truncated, torch.bool), rewards=as_t(rewards, torch.float32),
                 scores=as_t(scores, torch.float32))
