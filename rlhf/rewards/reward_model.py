"""Reward-model scoring on the reward role's ranks."""
from __future__ import annotations

from typing import Optional

import torch

from rlhf.distributed.sequence_parallel import sp_of
from rlhf.models.forward import per_token_scores, position_ids_from_mask, sp_scores


def score_positions(attention_mask: Optional[torch.Tensor] = None, seq_lens=None) -> torch.Tensor:
    """Where a reward model's score is read: each sequence's last attended position (its last real token, the
    eos this library appends), the one rule for RM training (padded and packed), PPO's reward role and serve_rm.

    OpenRLHF's rule (openrlhf/models/model.py ``_get_reward_model`` ``RewardModel.forward``):
    padded ``eos_indices = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1)`` (left or
    right padding alike); packed ``eos_indices = packed_seq_lens.cumsum(0) - 1``. Never from the pad id: where
    pad == eos (many chat checkpoints) transformers' own pooling ("last non-pad token") lands on the token before
    the eos, so a model trained there and scored here (or the reverse) reads two different positions.

    ``attention_mask``: (B, T) -> (B,) column indices; ``seq_lens``: the packed row's lengths -> (n,) indices.
    """
    if seq_lens is not None:
        return torch.as_tensor(seq_lens, dtype=torch.long).cumsum(0) - 1
    return attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1)


def scores_at_positions(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                        position_ids: Optional[torch.Tensor] = None, seq_lens=None) -> torch.Tensor:
    """The score head's output at ``score_positions`` (float32, keeps the graph for training).

    Padded: (B, T) ``input_ids`` + ``attention_mask`` -> (B,); position ids from the mask unless given (left
    padding). Packed: one row, ``position_ids`` restarting per sequence and ``seq_lens`` -> (n,).
    """
    if seq_lens is not None:
        z = per_token_scores(model, input_ids=input_ids, position_ids=position_ids)
        return z[0, score_positions(seq_lens=seq_lens).to(z.device)].float()
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    z = per_token_scores(model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return z[torch.arange(z.size(0), device=z.device), score_positions(attention_mask).to(z.device)].float()


@torch.no_grad()
def score_sequences(model, sequences: torch.Tensor, attention_mask: torch.Tensor, stats=(0.0, 1.0),
                    micro_batch_size: int = 16, device: Optional[torch.device] = None) -> torch.Tensor:
    """r = (RM(seq)[score_positions(mask)] - mean) / std  per row (PPO's reward role, serve_rm).

    Sequences are left-padded prompts + right-padded responses: the position is the mask's last 1, the same
    one RM training reads (``score_positions``).  ``device``: where the inputs go; an engine's model passes
    ``TrainEngine.compute_device`` (its parameters may live on the host, --adam_offload); None: a plain module's
    own parameter device (serve_rm).
    """
    out = []
    dev = device if device is not None else next(model.parameters()).device
    for s in range(0, sequences.size(0), micro_batch_size):
        ids, att = sequences[s:s + micro_batch_size].to(dev), attention_mask[s:s + micro_batch_size].to(dev)
        sp = sp_of(model) is not None  # --ring_attn_size: this rank's slice of the packed rows (rlhf.models.forward)
        out.append((sp_scores(model, ids, att) if sp else scores_at_positions(model, ids, att)).cpu())
    mean, std = stats
    return (torch.cat(out) - mean) / std


def reward_model_stats(normalize_reward: bool, saved: Optional[tuple]) -> tuple:
    """(mean, std) the reward model's score is rescaled by, (r - mean) / std: the stats saved with the model
    (``load_reward_model``) with --normalize_reward, else (0, 1).  OpenRLHF openrlhf/models/model.py (RewardModel:
    ``if not self.training and self.normalize_reward: reward = (reward - self.mean) / self.std``, mean / std from
    config.json, the flag overriding config.json's normalize_reward); reward functions are never rescaled."""
    if not normalize_reward or saved is None:
        return (0.0, 1.0)
    return (float(saved[0]), float(saved[1]))
