"""Parse-time checks of token budgets (--use_dynamic_batch) and optimizer offload (--adam_offload), before any
process group.  Called from validate.validate; each failure names the flag and a value that works."""
from __future__ import annotations

from rlhf.errors import ConfigError

RL_KINDS = ("ppo", "grpo")


def row_budgets(cfg) -> tuple:
    """(training, inference) tokens per micro-batch of one DP rank: --train_max_tokens_per_gpu and
    --rollout_max_tokens_per_gpu (default: the training one) times --ring_attn_size, since sequence parallelism
    splits each packed row over that many GPUs (OpenRLHF ``get_minimum_num_micro_batch_size``:
    ``effective_max_tokens = max_tokens_per_gpu * ring_attn_size * ds_tensor_parallel_size``)."""
    sp = max(int(getattr(cfg.topology, "ring_attn_size", 1) or 1), 1)
    train = cfg.optim.train_max_tokens_per_gpu
    return train * sp, (cfg.rollout.rollout_max_tokens_per_gpu or train) * sp


def dynamic_budgets(cfg) -> tuple:
    """(training, inference) token budgets of one micro-batch under --use_dynamic_batch (``row_budgets``), else
    (None, None): fixed --micro_train_batch_size / --micro_rollout_batch_size.  What the roles' update settings and
    the inference forwards are given (they never read the config)."""
    return row_budgets(cfg) if cfg.optim.use_dynamic_batch else (None, None)


def validate_batching(cfg) -> None:
    """A token budget smaller than the longest sequence is not refused: such a sequence gets a micro-batch of its
    own, as in OpenRLHF (openrlhf/utils/seqlen_balancing.py ``get_minimum_num_micro_batch_size``: first fit opens
    a bin for it), counted in the metric over_budget_micro_batches (rlhf.algorithms.seqlen_balancing)."""
    o, r, t = cfg.optim, cfg.rollout, cfg.topology
    if o.use_dynamic_batch:
        for flag, val in (("train_max_tokens_per_gpu", o.train_max_tokens_per_gpu),
                          ("rollout_max_tokens_per_gpu", r.rollout_max_tokens_per_gpu)):
            if val is not None and val < 1:
                raise ConfigError(flag, f"--{flag} must be >= 1 token, got {val}; e.g. --{flag} 16192 "
                                        f"(OpenRLHF's default)")
    if t.adam_offload and t.backend == "deepspeed" and t.zero_stage < 1:
        # DeepSpeed: zero_optimization.offload_optimizer is "valid only with stage 1, 2 and 3" (its config docs);
        # stage 0 builds no ZeRO optimizer, so the offload would never run
        raise ConfigError("adam_offload", "--adam_offload with --backend deepspeed offloads the ZeRO optimizer "
                                          "(offload_optimizer), which DeepSpeed runs at ZeRO stages 1-3 only: use "
                                          "--zero_stage 1 (or 2, 3), or --backend fsdp2")
