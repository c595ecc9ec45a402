"""Parse-time checks of token-budget micro-batching (--use_dynamic_batch) and optimizer offload (--adam_offload),
before any process group.  Called from validate.validate; each failure names the flag and a value that works."""
from __future__ import annotations

from .validate import ConfigError

RL_KINDS = ("ppo", "grpo")


def longest_sequence(cfg, kind: str) -> tuple:
    """(tokens one training sample can take, how that number is made): RL prompt + response, SFT one sample,
    RM / DPO a chosen/rejected pair (two sequences in one micro-batch)."""
    d = cfg.data
    if kind in RL_KINDS:
        return (d.prompt_max_len + d.generate_max_len,
                f"--prompt_max_len {d.prompt_max_len} + --generate_max_len {d.generate_max_len}")
    if kind in ("rm", "dpo"):
        return 2 * d.max_len, f"a chosen/rejected pair, 2 x --max_len {d.max_len}"
    return d.max_len, f"--max_len {d.max_len}"


def validate_batching(cfg, kind: str) -> None:
    o, r, t = cfg.optim, cfg.rollout, cfg.topology
    if o.use_dynamic_batch:
        need, why = longest_sequence(cfg, kind)
        budgets = [("train_max_tokens_per_gpu", o.train_max_tokens_per_gpu)]
        if kind in RL_KINDS and r.rollout_max_tokens_per_gpu is not None:
            budgets.append(("rollout_max_tokens_per_gpu", r.rollout_max_tokens_per_gpu))
        for flag, val in budgets:
            if val < need:
                raise ConfigError(flag, f"--{flag} {val} is smaller than one sequence ({why} = {need} tokens): a "
                                        f"micro-batch must hold at least one; use --{flag} {need} or more, or lower the "
                                        f"length limits")
    if t.adam_offload and t.backend == "deepspeed" and t.zero_stage < 1:
        # DeepSpeed: zero_optimization.offload_optimizer is "valid only with stage 1, 2 and 3" (its config docs);
        # stage 0 builds no ZeRO optimizer, so the offload would never run
        raise ConfigError("adam_offload", "--adam_offload with --backend deepspeed offloads the ZeRO optimizer "
                                          "(offload_optimizer), which DeepSpeed runs at ZeRO stages 1-3 only: use "
                                          "--zero_stage 1 (or 2, 3), or --backend fsdp2")
