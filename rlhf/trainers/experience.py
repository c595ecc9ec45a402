"""One RL step's experience: rollout -> rewards -> ref / critic / old log-probs -> advantages.

Each role computes its shard of the global batch on its own ranks; the shards
are all-gathered over the world so every rank holds the same full batch (token
ids and per-token floats only, never weights).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from rlhf.algorithms import ADVANTAGE_ESTIMATORS
from rlhf.distributed import all_gather_padded, shard_rows
from rlhf.models.forward import action_logprobs, packed_action_logprobs
from rlhf.rewards.reward_model import score_sequences
from rlhf.rollout.base import RolloutBatch, SamplingParams

from .advantage_stage import StageInputs, advantage_stage, needs_old_logprobs


@dataclass
class Experience:
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: Optional[torch.Tensor]
    values: Optional[torch.Tensor]
    advantages: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor
    metrics: Dict[str, float] = field(default_factory=dict)

    def rows(self, idx) -> "Experience":
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return Experience(*(pick(getattr(self, f)) for f in (
            "sequences", "attention_mask", "action_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs", "values",
            "advantages", "returns", "scores")), metrics={})


def gather_rows(x: Optional[torch.Tensor], n_rows: int, pad=0, dtype=torch.float32) -> torch.Tensor:
    """All-gather row shards over the world (ranks without the role pass None; every rank must agree on dtype)."""
    if x is None:
        x = torch.zeros((0, 1), dtype=dtype)
    x = x.to(dtype)
    out = all_gather_padded(x, None, pad)
    assert out.size(0) == n_rows, f"gathered {out.size(0)} rows, expected {n_rows}"
    return out


def world_shard(n: int) -> slice:
    """This rank's rows when every rank takes a share (reward functions, agent scores)."""
    if not dist.is_initialized():
        return slice(0, n)
    return shard_rows(n, dist.get_rank(), dist.get_world_size())


def role_shard(groups, role: str, n: int) -> Optional[slice]:
    if not groups.has(role):
        return None
    return shard_rows(n, groups.role_rank(role), groups.role_size(role))


def generate_shard(roles, groups, prompts, params: SamplingParams) -> Optional[RolloutBatch]:
    """This rank's engine generates for its engine's shard of prompts (engine leaders only report rows)."""
    if roles.rollout is None:
        return None
    plan = groups.plan
    e = plan.engine_of(groups.rank)
    sl = shard_rows(len(prompts), e, len(plan.engines))
    mine = prompts[sl]
    if roles.agent is not None:
        batch = roles.agent.run([p.ids for p in mine], [p.prompt for p in mine], [p.label for p in mine], params)
    else:
        batch = roles.rollout.generate([p.ids for p in mine], params)
    return batch if plan.engines[e][0] == groups.rank else None


def gather_rollout(local: Optional[RolloutBatch], n_rows: int, pad_id: int, with_rewards: bool = False
                   ) -> RolloutBatch:
    """Full RolloutBatch on every rank, with prompts re-aligned to a common left padding."""
    if local is None:
        P = torch.zeros(1, dtype=torch.long)
    else:
        P = torch.tensor([local.prompt_len])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(P, op=dist.ReduceOp.MAX)
    P = int(P)
    if local is not None and local.prompt_len < P:
        lp = P - local.prompt_len
        pad = torch.nn.functional.pad
        local = RolloutBatch(pad(local.sequences, (lp, 0), value=pad_id), pad(local.attention_mask, (lp, 0)),
                             local.action_mask, local.rollout_logprobs, P, local.truncated, local.rewards,
                             local.scores)
    if local is None:
        empty_l, empty_f = torch.zeros((0, P), dtype=torch.long), torch.zeros((0, 1))
        seq, att, am, lp, tr = empty_l, empty_l, empty_l[:, :1], empty_f, torch.zeros((0, 1), dtype=torch.long)
    else:
        seq, att, am, lp = local.sequences, local.attention_mask, local.action_mask, local.rollout_logprobs
        tr = local.truncated.long().unsqueeze(1)
    seq = gather_rows(seq, n_rows, pad_id, torch.long)
    att = gather_rows(att, n_rows, 0, torch.long)
    am = gather_rows(am, n_rows, 0, torch.long)
    lp = gather_rows(lp, n_rows, 0.0)
    tr = gather_rows(tr, n_rows, 0, torch.long).squeeze(1).bool()
    R = am.size(1)
    seq, att = seq[:, :P + R], att[:, :P + R]
    if seq.size(1) < P + R:  # response slot of a shard shorter than the longest
        extra = P + R - seq.size(1)
        seq = torch.nn.functional.pad(seq, (0, extra), value=pad_id)
        att = torch.nn.functional.pad(att, (0, extra))
    rewards = scores = None
    if with_rewards:
        rewards = gather_rows(None if local is None else local.rewards.unsqueeze(1), n_rows).squeeze(1)
        scores = gather_rows(None if local is None else local.scores.unsqueeze(1), n_rows).squeeze(1)
    return RolloutBatch(seq, att, am, lp, P, tr, rewards, scores)


def micro_slices(sl: slice, n_rows: int, group_size: int, micro: int) -> List[Optional[slice]]:
    """This rank's rows cut into as many micro-batches as the largest shard of the group needs.

    Sharded (FSDP2) forwards are collectives: every rank of the role group must run the
    same number of them.  A rank with fewer rows gets ``None`` entries (a dummy forward).
    """
    k = max(1, math.ceil(math.ceil(n_rows / group_size) / micro))
    local = sl.stop - sl.start
    bounds = torch.linspace(0, local, k + 1).round().long().tolist()
    return [slice(sl.start + a, sl.start + b) if b > a else None for a, b in zip(bounds, bounds[1:])]


def _run_micro(fn, batch: RolloutBatch, sl: slice, groups, role: str, micro: int, width: int):
    outs = []
    for part in micro_slices(sl, batch.sequences.size(0), groups.role_size(role), micro):
        y = fn(part if part is not None else slice(0, 1))
        if part is not None:
            outs.append(y.cpu())
    return torch.cat(outs) if outs else torch.zeros((0, width))


@torch.no_grad()
def forward_logprobs_shard(engine, batch: RolloutBatch, sl: Optional[slice], temperature: float, micro: int,
                           chunk: int, packing: bool, groups, role: str) -> Optional[torch.Tensor]:
    if engine is None or sl is None:
        return None
    model = engine.model
    dev = next(model.parameters()).device

    def fn(p):
        ids, att = batch.sequences[p].to(dev), batch.attention_mask[p].to(dev)
        if packing:
            return packed_action_logprobs(model, ids, att, batch.action_mask[p].to(dev), temperature, chunk)
        return action_logprobs(model, ids, att, batch.num_actions, temperature, chunk)[0]

    return _run_micro(fn, batch, sl, groups, role, micro, batch.num_actions)


@torch.no_grad()
def values_shard(engine, batch: RolloutBatch, sl: Optional[slice], micro: int, groups) -> Optional[torch.Tensor]:
    if engine is None or sl is None:
        return None
    dev = next(engine.model.parameters()).device
    fn = lambda p: engine.model(batch.sequences[p].to(dev), batch.attention_mask[p].to(dev), batch.num_actions)  # noqa: E731
    return _run_micro(fn, batch, sl, groups, "critic", micro, batch.num_actions)


def decode_queries(tokenizer, batch: RolloutBatch, sl: slice):
    """(query = prompt + response text, prompt text) for rows sl, decoded in one batch call each."""
    P = batch.prompt_len
    seq, att, am = batch.sequences[sl].tolist(), batch.attention_mask[sl, :P].tolist(), batch.action_mask[sl].tolist()
    p_ids = [[t for t, k in zip(s[:P], m) if k] for s, m in zip(seq, att)]
    r_ids = [[t for t, k in zip(s[P:], m) if k] for s, m in zip(seq, am)]
    prompts = tokenizer.batch_decode(p_ids, skip_special_tokens=False)
    responses = tokenizer.batch_decode(r_ids, skip_special_tokens=True)
    return [p + r for p, r in zip(prompts, responses)], prompts


def reward_shard(roles, groups, reward_source, tokenizer, batch: RolloutBatch, labels: List, micro: int):
    """{rewards, scores, valid, extra_logs} for this rank's shard, or None when this rank scores nothing.

    A reward model scores on the reward role's ranks; a reward function is called by
    every rank on its own shard of the batch (so remote servers see parallel requests).
    """
    n = batch.sequences.size(0)
    if batch.rewards is not None:  # agent rollouts: the environment already scored every row
        sl = world_shard(n)
        if sl.stop <= sl.start:
            return None
        r = batch.rewards[sl]
        return {"rewards": r, "scores": batch.scores[sl], "valid": torch.isfinite(r), "extra_logs": {}}
    if groups.plan.roles.get("reward"):
        sl = role_shard(groups, "reward", n)
        if sl is None:
            return None
        r = _run_micro(lambda p: score_sequences(roles.reward.model, batch.sequences[p], batch.attention_mask[p],
                                                 roles.reward_stats, micro).unsqueeze(1),
                       batch, sl, groups, "reward", micro, 1).squeeze(1)
        return {"rewards": r, "scores": r, "valid": torch.ones_like(r, dtype=torch.bool), "extra_logs": {}}
    sl = world_shard(n)
    if sl.stop <= sl.start:
        return None
    queries, prompts = decode_queries(tokenizer, batch, sl)
    return reward_source(queries, prompts, labels[sl])


def inference_rows(cfg) -> int:
    """Rows per inference forward (ref, old log-probs, values, reward model): a micro-batch of prompts' samples."""
    return cfg.rollout.micro_rollout_batch_size * cfg.rollout.n_samples_per_prompt


def on_policy_single_update(cfg) -> bool:
    """One epoch and one optimizer step per rollout batch, and no async lag: old log-probs equal the current ones.

    With --enable_is_correction the old log-probs are still needed (they are the IS numerator), so not then.
    """
    r, o, a = cfg.rollout, cfg.optim, cfg.algorithm
    return (o.max_epochs == 1 and r.rollout_batch_size * r.n_samples_per_prompt == o.train_batch_size
            and not r.async_train and not a.enable_is_correction)


def _all_gather_obj(obj):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def make_experience(cfg, roles, groups, batch: RolloutBatch, labels: List, reward_source, tokenizer, kl_coef: float,
                    reward_norm=None, timings=None, scheduler=None) -> Experience:
    """Everything the update needs, identical on every rank."""
    a, r, m = cfg.algorithm, cfg.rollout, cfg.model
    n = batch.sequences.size(0)
    micro = inference_rows(cfg)
    spec = ADVANTAGE_ESTIMATORS[a.advantage_estimator]
    phase = scheduler.phase if scheduler is not None else None

    def run(name, fn):
        if phase is None or name not in scheduler.roles:
            return fn()
        with phase(name):
            return fn()

    def gather_col(res, key, dtype=torch.float32):
        return gather_rows(None if res is None else res[key].unsqueeze(1), n, dtype=dtype).squeeze(1)

    # rewards (reward model ranks, or every rank calling the reward function on its shard)
    res = run("reward", lambda: reward_shard(roles, groups, reward_source, tokenizer, batch, labels, micro))
    rewards, scores = gather_col(res, "rewards"), gather_col(res, "scores")
    valid = gather_col(res, "valid", torch.long).bool()
    keys = sorted(res["extra_logs"]) if res is not None else []
    keys = sorted(set(k for ks in _all_gather_obj(keys) for k in ks))
    extra = {k: gather_rows(None if res is None else res["extra_logs"][k].float().unsqueeze(1), n).squeeze(1)
             for k in keys}
    # reference and old log-probs, values
    temp = r.temperature if r.temperature > 0 else 1.0
    chunk = m.logprob_chunk_size
    ref_lp = None
    if roles.ref is not None or groups.plan.roles.get("ref"):
        loc = run("ref", lambda: forward_logprobs_shard(roles.ref, batch, role_shard(groups, "ref", n), temp, micro,
                                                        chunk, m.packing_samples, groups, "ref"))
        ref_lp = gather_rows(loc, n) * batch.action_mask
    if not needs_old_logprobs(cfg, on_policy_single_update(cfg)):
        old_lp = None  # the one update sees ratio 1: the trainer uses its own log-probs, detached (no extra forward)
    else:
        loc = run("actor", lambda: forward_logprobs_shard(roles.actor, batch, role_shard(groups, "actor", n), temp,
                                                          micro, chunk, m.packing_samples, groups, "actor"))
        old_lp = gather_rows(loc, n) * batch.action_mask
    values = None
    if spec.needs_critic:
        loc = run("critic", lambda: values_shard(roles.critic, batch, role_shard(groups, "critic", n), micro, groups))
        values = gather_rows(loc, n) * batch.action_mask
    out = advantage_stage(cfg, StageInputs(rewards, scores, valid, batch.action_mask, batch.truncated,
                                           batch.rollout_logprobs, old_lp, ref_lp, values, extra), kl_coef, reward_norm)
    return Experience(batch.sequences, batch.attention_mask, out.train_mask, batch.rollout_logprobs, old_lp, ref_lp,
                      values, out.advantages, out.returns, scores, out.metrics)
