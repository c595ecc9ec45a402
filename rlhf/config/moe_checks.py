"""Parse-time checks of the MoE flags (rlhf.config.parallel_schema: --router_replay, --experts_implementation)."""
from __future__ import annotations

from rlhf.errors import ConfigError

RL_KINDS = ("ppo", "grpo")


def validate_moe(cfg, kind: str) -> None:
    """--router_replay: an RL trainer; R3 needs a rollout engine that returns its routing (the HF engine: vLLM's
    routed-experts output is not wired here), synchronous rollouts without agents; R2 / R3 need unsplit rows
    (no --ring_attn_size) and R2 rows in batch order (no --use_dynamic_batch: its forwards reorder them)."""
    mode, r = cfg.parallel.router_replay, cfg.rollout
    if mode == "off":
        return
    if kind not in RL_KINDS:
        raise ConfigError("router_replay", f"--router_replay {mode} replays an RL rollout's routing; {kind} has no "
                                           f"rollout: drop it (--router_replay off)")
    if mode == "R3":
        if r.rollout_engine != "hf":
            raise ConfigError("router_replay", f"--router_replay R3 needs the rollout engine's expert choices: "
                                               f"only --rollout_engine hf returns them here (got "
                                               f"{r.rollout_engine}); use --rollout_engine hf, or --router_replay R2")
        for flag, on in (("async_train", r.async_train), ("agent_func_path", r.agent_func_path)):
            if on:
                raise ConfigError("router_replay", f"--router_replay R3 with --{flag}: those rollouts do not carry "
                                                   f"routed_experts yet; drop --{flag}, or use --router_replay R2")
    if cfg.topology.ring_attn_size > 1:
        raise ConfigError("router_replay", f"--router_replay {mode} with --ring_attn_size "
                                           f"{cfg.topology.ring_attn_size}: a split row's routing is not replayed "
                                           f"yet; use --ring_attn_size 1")
    if mode == "R2" and cfg.optim.use_dynamic_batch:
        raise ConfigError("router_replay", "--router_replay R2 with --use_dynamic_batch: the old-log-prob forward "
                                           "reorders rows; drop --use_dynamic_batch, or use --router_replay R3")
