"""Token log-probs from logits without materialising a full-vocab softmax for all tokens at once."""
from __future__ import annotations

import torch

Tensor = torch.Tensor


def logprobs_from_logits(logits: Tensor, labels: Tensor, chunk_size: int = 1024, temperature: float = 1.0) -> Tensor:
    """log softmax(z / T)[label] = z_label / T - logsumexp(z / T), in chunks of rows.

    logits (..., V), labels (...) -> (...) float32.  Peak extra memory is one
    chunk_size x V float32 buffer instead of N x V.
    """
    shape = labels.shape
    z = logits.reshape(-1, logits.size(-1))
    y = labels.reshape(-1)
    out = torch.empty(y.shape, dtype=torch.float32, device=logits.device)
    for s in range(0, z.size(0), chunk_size):
        zc = z[s:s + chunk_size].float()
        if temperature != 1.0:
            zc = zc / temperature
        out[s:s + chunk_size] = zc.gather(-1, y[s:s + chunk_size, None]).squeeze(-1) - torch.logsumexp(zc, -1)
    return out.view(shape)


def entropy_chunked(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """H = logsumexp(z) - sum softmax(z) z per row, chunked like logprobs_from_logits."""
    from rlhf.algorithms.policy_loss import entropy_from_logits

    z = logits.reshape(-1, logits.size(-1))
    out = torch.cat([entropy_from_logits(z[s:s + chunk_size]) for s in range(0, z.size(0), chunk_size)])
    return out.view(logits.shape[:-1])
