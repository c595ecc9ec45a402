"""Eval metrics over n samples per prompt: pass@1 and pass@n, per data source (OpenRLHF's names).

Mirrors OpenRLHF 0.11.2 ``openrlhf/trainer/ppo_trainer.py`` ``compute_eval_metrics``: the eval rewards are
reshaped to (prompts, n); per data source

    eval_{ds}_pass1 = mean over the source's prompts of  mean_j r_ij
    eval_{ds}_pass{n} = mean over the source's prompts of  max_j r_ij      (only when n > 1)

With 0/1 rewards these are the fraction of correct samples and the fraction of prompts solved by at least one of
their n samples ("any of the n is correct").  They then equal the Codex paper's unbiased estimator
1 - C(n - c, k) / C(n, k) (c correct of n) at its two ends, k = 1 (c / n) and k = n (1 if c > 0), so no second
estimator is offered; with graded rewards they are OpenRLHF's mean and max.  Prompts
without a ``datasource`` column count as ``default`` (OpenRLHF's PromptDataset default), so the usual keys are
``eval_default_pass1`` / ``eval_default_pass4``.  Ours only: invalid rewards (NaN, failed reward calls; see
``reward_invalid``) are left out of a prompt's mean and max, and a prompt without one valid sample is left out of
its source's average (OpenRLHF has no invalid rewards to skip).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch


def pass_at_n(rewards: torch.Tensor, n: int, sources: Optional[List[str]] = None,
              valid: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """{eval_{ds}_pass1, eval_{ds}_pass{n}} from ``rewards`` (prompts * n,), prompt-major (the n samples of a
    prompt are consecutive), ``sources`` one data-source name per prompt (None: all ``default``), ``valid`` a
    (prompts * n,) bool mask (None: the finite rewards).  A source whose prompts have no valid sample at all is
    reported as NaN, never as a 0 that was not measured."""
    r = rewards.detach().float().reshape(-1)
    if n < 1 or r.numel() % n:
        raise ValueError(f"pass_at_n: {r.numel()} rewards do not split into groups of --eval_n_samples_per_prompt {n}")
    prompts = r.numel() // n
    sources = ["default"] * prompts if sources is None else list(sources)
    if len(sources) != prompts:
        raise ValueError(f"pass_at_n: {len(sources)} data sources for {prompts} prompts")
    ok = torch.isfinite(r) if valid is None else (valid.reshape(-1).bool() & torch.isfinite(r))
    r, ok = r.view(prompts, n), ok.view(prompts, n)
    counted = ok.any(1)
    cnt = ok.sum(1).clamp(min=1)
    mean = torch.where(ok, r, torch.zeros_like(r)).sum(1) / cnt
    best = torch.where(ok, r, torch.full_like(r, float("-inf"))).max(1).values
    out: Dict[str, float] = {}
    for ds in dict.fromkeys(sources):  # first-seen order, as OpenRLHF's dict
        rows = torch.tensor([s == ds for s in sources]) & counted
        k = int(rows.sum())
        out[f"eval_{ds}_pass1"] = float(mean[rows].sum()) / k if k else float("nan")
        if n > 1:
            out[f"eval_{ds}_pass{n}"] = float(best[rows].sum()) / k if k else float("nan")
    return out
