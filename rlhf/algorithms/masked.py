"""Masked reductions used by every formula."""
from __future__ import annotations

from typing import Optional

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) over dim (all dims when None)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(x * mask) / max(sum(mask), 1) over dim."""
    mask = mask.to(x.dtype)
    if dim is None:
        return masked_sum(x, mask) / mask.sum().clamp(min=1.0)
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of x (Bessel-corrected when unbiased)."""
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_sum((x - mean) ** 2, mask) / n.clamp(min=1.0)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  std: bool = True) -> torch.Tensor:
    """(x - mean) * rsqrt(max(var, eps)) over masked entries, var biased (divided by N) - OpenRLHF's
    convention for the global advantage whitening.  std=False (--no_advantage_std_norm) only centres.
    Masked-out entries become 0."""
    mean = masked_mean(x, mask)
    out = x - mean
    if std:
        out = out * torch.rsqrt(masked_var(x, mask, unbiased=False).clamp(min=eps))
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)
