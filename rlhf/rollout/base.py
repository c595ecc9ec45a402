"""Rollout-engine contract: prompts in, padded sequences + masks + sampling log-probs out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: Tuple[int, ...] = ()
    seed: Optional[int] = None


@dataclass
class RolloutBatch:
    """Rows are ordered prompt-major: the n samples of prompt i are rows [i*n, (i+1)*n)."""
    sequences: torch.Tensor        # (B, P + R) left-padded prompt | right-padded response
    attention_mask: torch.Tensor   # (B, P + R)
    action_mask: torch.Tensor      # (B, R) 1 on generated (model) tokens, incl. the stop token
    rollout_logprobs: torch.Tensor  # (B, R) log-probs under the engine's sampling distribution (temperature-scaled)
    prompt_len: int
    truncated: torch.Tensor = None  # (B,) bool: hit max_new_tokens without a stop token
    rewards: Optional[torch.Tensor] = None  # (B,) set by agent rollouts (the environment scores them)
    scores: Optional[torch.Tensor] = None

    @property
    def response_len(self) -> torch.Tensor:
        return self.action_mask.sum(1)

    def select(self, rows) -> "RolloutBatch":
        """These rows (a view of the same padded widths)."""
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return RolloutBatch(self.sequences[rows], self.attention_mask[rows], self.action_mask[rows],
                            self.rollout_logprobs[rows], self.prompt_len, pick(self.truncated), pick(self.rewards),
                            pick(self.scores))

    @property
    def num_actions(self) -> int:
        return self.action_mask.size(1)


class RolloutEngine:
    def generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams) -> RolloutBatch: ...

    def load_weights(self, named_tensors) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def sleep(self) -> None: ...

    def wake(self, tags=None) -> None: ...


def response_mask(responses: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """1 up to and including the first stop token of each row, 0 after it."""
    is_stop = torch.zeros_like(responses, dtype=torch.bool)
    for s in stop_ids:
        is_stop |= responses == s
    after = (is_stop.long().cumsum(1) - is_stop.long()) > 0
    return (~after).long()


def merge_batches(batches: List[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Concatenate rollout batches with different prompt / response lengths (re-padding both sides)."""
    P = max(b.prompt_len for b in batches)
    R = max(b.num_actions for b in batches)
    seqs, att, am, lp, tr = [], [], [], [], []
    for b in batches:
        lpad, rpad = P - b.prompt_len, R - b.num_actions
        seqs.append(torch.nn.functional.pad(b.sequences, (lpad, rpad), value=pad_id))
        att.append(torch.nn.functional.pad(b.attention_mask, (lpad, rpad), value=0))
        am.append(torch.nn.functional.pad(b.action_mask, (0, rpad), value=0))
        lp.append(torch.nn.functional.pad(b.rollout_logprobs, (0, rpad), value=0.0))
        tr.append(b.truncated)
    return RolloutBatch(torch.cat(seqs), torch.cat(att), torch.cat(am), torch.cat(lp), P, torch.cat(tr))
