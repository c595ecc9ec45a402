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
from dataclasses import replace
from typing import Dict, List, NamedTuple, Optional

import torch

from rlhf.algorithms import LossTotals, aggregate, compute_kl, importance_weights, kl_unbiased_gradient, value_loss
from rlhf.algorithms.is_filter import is_filter_ratio
from rlhf.algorithms.masked import masked_mean
from rlhf.algorithms.registry import POLICY_LOSSES
from rlhf.algorithms.seqlen_balancing import Item, plan_step
from rlhf.distributed import comm, shard_rows
from rlhf.models.forward import action_logprobs, packed_action_logprobs


class Micro(NamedTuple):
    """One micro-batch's row indices; ``real`` False for a dummy forward (a rank with fewer token-budget
    micro-batches than the others runs it on a real row with its loss times 0: FSDP's collectives need the same
    number of forwards and backwards on every rank)."""
    rows: torch.Tensor
    real: bool = True


def row_items(attention_mask: torch.Tensor, action_mask: torch.Tensor) -> List[Item]:
    """Each row's (prompt tokens, response width) for the micro-batcher: the prompt is left-padded (its real
    tokens: the attention mask over the first P columns), the response right-padded (its width: up to its last
    attended or action position)."""
    R = action_mask.size(1)
    P = attention_mask.size(1) - R
    left = attention_mask[:, :P].long().sum(1)
    used = attention_mask[:, P:].bool() | action_mask.bool()
    right = torch.where(used.any(1), R - used.long().flip(1).argmax(1), torch.zeros_like(left))
    return [Item(int(a), max(int(b), 1)) for a, b in zip(left.tolist(), right.tolist())]


class TokenBudget(NamedTuple):
    """--use_dynamic_batch for one batch: its rows' sizes, the per-rank token budget, packed or padded."""
    items: List[Item]
    budget: int
    packed: bool

    def split(self, step_rows: torch.Tensor, rank: int, world: int) -> List[Micro]:
        """This rank's micro-batches of one step (rlhf.algorithms.seqlen_balancing.plan_step: rows over ranks by
        tokens, then by the budget); the same count on every rank, dummies last."""
        _, micro = plan_step([self.items[i] for i in step_rows.tolist()], world, self.budget, self.packed)
        dummy = step_rows[:1]
        return [Micro(step_rows[torch.tensor(m, dtype=torch.long)]) if m is not None else Micro(dummy, False)
                for m in micro[rank]]


def token_budget(cfg, exp, budget: Optional[int] = None) -> Optional[TokenBudget]:
    """The batch's TokenBudget under --use_dynamic_batch (None: fixed --micro_train_batch_size)."""
    if not cfg.optim.use_dynamic_batch:
        return None
    from rlhf.config.batching_checks import row_budgets

    return TokenBudget(row_items(exp.attention_mask, exp.action_mask), budget or row_budgets(cfg)[0],
                       cfg.model.packing_samples)


def _minibatches(n_rows: int, rank: int, world: int, train_batch_size: int, micro: int, epoch_seed: int,
                 dyn: Optional[TokenBudget] = None) -> List[Micro]:
    """Per optimizer step, this rank's micro-batches (global shuffle, then a DP shard per step).
    Yields once per step on every rank (an empty list when this rank's shard of the step is empty).
    Fixed size: ``micro`` rows each, the step's rows split over ranks by count.  ``dyn`` (--use_dynamic_batch):
    the step's rows split over ranks by tokens and into micro-batches by the token budget, every rank the same
    number (``TokenBudget.split``)."""
    g = torch.Generator().manual_seed(epoch_seed)
    perm = torch.randperm(n_rows, generator=g)
    for s in range(0, n_rows, train_batch_size):
        step_rows = perm[s:s + train_batch_size]
        if dyn is not None:
            yield dyn.split(step_rows, rank, world)
            continue
        mine = step_rows[shard_rows(step_rows.numel(), rank, world)]
        yield [Micro(mine[i:i + micro]) for i in range(0, mine.numel(), micro)]


def trim_padding(mb):
    """The micro-batch without the columns none of its rows uses: prompt columns left of its longest prompt and
    response columns right of its longest response (left-padded prompts, right-padded responses).  Positions come
    from the attention mask, so the log-probs are those of the untrimmed rows (up to float rounding)."""
    R = mb.action_mask.size(1)
    P = mb.sequences.size(1) - R
    cols = mb.attention_mask.bool().any(0)
    lead = int(cols[:P].long().argmax()) if bool(cols[:P].any()) else P
    resp = cols[P:] | mb.action_mask.bool().any(0)
    r = int(resp.nonzero().max()) + 1 if bool(resp.any()) else 1
    if lead == 0 and r == R:
        return mb
    cut = lambda t: None if t is None else t[:, :r]  # noqa: E731
    return replace(mb, sequences=mb.sequences[:, lead:P + r], attention_mask=mb.attention_mask[:, lead:P + r],
                   **{f: cut(getattr(mb, f)) for f in ("action_mask", "rollout_logprobs", "old_logprobs",
                                                       "ref_logprobs", "values", "advantages", "returns")})


def micro_batch(exp, micro: Micro, dyn: Optional[TokenBudget]):
    """The rows of one micro-batch; token-budget padded micro-batches drop their all-padding columns."""
    mb = exp.select(micro.rows)
    return trim_padding(mb) if dyn is not None and not dyn.packed else mb


def padding_counts(mb, packed: bool, real: bool) -> tuple:
    """(real tokens, token slots the forward computes) of a micro-batch: a padded forward computes every column of
    every row, a packed one only the real tokens; a dummy forward's tokens are all waste."""
    tokens = float(mb.attention_mask.sum())
    slots = tokens if packed else float(mb.attention_mask.numel())
    return (tokens if real else 0.0), slots


def step_totals(masks: List[torch.Tensor], group=None, replicas: int = 1) -> LossTotals:
    """[tokens, non-empty sequences] of this rank's micro-batch masks, summed over the group: one all_reduce.
    ``replicas``: ranks that hold the same micro-batches (an SP group, --ring_attn_size): each counted once."""
    t = torch.zeros(2, dtype=torch.float64)
    for m in masks:
        m = m.float()
        t[0] += float(m.sum())
        t[1] += float((m.sum(-1) > 0).sum())
    comm.all_reduce(t, group=group)
    t /= replicas
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
    dev = engine.compute_device  # not the parameters' device: --adam_offload keeps FSDP2's shards on the host
    group, replicas = engine.mesh.group, engine.mesh.sp.size  # the role's ranks; an SP group holds the same rows
    temp = r.temperature if r.temperature > 0 else 1.0
    loss_fn = POLICY_LOSSES.bound(a.policy_loss_type)  # each loss takes the keywords it names
    kl_coef = max(float(kl_coef), 0.0)
    scale = engine.accum_steps * world  # undoes the engine's 1/accum and the DP gradient average
    norm_const = float(cfg.data.generate_max_len)
    ent_grad = a.entropy_loss_coef != 0
    aux = _AuxLossTap(model, a.aux_loss_coef != 0)
    logs = defaultdict(list)
    n = exp.sequences.size(0)
    dyn = token_budget(cfg, exp)
    pad = [0.0, 0.0]
    try:
        for epoch in range(o.max_epochs):
            for micro_rows in _minibatches(n, rank, world, o.train_batch_size, o.micro_train_batch_size,
                                           step_seed * 1000 + epoch, dyn):
                real = [mr for mr in micro_rows if mr.real]
                tot = step_totals([exp.action_mask[mr.rows] for mr in real], group, replicas)
                n_step = max(sum(mr.rows.numel() for mr in real), 1)
                step = defaultdict(float)
                logs["micro_batches"].append(float(len(micro_rows)))
                for i, mr in enumerate(micro_rows):
                    mb = micro_batch(exp, mr, dyn)
                    for j, c in enumerate(padding_counts(mb, m.packing_samples, mr.real)):
                        pad[j] += c
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
                            if mask.any():  # the weights' spread: how far off-policy the rows were (issue 29)
                                w = is_w[mask.bool()]
                                logs["is_weight_mean"].append(float(w.mean()))
                                logs["is_weight_min"].append(float(w.min()))
                                logs["is_weight_max"].append(float(w.max()))
                        step["vllm_kl"] += float(masked_mean(roll - old, mask)) * mr.real / max(len(real), 1)
                    pl, met = loss_fn(logp, ratio_base, mb.advantages.to(dev), mask,
                                      clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
                                      dual_clip=a.dual_clip, agg_mode=a.loss_agg_mode, norm_const=norm_const,
                                      is_weights=is_w, totals=tot, sapo_tau_pos=a.sapo_tau_pos,
                                      sapo_tau_neg=a.sapo_tau_neg)
                    loss = pl
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
                        step["kl_loss"] += float(kl_loss.detach()) * mr.real
                    loss = loss * scale
                    aux_loss = aux.take()
                    if aux_loss is not None:
                        # mean over micro-batches and ranks, as OpenRLHF; token-budget micro-batches weigh by rows
                        # (OpenRLHF's dynamic_sample_loss_scale: rows / the rank's step rows)
                        aux_w = engine.accum_steps * mr.rows.numel() / n_step if dyn is not None else 1.0
                        loss = loss + a.aux_loss_coef * aux_w * aux_loss
                        step["aux_loss"] += float(aux_loss.detach()) * mr.real / max(len(real), 1)
                    if not mr.real:  # a dummy forward: collectives only, no gradient
                        loss = loss * 0.0
                    engine.backward(loss, i, last=i == len(micro_rows) - 1 if dyn is not None else None)
                    if not mr.real:
                        continue
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
    out = _mean(logs)
    for k, f in (("is_weight_min", min), ("is_weight_max", max)):  # this rank's extremes, not a mean of them
        if logs.get(k):
            out[k] = f(logs[k])
    out["padding_frac"] = 1.0 - pad[0] / pad[1] if pad[1] else 0.0  # this rank's; token slots that were padding
    return out


def train_critic(cfg, engine, exp, rank: int, world: int, step_seed: int) -> Dict[str, float]:
    a, o = cfg.algorithm, cfg.optim
    model = engine.model
    model.train()
    dev = engine.compute_device  # not the parameters' device: --adam_offload keeps FSDP2's shards on the host
    group, replicas = engine.mesh.group, engine.mesh.sp.size  # the role's ranks; an SP group holds the same rows
    scale = engine.accum_steps * world
    logs = defaultdict(list)
    n = exp.sequences.size(0)
    dyn = token_budget(cfg, exp)
    if dyn is not None:  # the critic's forward is padded (no packed path): budget rows x padded width
        dyn = dyn._replace(packed=False)
    pad = [0.0, 0.0]
    for epoch in range(o.max_epochs):
        for micro_rows in _minibatches(n, rank, world, o.train_batch_size, o.micro_train_batch_size,
                                       step_seed * 1000 + epoch + 7, dyn):
            tot = step_totals([exp.action_mask[mr.rows] for mr in micro_rows if mr.real], group, replicas)
            total = 0.0
            for i, mr in enumerate(micro_rows):
                mb = micro_batch(exp, mr, dyn)
                for j, c in enumerate(padding_counts(mb, False, mr.real)):
                    pad[j] += c
                mask = mb.action_mask.to(dev).float()
                v = model(mb.sequences.to(dev), mb.attention_mask.to(dev), mb.action_mask.size(1))
                loss, met = value_loss(v, mb.values.to(dev), mb.returns.to(dev), mask, a.value_clip, totals=tot)
                engine.backward(loss * scale * float(mr.real), i,
                                last=i == len(micro_rows) - 1 if dyn is not None else None)
                if not mr.real:
                    continue
                total += float(loss.detach())
                for k, val in met.items():
                    logs[k].append(val)
            logs["value_loss"].append(total * world)
            for k, val in engine.step().items():
                logs[f"critic_{k}"].append(val)
    out = _mean(logs)
    out["critic_padding_frac"] = 1.0 - pad[0] / pad[1] if pad[1] else 0.0
    return out
