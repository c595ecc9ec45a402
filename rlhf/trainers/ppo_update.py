"""PPO-style updates of the actor (any estimator) and the critic, in micro-batches with accumulation."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List

import torch

from rlhf.algorithms import aggregate, compute_kl, importance_weights, value_loss
from rlhf.algorithms.registry import POLICY_LOSSES
from rlhf.distributed import shard_rows
from rlhf.models.forward import action_logprobs, packed_action_logprobs


def _minibatches(n_rows: int, rank: int, world: int, train_batch_size: int, micro: int, epoch_seed: int):
    """Per optimizer step, this rank's micro-batch row indices (global shuffle, then a DP shard per step)."""
    g = torch.Generator().manual_seed(epoch_seed)
    perm = torch.randperm(n_rows, generator=g)
    for s in range(0, n_rows, train_batch_size):
        step_rows = perm[s:s + train_batch_size]
        mine = step_rows[shard_rows(step_rows.numel(), rank, world)]
        yield [mine[i:i + micro] for i in range(0, mine.numel(), micro)]


def _mean(d: Dict[str, List[float]]) -> Dict[str, float]:
    return {k: sum(v) / len(v) for k, v in d.items() if v}


def train_actor(cfg, engine, exp, rank: int, world: int, kl_coef: float, step_seed: int) -> Dict[str, float]:
    a, o, m, r = cfg.algorithm, cfg.optim, cfg.model, cfg.rollout
    model = engine.model
    model.train()
    dev = next(model.parameters()).device
    temp = r.temperature if r.temperature > 0 else 1.0
    loss_fn = POLICY_LOSSES.get_fn(a.policy_loss_type)
    logs = defaultdict(list)
    n = exp.sequences.size(0)
    for epoch in range(o.max_epochs):
        for micro_rows in _minibatches(n, rank, world, o.train_batch_size, o.micro_train_batch_size,
                                       step_seed * 1000 + epoch):
            for i, rows in enumerate(micro_rows):
                mb = exp.rows(rows)
                mask = mb.action_mask.to(dev).float()
                if m.packing_samples:  # one packed row, no padding FLOPs
                    logp, ent = packed_action_logprobs(model, mb.sequences.to(dev), mb.attention_mask.to(dev),
                                                       mb.action_mask.to(dev), temp, m.logprob_chunk_size,
                                                       with_entropy=True, entropy_grad=a.entropy_loss_coef > 0)
                else:
                    logp, ent = action_logprobs(model, mb.sequences.to(dev), mb.attention_mask.to(dev),
                                                mb.action_mask.size(1), temp, m.logprob_chunk_size,
                                                with_entropy=True, entropy_grad=a.entropy_loss_coef > 0)
                old = logp.detach() if mb.old_logprobs is None else mb.old_logprobs.to(dev)
                is_w = None
                if a.enable_is_correction:
                    is_w, _ = importance_weights(old, mb.rollout_logprobs.to(dev), mask,
                                                 a.is_truncated_threshold)
                pl, met = loss_fn(logp, old, mb.advantages.to(dev), mask,
                                  clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high, dual_clip=a.dual_clip,
                                  agg_mode=a.loss_agg_mode, norm_const=float(cfg.data.generate_max_len),
                                  is_weights=is_w)
                loss = pl
                ent_mean = aggregate(ent, mask, "token-mean")
                if a.entropy_loss_coef > 0:
                    loss = loss - a.entropy_loss_coef * aggregate(ent, mask, a.loss_agg_mode,
                                                                  float(cfg.data.generate_max_len))
                if a.use_kl_loss and mb.ref_logprobs is not None:
                    kl_loss = aggregate(compute_kl(a.kl_estimator, logp, mb.ref_logprobs.to(dev), mask), mask,
                                        a.loss_agg_mode, float(cfg.data.generate_max_len))
                    loss = loss + kl_coef * kl_loss
                    logs["kl_loss"].append(float(kl_loss.detach()))
                engine.backward(loss, i)
                logs["policy_loss"].append(float(pl.detach()))
                logs["entropy"].append(float(ent_mean))
                for k, v in met.items():
                    logs[k].append(v)
            for k, v in engine.step().items():
                logs[k].append(v)
    return _mean(logs)


def train_critic(cfg, engine, exp, rank: int, world: int, step_seed: int) -> Dict[str, float]:
    a, o = cfg.algorithm, cfg.optim
    model = engine.model
    model.train()
    dev = next(model.parameters()).device
    logs = defaultdict(list)
    n = exp.sequences.size(0)
    for epoch in range(o.max_epochs):
        for micro_rows in _minibatches(n, rank, world, o.train_batch_size, o.micro_train_batch_size,
                                       step_seed * 1000 + epoch + 7):
            for i, rows in enumerate(micro_rows):
                mb = exp.rows(rows)
                mask = mb.action_mask.to(dev).float()
                v = model(mb.sequences.to(dev), mb.attention_mask.to(dev), mb.action_mask.size(1))
                loss, met = value_loss(v, mb.values.to(dev), mb.returns.to(dev), mask, a.value_clip)
                engine.backward(loss, i)
                logs["value_loss"].append(float(loss))
                for k, val in met.items():
                    logs[k].append(val)
            for k, val in engine.step().items():
                logs[f"critic_{k}"].append(val)
    return _mean(logs)
