"""OpenRLHF flat-era flags (train_ppo_ray / train_sft / train_rm / train_dpo, 2024-07 .. 2026-04) that are not
flags of our schema: one table, each entry one of

* ``alias``       -- translated into our flags (``--eps_clip 0.2`` -> ``--clip_eps_low 0.2 --clip_eps_high 0.2``);
* ``noop``        -- accepted, with a one-line notice saying why it has no effect here;
* ``unsupported`` -- accepted at OpenRLHF's default (with the notice); any other value is an error saying why.

A name that is (or later becomes) a real flag of the schema is skipped here: the real flag wins.
Nothing in this table is silent: ``translate`` returns a notice for every compat flag it sees.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from rlhf.config.validate import ConfigError


@dataclass(frozen=True)
class Compat:
    kind: str                      # alias | noop | unsupported
    type: Any = bool               # bool (a switch), int, float, str
    default: Any = None            # OpenRLHF's default
    why: str = ""                  # the notice (noop / unsupported) or what it maps to (alias)
    to: Optional[Callable[[Any], Dict[str, Any]]] = None   # alias: value -> {our flag: value}
    nargs: int = 1


def _alias(to, typ=float, default=None, why="", nargs=1):
    return Compat("alias", typ, default, why, to, nargs)


def _noop(why, typ=bool, default=None, nargs=1):
    return Compat("noop", typ, default if default is not None or typ is not bool else False, why, None, nargs)


def _unsupported(why, typ=bool, default=None, nargs=1):
    return Compat("unsupported", typ, default if default is not None or typ is not bool else False, why, None, nargs)


def _param_dtype(v):
    if v == "bf16":
        return {"bf16": True}
    raise ConfigError("param_dtype", f"--param_dtype {v}: only bf16 (or fp32, the default without --bf16) is "
                                     f"supported here; use --param_dtype bf16 or drop the flag")


_RAY = "there is no Ray here: ranks are torchrun processes and roles are process groups"
_DS_ONLY = "a DeepSpeed tuning knob this build does not pass to DeepSpeed (the defaults are used)"
_KERNEL = "an optional fused kernel this build does not use (HF modules + sdpa/flash_attention_2 via --flash_attn)"

COMPAT: Dict[str, Compat] = {
    # --- translated onto our flags
    "eps_clip": _alias(lambda v: {"clip_eps_low": v, "clip_eps_high": v}, float, 0.2,
                       "--clip_eps_low and --clip_eps_high"),
    "eps_clip_low_high": _alias(lambda v: {"clip_eps_low": v[0], "clip_eps_high": v[1]}, float, None,
                                "--clip_eps_low LOW --clip_eps_high HIGH", nargs=2),
    "l2": _alias(lambda v: {"weight_decay": v}, float, 0.0, "--weight_decay"),
    "param_dtype": _alias(_param_dtype, str, "bf16", "--bf16"),
    "use_kl_estimator_k3": _alias(lambda v: {"kl_estimator": "k3"} if v else {}, bool, False, "--kl_estimator k3"),
    "enable_vllm_is_correction": _alias(lambda v: {"enable_is_correction": v}, bool, False, "--enable_is_correction"),
    "ipo": _alias(lambda v: {"loss_type": "ipo"} if v else {}, bool, False, "--loss_type ipo"),
    "loss": _alias(lambda v: {"rm_loss": v}, str, "sigmoid", "--rm_loss"),
    "train_split": _alias(lambda v: {"dataset_split": v}, str, "train", "--dataset_split"),
    "prompt_key": _alias(lambda v: {"input_key": v} if v else {}, str, None, "--input_key"),
    # --- accepted, no effect here (the notice says why)
    "vllm_sync_backend": _noop("weights reach the rollout engine in-process (colocated) or by a torch.distributed "
                               "broadcast over the job's own process group, not over a separate NCCL/gloo group", str, "nccl"),
    "vllm_sync_with_ray": _noop(_RAY),
    "ref_reward_offload": _noop("frozen reference/reward models hold no optimizer state; colocated roles take turns "
                                "(--colocate_all_models, --deepspeed_enable_sleep)"),
    "ref_offload": _noop("the DPO reference is a frozen model without optimizer state"),
    "actor_init_on_gpu": _noop("the actor is always built on its own rank's device (rank 0 holds the weights, shards "
                               "are broadcast)"),
    "disable_ds_ckpt": _noop("checkpoints are written only when --save_steps > 0; resume state is one engine checkpoint"),
    "max_ckpt_mem": _noop("checkpoints are bounded by count (--max_ckpt_num), not by size", float, float("inf")),
    "use_ds_universal_ckpt": _noop("FSDP2 checkpoints (torch.distributed.checkpoint) already reshard across world "
                                   "sizes; DeepSpeed resumes need the same world size"),
    "universal_ckpt": _noop("FSDP2 checkpoints (torch.distributed.checkpoint) already reshard across world sizes"),
    "zpg": _noop(_DS_ONLY, int, 1),
    "overlap_comm": _noop(_DS_ONLY),
    "grad_accum_dtype": _noop(_DS_ONLY, str),
    "deepcompile": _noop(_DS_ONLY),
    "disable_trace_cache": _noop(_DS_ONLY),
    "use_liger_kernel": _noop(_KERNEL),
    "use_linger_kernel": _noop(_KERNEL),
    "enable_prefix_caching": _noop("vLLM's prefix cache is managed by the engine (reset after every weight sync)"),
    "full_determinism": _noop("runs are seeded with --seed; bit-exact determinism across kernels is not enforced"),
    "disable_fast_tokenizer": _noop("tokenizers load with AutoTokenizer's default (fast when available)"),
    "perf": _noop("timings are always in the per-step metrics (time/*)"),
    "use_ms": _noop("models and data load from local paths or the HF hub; ModelScope is not used"),
    "dataloader_num_workers": _noop("rows are tokenized once up front; there is no DataLoader", int, 0),
    "compute_fp32_loss": _noop("losses are always computed in fp32"),
    "wandb_group": _noop("wandb runs are grouped by --wandb_project / --wandb_run_name here", str),
    "local_rank": _noop("torchrun sets LOCAL_RANK", int, -1),
    "attn_implementation": _noop("attention is sdpa, or flash_attention_2 with --flash_attn", str, "flash_attention_2"),
    "best_metric_key": _noop("no best-checkpoint tracking: checkpoints are the newest --max_ckpt_num", str, ""),
    "ema_beta": _noop("no EMA model (--enable_ema is not supported)", float, 0.992),
    "image_key": _noop("text-only: there is no vision input", str, "images"),
    "max_images_per_prompt": _noop("text-only: there is no vision input", int, 0),
    "freeze_visual_encoder": _noop("text-only: there is no vision encoder"),
    "tokenizer_chat_template": _unsupported("the chat template comes from the tokenizer in --pretrain", str),
    # --- accepted at OpenRLHF's default only (a different value would change training: error)
    "ptx_coef": _noop("PPO-ptx needs --pretrain_data, which is not supported", float, 0.05),
    "pretrain_data": _unsupported("PPO-ptx (a pre-training loss mixed into PPO) is not implemented", str),
    "pretrain_data_probs": _unsupported("PPO-ptx is not implemented", str),
    "pretrain_split": _unsupported("PPO-ptx is not implemented", str, "train"),
    "aux_loss_coef": _unsupported("the MoE load-balancing loss is not implemented in this build", float, 0.0),
    "ring_head_stride": _noop("--ring_attn_size runs Ulysses (heads split over the group by all-to-all), which has no "
                              "head stride", int, 1),
    "ds_tensor_parallel_size": _unsupported("training tensor parallelism is not implemented (FSDP2 / ZeRO only)", int, 1),
    "lora_dropout": _unsupported("LoRA dropout is fixed at 0 here", float, 0.0),
    "enable_ema": _unsupported("no EMA model is kept"),
    "max_tokens_per_gpu": _alias(lambda v: {"train_max_tokens_per_gpu": v}, int, 16192,
                                 "--train_max_tokens_per_gpu (its name before OpenRLHF split it from the rollout's)"),
    "gradient_checkpointing_use_reentrant": _unsupported("gradient checkpointing is always non-reentrant"),
    "torch_compile": _unsupported("torch.compile is not applied to the models"),
    "margin_loss": _unsupported("a per-row margin column is not read; use --margin for a constant one"),
    "vllm_is_correction_type": _alias(lambda v: {"is_correction_type": v}, str, "tis", "--is_correction_type"),
    "vllm_is_truncated_threshold": _alias(lambda v: {"is_truncated_threshold_low": v[0],
                                                     "is_truncated_threshold": v[1]}, float, None,
                                          "--is_truncated_threshold_low LOW --is_truncated_threshold HIGH", nargs=2),
    "use_icepop": _alias(lambda v: {"is_correction_type": "icepop"} if v else {}, bool, False,
                         "--is_correction_type icepop"),
    "stop_properly_penalty_coef": _unsupported("the stop-properly (truncation) penalty is not implemented", float),
    "min_lr_ratio": _unsupported("cosine_with_min_lr decays to 0.1 x the learning rate", float, 0.1),
    # OpenRLHF 0.11 train_sft / train_rm / train_dpo: --optim {adam,muon} (flat, next to --adam.* / --muon.*)
    "optim": _unsupported("the Muon optimizer is not available here (AdamW only)", str, "adam"),
    "max_new_tokens": _alias(lambda v: {"generate_max_len": v}, int, None,
                             "--generate_max_len (OpenRLHF 0.10.1's flat name of --rollout.max_new_tokens)"),
}


def active(schema_flags) -> Dict[str, Compat]:
    """The compat entries that are not real flags of the schema (a real flag always wins)."""
    return {k: c for k, c in COMPAT.items() if k not in schema_flags}


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def translate(values: Dict[str, Any], schema_flags) -> Tuple[Dict[str, Any], List[str]]:
    """Replace compat flags in a flat {flag: value} mapping by our flags; return (values, notices).

    An alias never overrides one of our flags given explicitly with a different value (that is an error).
    """
    table = active(schema_flags)
    out = {k: v for k, v in values.items() if k not in table}
    notices = []
    for name, v in values.items():
        c = table.get(name)
        if c is None:
            continue
        if c.kind == "alias":
            mapped = c.to(v)
            for k, mv in mapped.items():
                if k in values and not _same(values[k], mv):
                    raise ConfigError(name, f"--{name} {v!r} means --{k} {mv!r}, but --{k} {values[k]!r} is also "
                                            f"given; keep one of them")
                out[k] = mv
            if not mapped:
                notices.append(f"[openrlhf] {_flag(name, v)} is already what happens here (no flag to set)")
            else:
                notices.append(f"[openrlhf] {_flag(name, v)} -> " + " ".join(_flag(k, x) for k, x in mapped.items()))
        elif c.kind == "noop" or (c.kind == "unsupported" and _is_default(c, v)):
            notices.append(f"[openrlhf] {_flag(name, v)} has no effect here: {c.why}")
        else:
            raise ConfigError(name, f"{_flag(name, v)} is not supported: {c.why}; drop the flag"
                                    + (f" (or give its default, {c.default!r})" if c.default not in (None, False) else ""))
    return out, notices


def _is_default(c: Compat, v) -> bool:
    if c.type is bool:
        return not v
    return v is None or (c.default is not None and _same(v, c.default))


def _flag(name: str, v) -> str:
    shown = _show(v)
    return f"--{name} {shown}" if shown else f"--{name}"


def _show(v) -> str:
    if isinstance(v, (list, tuple)):
        return " ".join(str(x) for x in v)
    return "" if v is True else str(v)
