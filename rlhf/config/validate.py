"""Cross-field checks run at parse time, before any process group or device memory.

Each failure names the flag and says what would fit.  Checks that need the
world size (topology) live in ``rlhf.distributed.plan`` and also run before
``init_process_group``.
"""
from __future__ import annotations

from rlhf.config.algorithm_checks import validate_algorithm
from rlhf.config.batching_checks import validate_batching  # --use_dynamic_batch budgets, --adam_offload
from rlhf.config.moe_checks import validate_moe
from rlhf.config.openrlhf_meaning import resolve_async_colocate  # OpenRLHF: colocates the training models only
from rlhf.config.qlora import check_load_in_4bit
from rlhf.errors import ConfigError

RL_KINDS = ("ppo", "grpo")

_POSITIVE_HINT = {
    "prompt_max_len": " (it is the prompt truncation length; 0 does not disable truncation)",
    "num_episodes": " (0 episodes would export the untrained model)",
    "generate_max_len": " (the number of new tokens per response)",
}


def suggest_train_batch_size(samples: int, current: int, micro: int) -> str:
    """A fix that passes both checks: a divisor of ``samples`` that is a multiple of ``micro`` (nearest ``current``)."""
    fits = [b for b in range(micro, samples + 1, micro) if samples % b == 0]
    if fits:
        best = min(fits, key=lambda b: (abs(b - current), -b))
        return f"e.g. --train_batch_size {best}"
    return (f"no multiple of --micro_train_batch_size {micro} divides {samples}; e.g. --micro_train_batch_size 1 "
            f"--train_batch_size {samples}")


def _check(cond: bool, flag: str, message: str):
    if not cond:
        raise ConfigError(flag, message)


def validate(cfg, kind: str) -> None:
    o, d, m = cfg.optim, cfg.data, cfg.model
    _check(o.micro_train_batch_size > 0, "micro_train_batch_size", "--micro_train_batch_size must be > 0")
    _check(o.train_batch_size % o.micro_train_batch_size == 0, "train_batch_size",
           f"--train_batch_size {o.train_batch_size} must be a multiple of --micro_train_batch_size {o.micro_train_batch_size}")
    _check(o.max_epochs >= 1, "max_epochs", "--max_epochs must be >= 1")
    from rlhf.data.options import settle_data_flags, uses_builtin_reward  # --eval_split / --eval_holdout, --input_template, --label_key

    settle_data_flags(d, kind, ConfigError, uses_builtin_reward(cfg.rollout, m.reward_pretrain))
    _check(o.lr_warmup_ratio >= 0 and o.lr_warmup_ratio < 1, "lr_warmup_ratio", "--lr_warmup_ratio must lie in [0, 1)")
    if m.lora_rank < 0:
        raise ConfigError("lora_rank", "--lora_rank must be >= 0")
    check_load_in_4bit(m.load_in_4bit, m.lora_rank, rl=kind in RL_KINDS)  # QLoRA (rlhf.config.qlora)
    _check(m.logprob_chunk_size > 0, "logprob_chunk_size",
           f"--logprob_chunk_size must be > 0 (rows of logits computed at once), got {m.logprob_chunk_size}; "
           f"e.g. --logprob_chunk_size 1024")
    _validate_gpu_memory(cfg.topology.gpu_memory_gb)
    _validate_sp(cfg, kind)
    if kind in RL_KINDS:
        _validate_rl(cfg)
    validate_batching(cfg)
    validate_moe(cfg, kind)  # --router_replay (rlhf.config.moe_checks)
    if kind in ("sft", "rm", "dpo"):
        _check(d.max_len > 8, "max_len", "--max_len must be > 8")
    for flag, on in (("multiturn", d.multiturn), ("pretrain_mode", m.pretrain_mode)):  # rlhf.data.sft_modes
        _check(not on or kind == "sft", flag, f"--{flag} is an SFT mode (rlhf.train_sft); drop it for {kind}")
    _check(not (d.multiturn and m.pretrain_mode), "multiturn", "--multiturn and --pretrain_mode are two SFT modes, "
           "pick one: --multiturn trains on the assistant turns of conversations, --pretrain_mode on plain text")
    _check(not d.multiturn or d.apply_chat_template, "multiturn", "--multiturn renders each conversation with the "
           "tokenizer's chat template: add --apply_chat_template")


def _validate_gpu_memory(gb) -> None:
    """--gpu_memory_gb: a finite size > 0 (nan compares false with everything, so it turned the memory check off
    without a word; inf would fit anything)."""
    if gb is None:
        return
    import math

    _check(math.isfinite(gb) and gb > 0, "gpu_memory_gb",
           f"--gpu_memory_gb must be a finite number of GiB > 0, got {gb}; e.g. --gpu_memory_gb 80 (an H100), or "
           f"leave it out (on CUDA the GPU's own memory is used); --skip_memory_check skips the check")


def _validate_sp(cfg, kind: str) -> None:
    """--ring_attn_size: packing, trainer kind (heads and ranks: rlhf.config.preflight, placement)."""
    from rlhf.distributed.sequence_parallel import check_sp

    try:
        check_sp(cfg.topology.ring_attn_size, kind, cfg.model.packing_samples)
    except ValueError as e:
        raise ConfigError("ring_attn_size", str(e)) from None


def _validate_rl(cfg) -> None:
    from rlhf.algorithms import ADVANTAGE_ESTIMATORS

    o, r, a, d, t, m = cfg.optim, cfg.rollout, cfg.algorithm, cfg.data, cfg.topology, cfg.model
    resolve_is_correction(a)
    validate_algorithm(cfg)
    port, host = cfg.agent.agent_endpoint_port, cfg.agent.agent_endpoint_host  # the agent endpoint (rlhf.agents.endpoint)
    _check(0 <= port <= 65535, "agent_endpoint_port", f"--agent_endpoint_port must lie in [0, 65535], got {port}; "
           f"e.g. --agent_endpoint_port 0 (a free port)")
    _check(bool(host and host.strip()), "agent_endpoint_host", "--agent_endpoint_host is empty; e.g. "
           "--agent_endpoint_host 127.0.0.1 (this host only) or 0.0.0.0 (every interface)")
    for flag, val in (("n_samples_per_prompt", r.n_samples_per_prompt),
                      ("micro_rollout_batch_size", r.micro_rollout_batch_size),
                      ("rollout_batch_size", r.rollout_batch_size), ("num_episodes", o.num_episodes),
                      ("prompt_max_len", d.prompt_max_len), ("generate_max_len", d.generate_max_len)):
        _check(val > 0, flag, f"--{flag} must be > 0, got {val}" + _POSITIVE_HINT.get(flag, ""))
    for flag in ("log_val_generations", "logprob_gap_interval"):
        val = getattr(cfg.logging, flag)
        _check(val >= 0, flag, f"--{flag} must be >= 0 (0 = off), got {val}; e.g. --{flag} 10")
    est = a.advantage_estimator
    _check(est in ADVANTAGE_ESTIMATORS, "advantage_estimator",
           f"--advantage_estimator {est!r} is unknown; choose one of {', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
    spec = ADVANTAGE_ESTIMATORS[est]
    if spec.needs_group:
        _check(r.n_samples_per_prompt > 1, "n_samples_per_prompt",
               f"--advantage_estimator {est} compares samples of the same prompt: set --n_samples_per_prompt > 1 "
               f"(got {r.n_samples_per_prompt}), or use gae/reinforce")
        _check(r.temperature > 0, "temperature",
               f"--temperature 0 samples greedily: the {r.n_samples_per_prompt} samples of a prompt are identical, so "
               f"--advantage_estimator {est} gives every sample advantage 0 and nothing trains; "
               f"use --temperature 1.0 (or gae/reinforce for greedy rollouts)")
    if not spec.needs_critic:
        _check(m.critic_pretrain is None, "critic_pretrain",
               f"--critic_pretrain is set but --advantage_estimator {est} trains no critic; drop it or use gae")
        _check(t.critic_num_gpus_per_node == 0, "critic_num_gpus_per_node",
               f"--critic_num_gpus_per_node is set but --advantage_estimator {est} trains no critic; drop it or use gae")
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    _check(samples % o.train_batch_size == 0, "train_batch_size",
           f"--rollout_batch_size x --n_samples_per_prompt = {samples} samples must be a multiple of "
           f"--train_batch_size {o.train_batch_size}; {suggest_train_batch_size(samples, o.train_batch_size, o.micro_train_batch_size)}")
    _check(a.clip_eps_low >= 0 and a.clip_eps_high >= 0, "clip_eps_low", "clip epsilons must be >= 0")
    if a.dual_clip is not None:
        _check(a.dual_clip > 1.0, "dual_clip", f"--dual_clip must be > 1, got {a.dual_clip}")
    if a.reward_clip_range is not None:
        lo, hi = a.reward_clip_range
        _check(lo < hi, "reward_clip_range", f"--reward_clip_range needs lo < hi, got {lo} {hi}")
    if a.dynamic_filtering:
        _check(r.n_samples_per_prompt > 1, "dynamic_filtering",
               "--dynamic_filtering drops groups of equal scores: it needs --n_samples_per_prompt > 1")
    if a.kl_target is not None:
        _check(a.kl_target > 0 and a.kl_horizon > 0, "kl_target", "--kl_target and --kl_horizon must be > 0")
    resolve_async_colocate(cfg)
    _validate_async(cfg)
    _check(r.temperature >= 0, "temperature", "--temperature must be >= 0")
    if d.prompt_data is not None and r.remote_rm_url is None and m.reward_pretrain is None and r.agent_func_path is None:
        raise ConfigError("remote_rm_url", "--prompt_data is set but no reward source: give --reward_pretrain, "
                                           "--remote_rm_url (reward_func.py or http URL) or --agent_func_path")


def resolve_is_correction(a) -> None:
    """OpenRLHF 0.11.2's IS-correction interface (openrlhf/models/loss.py PolicyLoss: is_correction_level
    off|token|seq, is_correction_mode mask|clip, is_correction_gating ratio|binary_kl|tv) onto the flat flags:
    a set --is_correction_level decides --enable_is_correction and (with the mode) --is_correction_type; the
    gating is read by importance_weights.  Upstream's constructor checks, each naming the flag and a value that works:
    clip needs token level and ratio gating; a divergence gate takes an upper bound only."""
    from rlhf.algorithms import IS_LEVEL_MODE_KIND

    level, mode, gating = a.is_correction_level, a.is_correction_mode, a.is_correction_gating
    if level is not None:
        a.enable_is_correction = level != "off"
        if level != "off":
            if (level, mode) not in IS_LEVEL_MODE_KIND:
                raise ConfigError("is_correction_mode", f"--is_correction_mode clip clamps the per-token ratio: it "
                                  f"needs --is_correction_level token (got {level}); use --is_correction_mode mask")
            a.is_correction_type = IS_LEVEL_MODE_KIND[(level, mode)]
    if not a.enable_is_correction or gating == "ratio":
        return
    if a.is_correction_type == "tis":
        raise ConfigError("is_correction_gating", f"--is_correction_gating {gating} is a rejection filter and "
                          f"cannot clamp (mode clip / --is_correction_type tis): use --is_correction_mode mask "
                          f"(or --is_correction_gating ratio)")
    if a.is_truncated_threshold_low > 0:
        raise ConfigError("is_correction_gating", f"--is_correction_gating {gating} takes an upper bound only, got "
                          f"the band [{a.is_truncated_threshold_low}, {a.is_truncated_threshold}]: give one value, "
                          f"e.g. --algo.advantage.is_correction_threshold 5e-3 (or --is_truncated_threshold_low 0)")


def _validate_async(cfg) -> None:
    """--async_queue_size, --max_staleness, --partial_rollout, --vllm_generate_batch_size (rlhf.rl.stream).
    Each needs --async_train (OpenRLHF asserts the same: openrlhf/cli/train_ppo_ray.py).  Resolves the staleness
    default, and turns IS correction on when nothing was said about it: an off-policy batch without it trains on
    the rollout's samples as if the trainer had drawn them (``--is_correction_level off`` opts out)."""
    r, a, d = cfg.rollout, cfg.algorithm, cfg.data
    _check(r.async_queue_size >= 1, "async_queue_size",
           f"--async_queue_size is the number of batches generated ahead (K >= 1), got {r.async_queue_size}; "
           f"e.g. --async_queue_size 1")
    if not r.async_train:
        for flag, on in (("partial_rollout", r.partial_rollout), ("max_staleness", r.max_staleness is not None),
                         ("async_queue_size", r.async_queue_size != 1),
                         ("partial_rollout_chunk", r.partial_rollout_chunk is not None),
                         ("vllm_generate_batch_size", r.vllm_generate_batch_size not in (None, r.rollout_batch_size))):
            _check(not on, flag, f"--{flag} shapes asynchronous rollouts: add --async_train (with rollout ranks "
                                 f"of their own, --vllm_num_engines), or drop --{flag}")
        return
    k = r.async_queue_size
    if r.vllm_generate_batch_size is None:
        r.vllm_generate_batch_size = r.rollout_batch_size
    if r.max_staleness is None:
        r.max_staleness = default_staleness(r, d.generate_max_len)
    _check(r.max_staleness >= k, "max_staleness",
           f"--max_staleness {r.max_staleness} is below --async_queue_size {k}: every batch is trained {k} syncs "
           f"after it was generated, so none could train; use --max_staleness {default_staleness(r, d.generate_max_len)}")
    _check(r.vllm_generate_batch_size >= r.rollout_batch_size, "vllm_generate_batch_size",
           f"--vllm_generate_batch_size {r.vllm_generate_batch_size} is below --rollout_batch_size "
           f"{r.rollout_batch_size}: the prompts in flight must fill a batch; use --vllm_generate_batch_size "
           f"{r.rollout_batch_size} (or more to oversample)")
    if r.partial_rollout_chunk is not None:
        _check(r.partial_rollout_chunk >= 1, "partial_rollout_chunk",
               f"--partial_rollout_chunk must be >= 1 token, got {r.partial_rollout_chunk}; e.g. "
               f"--partial_rollout_chunk {max(1, d.generate_max_len // 4)}")
        _check(r.partial_rollout, "partial_rollout_chunk", "--partial_rollout_chunk sets the rounds of "
               "--partial_rollout: add --partial_rollout, or drop it")
    if a.is_correction_level is None and not a.enable_is_correction:
        a.enable_is_correction = True  # tis, [--is_truncated_threshold_low, --is_truncated_threshold]


def default_staleness(r, generate_max_len: int) -> int:
    """The oldest a sample gets by the pipeline's own shape, so that by default nothing is generated in vain:
    K (--async_queue_size), plus the steps an oversampled extra group waits in the buffer
    (ceil(--vllm_generate_batch_size / --rollout_batch_size) - 1), plus, with --partial_rollout, the syncs a
    response of --generate_max_len can span (ceil(max / chunk) - 1).  A smaller --max_staleness trades those
    samples (restarted or dropped, counted in async/restarted_groups, async/dropped_stale_groups) for a fresher
    batch."""
    g = r.vllm_generate_batch_size or r.rollout_batch_size
    extra = -(-g // r.rollout_batch_size) - 1
    if r.partial_rollout:
        chunk = r.partial_rollout_chunk or max(1, generate_max_len // 4)
        extra += -(-generate_max_len // chunk) - 1
    return r.async_queue_size + extra
