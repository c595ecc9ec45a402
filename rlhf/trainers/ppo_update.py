"""PPO-style updates of the actor (any estimator) and the critic, in micro-batches with accumulation.

Global loss normalisation: before the micro-batches of an optimizer step run, one all_reduce over the
role's process group sums this step's token and sequence counts over every micro-batch on every rank
(``step_totals``).  Each micro-batch loss divides by those totals, so the step's micro-batch losses add up
to the full-batch loss whatever the split; the value handed to ``engine.backward`` is multiplied by
(accumulation steps x data-parallel ranks) because the engines divide by the one and average over the other.
Every rank of the group runs ``step_totals`` once per optimizer step, also with an empty shard, so the
collective sequence is the same on every rank whatever its data.
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Dict, List

import torch

from rlhf.algorithms import LossTotals, aggregate, compute_kl, importance_weights, kl_unbiased_gradient, value_loss
from rlhf.algorithms.is_filter import is_filter_ratio
from rlhf.algorithms.masked import masked_mean
from rlhf.algorithms.registry import POLICY_LOSSES
from rlhf.distributed import comm, shard_rows
from rlhf.models.forward import action_logprobs, packed_action_logprobs


from rlhf.distributed.sequence_parallel import sp_size
def _minibatches(n_rows: int, rank: int, world: int, train_batch_size: int, micro: int, epoch_seed: int):
    """Per optimizer step, this rank's micro-batch row indices (global shuffle, then a DP shard per step).
    Yields once per step on every rank (an empty list when this rank's shard of the step is empty)."""
    g = torch.Generator().manual_seed(epoch_seed)
    perm = torch.randperm(n_rows, generator=g)
    for s in range(0, n_rows, train_batch_size):
        step_rows = perm[s:s + train_batch_size]
        mine = step_rows[shard_rows(step_rows.numel(), rank, world)]
        yield [mine[i:i + micro] for i in range(0, mine.numel(), micro)]


def step_totals(masks: List[torch.Tensor], group=None, replicas: int = 1) -> LossTotals:
    """[tokens, non-empty sequences] of this rank's micro-batch masks, summed over the group: one all_reduce.
    ``replicas``: ranks that hold the same micro-batches (an SP group, --ring_attn_size): each counted once."""
    t = torch.zeros(2, dtype=torch.float64)
    for m in masks:
        m = m.float()
        t[0] += float(m.sum())
        t[1] += float((m.sum(-1) > 0).sum())
    comm.all_reduce(t, group=group)
    return LossTotals(float(t[0]), float(t[1]))


def _mean(d: Dict[str, List[float]]) -> Dict[str, float]:
    return {k: sum(v) / len(v) for k, v in d.items() if v}


class _AuxLossTap:
    """Reads a MoE model's load-balancing ``aux_loss`` from its forward output (HF ``output_router_logits``)."""

    def __init__(self, model, enabled: bool):
        self.value, self.handle = None, None
        if not enabled:
            return
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "output_router_logits"):
            warnings.warn("--aux_loss_coef is set but the model has no MoE router (config.output_router_logits): "
                          "no auxiliary loss to add", UserWarning, stacklevel=3)
            return
        cfg.output_router_logits = True
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        self.value = getattr(out, "aux_loss", None)

    def take(self):
        v, self.value = self.value, None
        return v

    def close(self):
        if self.handle is not None:
            self.handle.remove()


def train_actor(cfg, engine, exp, rank: int, world: int, kl_coef: float, step_seed: int) -> Dict[str, float]:
    a, o, m, r = cfg.algorithm, cfg.optim, cfg.model, cfg.rollout
    model = engine.model
    model.train()
    dev = next(model.parameters()).device
    group = getattr(engine, "group", None)
    temp = r.temperature if r.temperature > 0 else 1.0
    loss_fn = POLICY_LOSSES.get_fn(a.policy_loss_type)
    kl_coef = max(float(kl_coef), 0.0)
    scale = engine.accum_steps * world  # undoes the engine's 1/accum and the DP gradient average
    norm_const = float(cfg.data.generate_max_len)
    ent_grad = a.entropy_loss_coef != 0
    aux = _AuxLossTap(model, a.aux_loss_coef != 0)
    logs = defaultdict(list)
    n = exp.sequences.size(0)
    try:
        for epoch in range(o.max_epochs):
            for micro_rows in _minibatches(n, rank, world, o.train_batch_size, o.micro_train_batch_size,
                                           step_seed * 1000 + epoch, dyn):
                real = [mr for mr in micro_rows if mr.real]
                tot = step_totals([exp.action_mask[mr.rows] for mr in real], group, sp_size(model))
                n_step = max(sum(mr.rows.numel() for mr in real), 1)
                step = defaultdict(float)
                for i, rows in enumerate(micro_rows):
                    mb = exp.rows(rows)
                    mask = mb.action_mask.to(dev).float()
                    if m.packing_samples:  # one packed row, no padding FLOPs
                        logp, ent = packed_action_logprobs(model, mb.sequences.to(dev), mb.attention_mask.to(dev),
                                                           mb.action_mask.to(dev), temp, m.logprob_chunk_size,
                                                           with_entropy=True, entropy_grad=ent_grad,
                                                           keep_bytes=m.lm_head_keep_bytes)
                    else:
                        logp, ent = action_logprobs(model, mb.sequences.to(dev), mb.attention_mask.to(dev),
                                                    mb.action_mask.size(1), temp, m.logprob_chunk_size,
                                                    with_entropy=True, entropy_grad=ent_grad,
                                                    keep_bytes=m.lm_head_keep_bytes)
                    old = logp.detach() if mb.old_logprobs is None else mb.old_logprobs.to(dev)
                    ratio_base, is_w = old, None
                    if a.enable_is_correction:
                        roll = mb.rollout_logprobs.to(dev)
                        if a.policy_loss_type == "gspo":  # OpenRLHF: GSPO's ratio is taken against the rollout
                            ratio_base = roll
                        else:
                            is_w = importance_weights(old, roll, mask, a.is_correction_type,
                                                      a.is_truncated_threshold_low, a.is_truncated_threshold,
                                                      gating=a.is_correction_gating)
                            fr = is_filter_ratio(old, roll, mask, a.is_correction_type, a.is_truncated_threshold_low,
                                                 a.is_truncated_threshold, a.is_correction_gating)  # OpenRLHF 0.11.2
                            if fr is not None:
                                logs["is_filter_ratio"].append(fr)
                        step["vllm_kl"] += float(masked_mean(roll - old, mask)) / max(len(micro_rows), 1)
                    pl, met = loss_fn(logp, ratio_base, mb.advantages.to(dev), mask,
                                      clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
                                      dual_clip=a.dual_clip, agg_mode=a.loss_agg_mode, norm_const=norm_const,
                                      is_weights=is_w, totals=tot, sapo_tau_pos=a.sapo_tau_pos,
                                      sapo_tau_neg=a.sapo_tau_neg)
                    loss = pl
    t /= replicas
                    ent_term = aggregate(ent, mask, "token-mean", totals=tot)  # peers: entropy is token-mean
                    if ent_grad:
                        loss = loss - a.entropy_loss_coef * ent_term
                    if a.use_kl_loss and mb.ref_logprobs is not None:
                        ref = mb.ref_logprobs.to(dev)
                        kl = compute_kl(a.kl_estimator, logp, ref, mask)
                        if a.kl_unbiased_gradient:
                            kl = kl_unbiased_gradient(kl, logp, ref, None if mb.old_logprobs is None else old)
                        kl_loss = aggregate(kl, mask, a.loss_agg_mode, norm_const, tot)
                        loss = loss + kl_coef * kl_loss
                        step["kl_loss"] += float(kl_loss.detach())
                    loss = loss * scale
                    aux_loss = aux.take()
                    if aux_loss is not None:
                        loss = loss + a.aux_loss_coef * aux_loss  # mean over micro-batches and ranks, as OpenRLHF
                        step["aux_loss"] += float(aux_loss.detach()) / len(micro_rows)
                    engine.backward(loss, i)
                    step["policy_loss"] += float(pl.detach())
                    step["entropy"] += float(ent_term.detach())
                    for k, v in met.items():
                        logs[k].append(v)
                # this rank's share of the step's full-batch value, times world: the mean over ranks is the value
                for k in ("policy_loss", "entropy", "kl_loss"):
                    if k in step or k == "policy_loss":
                        logs[k].append(step[k] * world)
                for k in ("aux_loss", "vllm_kl"):
                    if k in step:
                        logs[k].append(step[k])
                for k, v in engine.step().items():
                    logs[k].append(v)
    finally:
        aux.close()
    return _mean(logs)


def train_critic(cfg, engine, exp, rank: int, world: int, step_seed: int) -> Dict[str, float]:
    a, o = cfg.algorithm, cfg.optim
    model = engine.model
    model.train()
    dev = next(model.parameters()).device
    group = getattr(engine, "group", None)
    scale = engine.accum_steps * world
    logs = defaultdict(list)
    n = exp.sequences.size(0)
    for epoch in range(o.max_epochs):
        for micro_rows in _minibatches(n, rank, world, o.train_batch_size, o.micro_train_batch_size,
                                       step_seed * 1000 + epoch + 7, dyn):
            tot = step_totals([exp.action_mask[mr.rows] for mr in micro_rows if mr.real], group, sp_size(model))
            total = 0.0
            for i, rows in enumerate(micro_rows):
                mb = exp.rows(rows)
                mask = mb.action_mask.to(dev).float()
                v = model(mb.sequences.to(dev), mb.attention_mask.to(dev), mb.action_mask.size(1))
                loss, met = value_loss(v, mb.values.to(dev), mb.returns.to(dev), mask, a.value_clip, totals=tot)
                engine.backward(loss * scale, i)
                total += float(loss.detach())
                for k, val in met.items():
                    logs[k].append(val)
            logs["value_loss"].append(total * world)
            for k, val in engine.step().items():
                logs[f"critic_{k}"].append(val)
    return _mean(logs)
