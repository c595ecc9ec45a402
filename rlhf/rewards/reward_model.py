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
    dev = next(model.parameters()).device
    for s in range(0, sequences.size(0), micro_batch_size):
        ids, att = sequences[s:s + micro_batch_size].to(dev), attention_mask[s:s + micro_batch_size].to(dev)
        per_token = per_token_scores(model, input_ids=ids, attention_mask=att,
                                     position_ids=position_ids_from_mask(att))
        last = (torch.arange(att.size(1), device=att.device) * att).argmax(1)
        out.append(per_token[torch.arange(ids.size(0)), last].float().cpu())
    mean, std = stats
    return (torch.cat(out) - mean) / std


def per_token_scores(model, **inputs) -> torch.Tensor:
    """The score head's output at every position, (B, T).

    Read with a forward hook during the model's own (root) forward, so an FSDP-sharded
    reward model gathers its parameters as usual, and the pooling transformers does
    (last non-pad token by pad id) is not relied on.
    """
    head = getattr(model, "score", None) or model.get_submodule("base_model.model.score")
    caught = {}
    handle = head.register_forward_hook(lambda mod, inp, out: caught.__setitem__("z", out))
    try:
        model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return caught["z"][..., 0]
