"""Reward-model scoring on the reward role's ranks."""
from __future__ import annotations

import torch

from rlhf.models.forward import position_ids_from_mask


@torch.no_grad()
def score_sequences(model, sequences: torch.Tensor, attention_mask: torch.Tensor, stats=(0.0, 1.0),
                    micro_batch_size: int = 16) -> torch.Tensor:
    """r = (RM(seq)[last non-pad token] - mean) / std  per row.

    Sequences are left-padded prompts + right-padded responses, so the last real
    token of a row is found from the attention mask, not assumed to be at -1.
    """
    out = []
    for s in range(0, sequences.size(0), micro_batch_size):
        ids, att = sequences[s:s + micro_batch_size], attention_mask[s:s + micro_batch_size]
        base = getattr(model, "model", None) or getattr(model, "base_model")
        h = base(input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att)).last_hidden_state
        last = (torch.arange(att.size(1), device=att.device) * att).argmax(1)
        logits = model.score(h[torch.arange(ids.size(0)), last]).squeeze(-1).float()
        out.append(logits)
    mean, std = stats
    return (torch.cat(out) - mean) / std
