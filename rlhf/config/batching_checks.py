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


def row_budgets(cfg) -> tuple:
    """(training, inference) tokens per micro-batch of one DP rank: --train_max_tokens_per_gpu and
    --rollout_max_tokens_per_gpu (default: the training one) times --ring_attn_size, since sequence parallelism
    splits each packed row over that many GPUs (OpenRLHF ``get_minimum_num_micro_batch_size``:
    ``effective_max_tokens = max_tokens_per_gpu * ring_attn_size * ds_tensor_parallel_size``)."""
    sp = max(int(getattr(cfg.topology, "ring_attn_size", 1) or 1), 1)
    train = cfg.optim.train_max_tokens_per_gpu
    return train * sp, (cfg.rollout.rollout_max_tokens_per_gpu or train) * sp


def validate_batching(cfg, kind: str) -> None:
    o, r, t = cfg.optim, cfg.rollout, cfg.topology
    if o.use_dynamic_batch:
        need, why = longest_sequence(cfg, kind)
        sp = max(int(getattr(t, "ring_attn_size", 1) or 1), 1)
        budgets = [("train_max_tokens_per_gpu", o.train_max_tokens_per_gpu)]
        if kind in RL_KINDS and r.rollout_max_tokens_per_gpu is not None:
            budgets.append(("rollout_max_tokens_per_gpu", r.rollout_max_tokens_per_gpu))
        for flag, val in budgets:
            if val * sp < need:
                fit = -(-need // sp)
                split = f" x --ring_attn_size {sp} = {val * sp}" if sp > 1 else ""
                raise ConfigError(flag, f"--{flag} {val}{split} is smaller than one sequence ({why} = {need} tokens): "
                                        f"a micro-batch must hold at least one; use --{flag} {fit} or more, or lower "
                                        f"the length limits")
    if t.adam_offload and t.backend == "deepspeed" and t.zero_stage < 1:
        # DeepSpeed: zero_optimization.offload_optimizer is "valid only with stage 1, 2 and 3" (its config docs);
        # stage 0 builds no ZeRO optimizer, so the offload would never run
        raise ConfigError("adam_offload", "--adam_offload with --backend deepspeed offloads the ZeRO optimizer "
                                          "(offload_optimizer), which DeepSpeed runs at ZeRO stages 1-3 only: use "
                                          "--zero_stage 1 (or 2, 3), or --backend fsdp2")
