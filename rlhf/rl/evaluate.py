"""Evaluation of an RL run: the eval prompts generated with the eval sampling (--eval_temperature,
--eval_n_samples_per_prompt), scored as in training, reduced to the mean reward, the response length and
pass@1 / pass@n per datasource; with --log_val_generations, a fixed sample of them logged as text.

OpenRLHF ``openrlhf/trainer/ppo_trainer.py`` (``evaluate``, ``compute_eval_metrics``); veRL
``verl/trainer/ppo/ray_trainer.py`` (``_validate``, ``_maybe_log_val_generations``).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from rlhf.algorithms.eval_metrics import pass_at_n
from rlhf.batch import Batch
from rlhf.rl.components import decode_queries


def generation_rows(tokenizer, batch: Batch, res: Batch, labels: List, k: int) -> List[dict]:
    """``k`` eval samples as {prompt, response, label, reward} (reward None when invalid): rows drawn with a fixed
    seed, so every eval logs the same prompts' samples (veRL ``_maybe_log_val_generations``: a fixed-seed shuffle,
    then the first N)."""
    n = batch.sequences.size(0)
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(42))[:k].sort().values
    queries, prompts = decode_queries(tokenizer, batch.select(rows), slice(None))
    out = []
    for i, q, p in zip(rows.tolist(), queries, prompts):
        ok = bool(res.valid[i]) and bool(torch.isfinite(res.rewards[i]))
        out.append({"prompt": p, "response": q[len(p):], "label": labels[i],
                    "reward": float(res.rewards[i]) if ok else None})
    return out


def eval_metrics(batch: Batch, res: Batch, n: int, sources: List[str]) -> Dict[str, float]:
    """The mean valid reward, the mean response length, the sample count, each reward term's mean and
    eval_{datasource}_pass1 / _pass{n} (``sources``: each prompt's datasource); from the gathered rewards every
    rank holds (no collective)."""
    r, valid = res.rewards, res.valid
    out = {"reward": float(r[valid].mean()) if valid.any() else float("nan"),
           "response_len": float(batch.action_mask.sum(1).float().mean()), "samples": float(r.numel())}
    out.update({f"reward_{k}": float(v.mean()) for k, v in res.extra_logs.items()})
    out.update(pass_at_n(r, n, sources, valid))
    return out


class Evaluator:
    """One eval pass over ``prompts`` (the same list on every rank; none: eval off), ``n`` samples each, under the
    watchdog's "eval" deadline, the rollout and reward roles woken by the scheduler; ``sources``: formatted prompt
    -> datasource; ``k`` generations logged by rank 0 (--log_val_generations)."""

    def __init__(self, prompts: list, sources: dict, n: int, k: int, *, rollouts, sampler, scorer, watchdog, scheduler,
                 tokenizer, logger, rank: int):
        self.prompts, self.sources, self.n, self.k = prompts, sources, n, k
        self.rollouts, self.sampler, self.scorer = rollouts, sampler, scorer
        self.watchdog, self.scheduler = watchdog, scheduler
        self.tokenizer, self.logger, self.rank = tokenizer, logger, rank

    def run(self, step: int, roles) -> Dict[str, float]:
        if not self.prompts:
            return {}
        st = Batch(step=step, prompts=self.prompts, n_samples=self.n)
        with self.watchdog.phase("eval"):
            with self.scheduler.phase("eval_rollout", role="rollout"):
                batch = self.rollouts.generate(roles, self.prompts, self.sampler.params(step, eval_mode=True))
            with self.scheduler.phase("eval_reward", role="reward"):
                res = self.scorer.score(batch, roles, st.labels)
        out = eval_metrics(batch, res, self.n, [self.sources.get(p.prompt, "default") for p in self.prompts])
        if self.k > 0 and self.rank == 0:  # decoding only, on the rank that writes the logs
            self.logger.log_generations(step, generation_rows(self.tokenizer, batch, res, st.labels, self.k))
        return out
