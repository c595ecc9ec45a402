"""The actor: the policy role, which owns its PPO-style update (any registered policy loss and estimator).

One ``update(batch, kl_coef, step)`` runs ``--max_epochs`` passes over the step's rows in optimizer steps of
micro-batches (``ppo_update``: shuffling, token budgets, the global loss totals).  Per micro-batch the loss is the
sum of named terms (rlhf.algorithms):

    loss = policy_loss - entropy_loss_coef * entropy + kl_coef * kl_loss          (then x accum_steps x DP ranks)
           + aux_loss_coef * aux_loss                                            (MoE load balancing)

OpenRLHF's ``PPOTrainer.training_step`` / ``ActorPPOTrainer`` (openrlhf/trainer/ppo_utils) assemble the same
terms; the role and its update in one object follow torchtitan's RL trainer actor
(torchtitan/experiments/rl/actors/trainer.py: the trainer owns its model, optimizer and ``step``).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional

import torch

from rlhf.algorithms import aggregate, compute_kl, importance_weights, kl_unbiased_gradient
from rlhf.algorithms.distill import topk_forward_kl_at
from rlhf.algorithms.is_filter import is_filter_ratio
from rlhf.algorithms.masked import masked_mean
from rlhf.algorithms.registry import POLICY_LOSSES
from rlhf.models import moe
from rlhf.models.forward import action_logprobs, packed_action_logprobs
from rlhf.models.topk_forward import action_logprobs_at
from rlhf.models.vision import batch_images
from rlhf.roles.routing import route_metrics, routed_forward
from rlhf.roles.update_batches import (
    AuxLossTap,
    Micro,
    TokenBudget,
    UpdatingRole,
    mean_logs,
    micro_batch,
    padding_counts,
    step_batches,
    step_totals,
    token_budget,
)


class Actor(UpdatingRole):
    """The policy.  ``algo``: the config's algorithm section (loss type, clipping, KL, entropy, IS correction);
    ``settings``: ``UpdateSettings``.  SFT, RM and DPO train an Actor too, with the supervised loop's
    task loss (rlhf.supervised.trainer) instead of ``update``."""

    def update(self, batch, kl_coef: float, step: int) -> Dict[str, float]:
        """One RL step's optimizer steps on ``batch`` (the step record: sequences, attention_mask, action_mask,
        rollout_logprobs, old_logprobs, ref_logprobs, advantages); this rank's metrics."""
        if self.settings is None:
            raise RuntimeError(f"{self!r} was built without update settings (a supervised trainer's Actor trains "
                               f"through its task loss); build RL actors with rlhf.roles.build.build_roles")
        s, engine, world = self.settings, self.engine, self.dp_size
        engine.model.train()
        aux = AuxLossTap(engine.model, self.algo.aux_loss_coef != 0)
        logs, pad = defaultdict(list), [0.0, 0.0]
        dyn = token_budget(s, batch)
        try:
            for micro_rows in step_batches(s, batch.sequences.size(0), self.dp_index, world, step * 1000, dyn):
                self._optimizer_step(batch, micro_rows, max(float(kl_coef), 0.0), dyn, aux, logs, pad)
        finally:
            aux.close()
            if self.route is not None:
                moe.clear(engine.model)
        out = {**mean_logs(logs), **route_metrics(self)}
        for k, f in (("is_weight_min", min), ("is_weight_max", max)):  # this rank's extremes, not a mean of them
            if logs.get(k):
                out[k] = f(logs[k])
        out["padding_frac"] = 1.0 - pad[0] / pad[1] if pad[1] else 0.0  # this rank's; token slots that were padding
        return out

    def _optimizer_step(self, batch, micro_rows: List[Micro], kl_coef: float, dyn: Optional[TokenBudget], aux,
                        logs, pad: List[float]) -> None:
        """The micro-batches of one optimizer step, then the engine's step; appends this step's metrics."""
        engine, world, s = self.engine, self.dp_size, self.settings
        real = [mr for mr in micro_rows if mr.real]
        tot = step_totals([batch.action_mask[mr.rows] for mr in real], self.group, self.mesh.replicas)
        n_step = max(sum(mr.rows.numel() for mr in real), 1)
        step = defaultdict(float)
        logs["micro_batches"].append(float(len(micro_rows)))
        dynamic = dyn is not None
        for i, mr in enumerate(micro_rows):
            mb = micro_batch(batch, mr, dyn)
            for j, c in enumerate(padding_counts(mb, s.packing_samples, mr.real)):
                pad[j] += c
            loss, pl, ent_term, met = self._micro_loss(mb, mr, tot, kl_coef, len(real), step, logs)
            loss = loss * (engine.accum_steps * world)  # undoes the engine's 1/accum and the DP gradient average
            aux_loss = aux.take()
            if aux_loss is not None:
                # mean over micro-batches and ranks, as OpenRLHF; token-budget micro-batches weigh by rows
                # (OpenRLHF's dynamic_sample_loss_scale: rows / the rank's step rows)
                aux_w = engine.accum_steps * mr.rows.numel() / n_step if dynamic else 1.0
                loss = loss + self.algo.aux_loss_coef * aux_w * aux_loss
                step["aux_loss"] += float(aux_loss.detach()) * mr.real / max(len(real), 1)
            if not mr.real:  # a dummy forward: collectives only, no gradient
                loss = loss * 0.0
            engine.backward(loss, i, last=i == len(micro_rows) - 1 if dynamic else None)
            if not mr.real:
                continue
            step["policy_loss"] += float(pl.detach())
            step["entropy"] += float(ent_term.detach())
            for k, v in met.items():
                logs[k].append(v)
        # this rank's share of the step's full-batch value, times world: the mean over ranks is the value
        for k in ("policy_loss", "entropy", "kl_loss", "opd/topk_kl"):
            if k in step or k == "policy_loss":
                logs[k].append(step[k] * world)
        for k in ("aux_loss", "vllm_kl"):
            if k in step:
                logs[k].append(step[k])
        for k, v in engine.step().items():
            logs[k].append(v)

    def _forward(self, mb, dev, ent_grad: bool):
        """(log-probs, entropy, log-probs of the teacher's top-k ids or None) of the micro-batch's response tokens,
        padded or packed (one row, no padding); the top-k ones with --opd_topk (rlhf.models.topk_forward)."""
        s, model = self.settings, self.engine.model
        kw = dict(with_entropy=True, entropy_grad=ent_grad, keep_bytes=s.lm_head_keep_bytes,
                  images=batch_images(mb, slice(None), dev))  # a vision-language model's images (None: text-only)
        with routed_forward(self.route, "update", mb, slice(None), mb.attention_mask.to(dev), s.packing_samples,
                            keep=True):  # a gradient-checkpointed recompute replays the same ids
            if mb.teacher_topk_ids is not None:  # no sequence split (rlhf.config.teacher_checks); text-only:
                if kw["images"] is not None:
                    raise ValueError("--opd_topk with a vision-language model's images: give --opd_topk 0")
                return action_logprobs_at(model, mb.sequences.to(dev), mb.attention_mask.to(dev),
                                          mb.action_mask.to(dev), mb.teacher_topk_ids.to(dev), s.temperature,
                                          s.logprob_chunk_size, s.packing_samples, True, ent_grad,
                                          s.lm_head_keep_bytes)
            if s.packing_samples:
                return (*packed_action_logprobs(model, mb.sequences.to(dev), mb.attention_mask.to(dev),
                                                mb.action_mask.to(dev), s.temperature, s.logprob_chunk_size, **kw),
                        None)
            return (*action_logprobs(model, mb.sequences.to(dev), mb.attention_mask.to(dev), mb.action_mask.size(1),
                                     s.temperature, s.logprob_chunk_size, **kw), None)

    def _micro_loss(self, mb, mr: Micro, tot, kl_coef: float, n_real: int, step, logs):
        """(loss, policy loss, entropy term, policy-loss metrics) of one micro-batch, before the backward scale:
        policy_loss - entropy_loss_coef * entropy + kl_coef * kl_loss (+ opd_coef * the top-k KL, --opd_topk)."""
        a = self.algo
        dev = self.engine.compute_device  # not the parameters' device: --adam_offload keeps FSDP2's shards on the host
        ent_grad = a.entropy_loss_coef != 0
        mask = mb.action_mask.to(dev).float()
        logp, ent, at_k = self._forward(mb, dev, ent_grad)
        old = logp.detach() if mb.old_logprobs is None else mb.old_logprobs.to(dev)
        ratio_base, is_w = old, None
        if a.enable_is_correction:
            ratio_base, is_w = self._is_correction(mb, old, mask, logs)
            step["vllm_kl"] += float(masked_mean(mb.rollout_logprobs.to(dev) - old, mask)) * mr.real / max(n_real, 1)
        pl, met = POLICY_LOSSES.bound(a.policy_loss_type)(  # each loss takes the keywords it names

            logp, ratio_base, mb.advantages.to(dev), mask, clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
            dual_clip=a.dual_clip, agg_mode=a.loss_agg_mode, norm_const=float(self.settings.generate_max_len),
            is_weights=is_w, totals=tot, sapo_tau_pos=a.sapo_tau_pos, sapo_tau_neg=a.sapo_tau_neg)
        loss = pl
        ent_term = aggregate(ent, mask, "token-mean", totals=tot)  # peers: entropy is token-mean
        if ent_grad:
            loss = loss - a.entropy_loss_coef * ent_term
        if a.use_kl_loss and mb.ref_logprobs is not None:
            ref = mb.ref_logprobs.to(dev)
            kl = compute_kl(a.kl_estimator, logp, ref, mask)
            if a.kl_unbiased_gradient:
                kl = kl_unbiased_gradient(kl, logp, ref, None if mb.old_logprobs is None else old)
            kl_loss = aggregate(kl, mask, a.loss_agg_mode, float(self.settings.generate_max_len), tot)
            loss = loss + kl_coef * kl_loss
            step["kl_loss"] += float(kl_loss.detach()) * mr.real
        if at_k is not None:  # --opd_topk: KL_k(teacher || student) over the teacher's top k, per token
            kl_k = aggregate(topk_forward_kl_at(at_k, mb.teacher_topk_logprobs.to(dev)), mask, a.loss_agg_mode,
                             float(self.settings.generate_max_len), tot)
            loss = loss + mb.opd_topk_coef * kl_k
            step["opd/topk_kl"] += float(kl_k.detach()) * mr.real
        return loss, pl, ent_term, met

    def _is_correction(self, mb, old: torch.Tensor, mask: torch.Tensor, logs):
        """--enable_is_correction: (the ratio's base, the importance weights).  GSPO takes its ratio against the
        rollout's log-probs (OpenRLHF); the others weigh by truncated / masked rollout-vs-train ratios."""
        a = self.algo
        roll = mb.rollout_logprobs.to(old.device)
        if a.policy_loss_type == "gspo":
            return roll, None
        is_w = importance_weights(old, roll, mask, a.is_correction_type, a.is_truncated_threshold_low,
                                  a.is_truncated_threshold, gating=a.is_correction_gating)
        fr = is_filter_ratio(old, roll, mask, a.is_correction_type, a.is_truncated_threshold_low,
                             a.is_truncated_threshold, a.is_correction_gating)  # OpenRLHF 0.11.2
        if fr is not None:
            logs["is_filter_ratio"].append(fr)
        if mask.any():  # the weights' spread: how far off-policy the rows were (issue 29)
            w = is_w[mask.bool()]
            logs["is_weight_mean"].append(float(w.mean()))
            logs["is_weight_min"].append(float(w.min()))
            logs["is_weight_max"].append(float(w.max()))
        return old, is_w
