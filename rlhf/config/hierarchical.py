"""OpenRLHF's hierarchical flag spelling (``--actor.adam.lr``, ``--algo.kl.init_coef``, ``--ds.zero_stage``, ...).

OpenRLHF's CLI spells its flags with dots since 2026-04 (openrlhf/cli/*.py, ``utils/config.hierarchize``).
This table maps each dotted name onto the flat name a flag has here (or, where this project has no such
flag of its own, onto OpenRLHF's flat-era name, which ``openrlhf_compat`` accepts or explains).  A current
OpenRLHF script therefore runs with only its launcher changed; YAML may use the same names, dotted
(``actor.adam.lr: 1e-6``) or nested (``actor: {adam: {lr: 1e-6}}``).

Entry kinds:
  "name"                       the flag --name (the value(s), if any, follow unchanged);
  Split(a, b)                  two values -> --a v1 --b v2;
  Fanout(a, b, ...)            one value -> --a v --b v ...;
  Switch(name, value)          a switch -> --name value;
  Notice(nargs, why)           accepted, no effect here: one line on stderr says why (nargs values are consumed);
  Choice(name, allowed, why)   rename, but only the listed values are meaningful here.
"""
from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from rlhf.errors import HierarchicalError


@dataclass(frozen=True)
class Split:
    first: str
    second: str


@dataclass(frozen=True)
class Fanout:
    targets: Tuple[str, ...]


@dataclass(frozen=True)
class Switch:
    target: str
    value: str


@dataclass(frozen=True)
class Notice:
    nargs: Union[int, str]
    why: str


@dataclass(frozen=True)
class Choice:
    target: str
    allowed: Tuple[str, ...]
    why: str


Entry = Union[str, Split, Fanout, Switch, Notice, Choice]

_MUON = "the Muon optimizer is not available here (AdamW only)"
_ADAM_EPS = "AdamW eps is fixed at 1e-8 here (OpenRLHF's default)"
_MIN_LR = "the cosine schedule's floor is fixed at 0.1 x lr here (OpenRLHF's default)"

HIERARCHICAL: Dict[str, Entry] = {
    # --- models ---
    "actor.model_name_or_path": "pretrain",
    "model.model_name_or_path": "pretrain",
    "reward.model_name_or_path": "reward_pretrain",
    "critic.model_name_or_path": "critic_pretrain",
    "ref.model_name_or_path": "ref_pretrain",
    "teacher.model_name_or_path": "teacher_pretrain", "opd.topk": "opd_topk",  # OpenRLHF PR #1276 train_opd.py
    "reward.remote_url": "remote_rm_url",
    "train.agent_func_path": "agent_func_path",
    # --- placement ---
    "actor.num_nodes": "actor_num_nodes", "actor.num_gpus_per_node": "actor_num_gpus_per_node",
    "critic.num_nodes": "critic_num_nodes", "critic.num_gpus_per_node": "critic_num_gpus_per_node",
    "ref.num_nodes": "ref_num_nodes", "ref.num_gpus_per_node": "ref_num_gpus_per_node",
    "reward.num_nodes": "reward_num_nodes", "reward.num_gpus_per_node": "reward_num_gpus_per_node",
    "teacher.num_nodes": "teacher_num_nodes", "teacher.num_gpus_per_node": "teacher_num_gpus_per_node",
    "train.colocate_actor_ref": "colocate_actor_ref", "train.colocate_critic_reward": "colocate_critic_reward",
    "train.colocate_all": "colocate_all_models",
    "ref.offload": "ref_reward_offload", "reward.offload": "ref_reward_offload",
    # --- vLLM ---
    "vllm.num_engines": "vllm_num_engines", "vllm.tensor_parallel_size": "vllm_tensor_parallel_size",
    "vllm.sync_backend": "vllm_sync_backend", "vllm.sync_with_ray": "vllm_sync_with_ray",
    "vllm.enable_prefix_caching": "enable_prefix_caching", "vllm.enforce_eager": "enforce_eager",
    "vllm.enable_sleep": "vllm_enable_sleep", "vllm.gpu_memory_utilization": "vllm_gpu_memory_utilization",
    # --- rollout ---
    "rollout.batch_size": "rollout_batch_size", "rollout.micro_batch_size": "micro_rollout_batch_size",
    "rollout.n_samples_per_prompt": "n_samples_per_prompt", "rollout.temperature": "temperature",
    "rollout.top_p": "top_p", "rollout.max_new_tokens": "generate_max_len",
    "rollout.vllm_generate_batch_size": "vllm_generate_batch_size",
    "rollout.max_tokens_per_gpu": "rollout_max_tokens_per_gpu",
    # --- training loop ---
    "train.batch_size": "train_batch_size", "train.micro_batch_size": "micro_train_batch_size",
    "train.max_epochs": "max_epochs", "train.num_episodes": "num_episodes", "train.seed": "seed",
    "train.full_determinism_enable": "full_determinism", "train.async_enable": "async_train",
    "train.async_queue_size": "async_queue_size", "train.partial_rollout_enable": "partial_rollout",
    "train.enable_ema": "enable_ema", "train.ema_beta": "ema_beta",
    "train.dynamic_batch_enable": "use_dynamic_batch", "train.max_tokens_per_gpu": "train_max_tokens_per_gpu",
    # --- algorithm ---
    "algo.advantage.estimator": "advantage_estimator", "algo.advantage.gamma": "gamma",
    "algo.advantage.lambd": "lambd", "algo.advantage.no_std_norm": "no_advantage_std_norm",
    "algo.advantage.is_correction_enable": "enable_is_correction",
    "algo.advantage.is_correction_type": "is_correction_type",
    "algo.advantage.is_correction_threshold": Split("is_truncated_threshold_low", "is_truncated_threshold"),
    # OpenRLHF 0.11.2 (is_correction_enable / _type are gone there): level, mode, gating; one threshold value = HIGH
    "algo.advantage.is_correction_level": "is_correction_level",
    "algo.advantage.is_correction_mode": "is_correction_mode",
    "algo.advantage.is_correction_gating": "is_correction_gating",
    "actor.loss_agg_mode": "loss_agg_mode",
    "algo.kl.init_coef": "init_kl_coef", "algo.kl.target": "kl_target", "algo.kl.horizon": "kl_horizon",
    "algo.kl.estimator": "kl_estimator", "algo.kl.use_loss": "use_kl_loss",
    "algo.kl.unbiased_gradient": "kl_unbiased_gradient",
    "algo.dynamic_filtering_enable": "dynamic_filtering",
    "algo.dynamic_filtering_range": "dynamic_filtering_reward_range",
    "actor.eps_clip": Fanout(("clip_eps_low", "clip_eps_high")),
    "actor.eps_clip_low_high": Split("clip_eps_low", "clip_eps_high"),
    "actor.dual_clip": "dual_clip", "actor.policy_loss_type": "policy_loss_type",
    "actor.aux_loss_coef": "aux_loss_coef", "model.aux_loss_coef": "aux_loss_coef",
    "actor.entropy_coef": "entropy_loss_coef",
    "critic.value_clip": "value_clip", "critic.save_value_network": "save_value_network",
    "critic.freezing_steps": "freezing_actor_steps",
    "reward.clip_range": "reward_clip_range", "reward.normalize_enable": "normalize_reward",
    "reward.overlong_buffer_len": "overlong_buffer_len", "reward.overlong_penalty_factor": "overlong_penalty_factor",
    "reward.stop_properly_penalty_coef": "stop_properly_penalty_coef",
    "model.beta": "beta", "model.label_smoothing": "label_smoothing", "model.nll_loss_coef": "nll_loss_coef",
    "model.ipo_enable": Switch("loss_type", "ipo"),
    "model.loss_type": "rm_loss", "model.margin_loss_enable": "margin_loss",
    "model.compute_fp32_loss_enable": "compute_fp32_loss", "model.pretrain_mode_enable": "pretrain_mode",
    # --- optimizer / schedule (one AdamW setting for actor and critic alike, except the learning rates) ---
    "actor.adam.lr": "actor_learning_rate", "critic.adam.lr": "critic_learning_rate", "adam.lr": "learning_rate",
    "actor.adam.betas": "adam_betas", "critic.adam.betas": "adam_betas", "adam.betas": "adam_betas",
    "actor.adam.weight_decay": "weight_decay", "critic.adam.weight_decay": "weight_decay",
    "adam.weight_decay": "weight_decay",
    "actor.adam.eps": Notice(1, _ADAM_EPS), "critic.adam.eps": Notice(1, _ADAM_EPS), "adam.eps": Notice(1, _ADAM_EPS),
    "actor.lr_scheduler": "lr_scheduler", "critic.lr_scheduler": "lr_scheduler",
    "actor.lr_warmup_ratio": "lr_warmup_ratio", "critic.lr_warmup_ratio": "lr_warmup_ratio",
    "actor.min_lr_ratio": Notice(1, _MIN_LR), "critic.min_lr_ratio": Notice(1, _MIN_LR),
    "actor.max_norm": "max_norm", "critic.max_norm": "max_norm",
    "actor.optim": Choice("", ("adam",), _MUON), "critic.optim": Choice("", ("adam",), _MUON),
    **{f"{p}muon.{k}": Notice(1, _MUON) for p in ("", "actor.", "critic.") for k in ("lr", "momentum", "ns_steps")},
    **{f"{p}muon.{k}": Notice(0, _MUON) for p in ("", "actor.", "critic.") for k in ("nesterov", "no_nesterov")},
    "actor.gradient_checkpointing_enable": "gradient_checkpointing",
    "model.gradient_checkpointing_enable": "gradient_checkpointing",
    "actor.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "model.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "actor.freeze_visual_encoder": "freeze_visual_encoder",
    # --- DeepSpeed / model loading ---
    "ds.zero_stage": "zero_stage", "ds.adam_offload": "adam_offload", "ds.zpg": "zpg",
    "ds.overlap_comm": "overlap_comm", "ds.use_liger_kernel": "use_liger_kernel",
    "ds.grad_accum_dtype": "grad_accum_dtype", "ds.tensor_parallel_size": "ds_tensor_parallel_size",
    "ds.ring_attn_size": "ring_attn_size", "ds.ring_attn_head_stride": "ring_head_stride",
    "ds.packing_samples": "packing_samples", "ds.param_dtype": "param_dtype", "ds.deepcompile": "deepcompile",
    "ds.attn_implementation": "attn_implementation",
    "ds.experts_implementation": "experts_implementation",
    "ds.load_in_4bit": "load_in_4bit", "ds.lora.rank": "lora_rank", "ds.lora.alpha": "lora_alpha",
    "ds.lora.target_modules": "target_modules", "ds.lora.dropout": "lora_dropout",
    "ds.value_head_prefix": "value_head_prefix", "ds.use_universal_ckpt": "use_ds_universal_ckpt",
    "ds.enable_sleep": "deepspeed_enable_sleep",
    # --- data ---
    "data.prompt_dataset": "prompt_data", "data.prompt_probs": "prompt_data_probs",
    "data.prompt_split": "prompt_split", "data.dataset_split": "dataset_split",
    "eval.split": "eval_split",
    "data.dataset": "dataset", "data.dataset_probs": "dataset_probs", "eval.dataset": "eval_dataset",
    "data.input_key": "input_key", "data.output_key": "output_key", "data.label_key": "label_key",
    "data.prompt_key": "prompt_key", "data.chosen_key": "chosen_key", "data.rejected_key": "rejected_key",
    "data.input_template": "input_template", "data.apply_chat_template": "apply_chat_template",
    "data.tokenizer_chat_template": "tokenizer_chat_template", "data.max_len": "max_len",
    "data.max_samples": "max_samples", "data.disable_fast_tokenizer": "disable_fast_tokenizer",
    "data.dataloader_num_workers": "dataloader_num_workers", "data.multiturn": "multiturn",
    "data.image_key": "image_key", "data.max_images_per_prompt": "max_images_per_prompt",
    # --- eval, checkpoints, logging ---
    "eval.steps": "eval_steps", "eval.temperature": "eval_temperature",
    "eval.n_samples_per_prompt": "eval_n_samples_per_prompt",
    "ckpt.output_dir": "save_path", "ckpt.path": "ckpt_path", "ckpt.save_steps": "save_steps",
    "ckpt.save_hf": "save_hf_ckpt", "ckpt.disable_ds": "disable_ds_ckpt", "ckpt.max_num": "max_ckpt_num",
    "ckpt.max_mem": "max_ckpt_mem", "ckpt.load_enable": "load_checkpoint", "ckpt.best_metric_key": "best_metric_key",
    "logger.logging_steps": "logging_steps", "logger.tensorboard_dir": "use_tensorboard",
    "logger.wandb.key": "use_wandb", "logger.wandb.org": "wandb_org", "logger.wandb.group": "wandb_group",
    "logger.wandb.project": "wandb_project", "logger.wandb.run_name": "wandb_run_name",
}

# argparse nargs of every dotted flag that takes no value (store_true / store_false) or a list
_SWITCHES = {k for k in HIERARCHICAL if k.endswith(("_enable", ".nesterov", ".no_nesterov"))} | {
    "train.colocate_actor_ref", "train.colocate_critic_reward", "train.colocate_all", "vllm.sync_with_ray",
    "vllm.enable_prefix_caching", "vllm.enforce_eager", "vllm.enable_sleep", "algo.advantage.no_std_norm",
    "algo.kl.use_loss", "algo.kl.unbiased_gradient", "critic.save_value_network", "ckpt.save_hf", "ckpt.disable_ds",
    "ds.adam_offload", "ds.deepcompile", "train.enable_ema", "ds.use_liger_kernel", "ds.overlap_comm",
    "actor.gradient_checkpointing_reentrant", "model.gradient_checkpointing_reentrant",
    "data.disable_fast_tokenizer", "ds.enable_sleep", "ds.packing_samples", "ds.load_in_4bit",
    "ds.use_universal_ckpt", "ref.offload", "reward.offload", "data.apply_chat_template", "data.multiturn",
    "actor.freeze_visual_encoder"}
_LISTS = {"ds.lora.target_modules"}


def is_dotted(name: str) -> bool:
    return "." in name


def _notice(dotted: str, why: str, stream=None) -> None:
    print(f"[rlhf] --{dotted} has no effect here: {why}", file=stream or sys.stderr)


def _unknown(dotted: str, flat_names: Sequence[str]) -> HierarchicalError:
    pool = list(HIERARCHICAL) + list(flat_names)
    close = difflib.get_close_matches(dotted, pool, n=1) or difflib.get_close_matches(
        dotted.replace(".", "_"), pool, n=1)
    hint = f"; did you mean --{close[0]}?" if close else ""
    return HierarchicalError(f"unknown flag --{dotted}{hint} (see --help)")


def _expand(dotted: str, entry: Entry, values: List[str]) -> List[Tuple[str, Optional[List[str]]]]:
    """[(flat name, values or None for a bare switch)] for one dotted flag and its values."""
    if isinstance(entry, str):
        if dotted in _LISTS:
            return [(entry, [",".join(values)])]
        return [(entry, values if values else None)]
    if isinstance(entry, Split):
        if len(values) == 1 and dotted in _UPPER_ONLY:  # OpenRLHF 0.11.2: "[LOW] HIGH", one value = upper bound
            return [(entry.first, [_UPPER_ONLY[dotted]]), (entry.second, [values[0]])]
        if len(values) != 2:
            raise HierarchicalError(f"--{dotted} takes 2 values, got {len(values)}")
        return [(entry.first, [values[0]]), (entry.second, [values[1]])]
    if isinstance(entry, Fanout):
        return [(t, list(values)) for t in entry.targets]
    if isinstance(entry, Switch):
        return [(entry.target, [entry.value])]
    if isinstance(entry, Choice):
        if values and values[0] not in entry.allowed:
            raise HierarchicalError(f"--{dotted} {values[0]} is not supported: {entry.why}; "
                                    f"use --{dotted} {entry.allowed[0]} or drop it")
        return [(entry.target, values)] if entry.target else []
    raise TypeError(entry)


# Split flags whose first value may be left out, and the first value then: is_correction_threshold's LOW is 0 (the
# gate statistics -- ratio, binary_kl, tv -- are all >= 0, so 0 is no lower bound, as upstream's -inf)
_UPPER_ONLY = {"algo.advantage.is_correction_threshold": "0"}


def _arity(dotted: str, entry: Entry) -> Union[int, str]:
    if isinstance(entry, Notice):
        return entry.nargs
    if dotted in _UPPER_ONLY:
        return "+"
    if dotted in _SWITCHES:
        return 0
    if dotted in _LISTS:
        return "*"
    if isinstance(entry, Split) or dotted in ("actor.adam.betas", "critic.adam.betas", "adam.betas",
                                              "reward.clip_range", "algo.dynamic_filtering_range"):
        return 2
    return 1


def translate_argv(argv: Sequence[str], flat_names: Sequence[str] = (), stream=None) -> List[str]:
    """Rewrite OpenRLHF dotted flags in argv into flat flags; other arguments pass through unchanged.

    Raises HierarchicalError for an unknown dotted flag, a missing value, or two dotted flags that set the
    same flat flag to different values (e.g. --actor.max_norm 1 --critic.max_norm 2: one value here)."""
    out: List[str] = []
    seen: Dict[str, Tuple[str, Optional[List[str]]]] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        if not (a.startswith("--") and is_dotted(a.split("=", 1)[0])):
            out.append(a)
            continue
        name, _, inline = a[2:].partition("=")
        entry = HIERARCHICAL.get(name)
        if entry is None:
            raise _unknown(name, flat_names)
        n = _arity(name, entry)
        if inline:
            values = [inline]
        elif n == "+":  # one or two numbers
            values = []
            while i < len(args) and len(values) < 2 and (not args[i].startswith("--") or _is_number(args[i])):
                values.append(args[i])
                i += 1
            if not values:
                raise HierarchicalError(f"--{name} takes 1 or 2 value(s)")
        elif n == "*":
            values = []
            while i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
        else:
            values = args[i:i + n]
            if len(values) < n or any(v.startswith("--") and not _is_number(v) for v in values):
                raise HierarchicalError(f"--{name} takes {n} value(s)")
            i += n
        if isinstance(entry, Notice):
            _notice(name, entry.why, stream)
            continue
        for flat, vals in _expand(name, entry, values):
            prev = seen.get(flat)
            if prev is not None and prev[1] != vals:
                raise HierarchicalError(f"--{prev[0]} and --{name} both set --{flat} here, to different values "
                                        f"({' '.join(prev[1] or [])} vs {' '.join(vals or [])}); give one")
            seen[flat] = (name, vals)
            out.append(f"--{flat}")
            out.extend(vals or [])
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _known_prefix(path: str) -> bool:
    return path in HIERARCHICAL or any(k.startswith(path + ".") for k in HIERARCHICAL)


def flatten_yaml(raw: dict, is_group_field, is_group=lambda key: False) -> Tuple[dict, dict]:
    """Split a YAML mapping into (ordinary entries, {dotted name: value}).

    A key with a dot, or a nested mapping whose path is not one of our groups' fields, is a dotted OpenRLHF
    name; ``is_group_field(group, key)`` says whether ``group: {key: ...}`` is one of ours."""
    plain, dotted = {}, {}

    def walk(prefix: str, val):
        if isinstance(val, dict):
            for k, v in val.items():
                walk(f"{prefix}.{k}", v)
        else:
            dotted[prefix] = val

    for key, val in raw.items():
        if is_dotted(str(key)):
            walk(str(key), val)
        elif isinstance(val, dict) and not any(is_group_field(key, k) for k in val) and not is_group(key):
            walk(str(key), val)
        elif isinstance(val, dict):
            # ours (group: {field: v}) unless the path is an OpenRLHF name; unknown keys stay ours for the message
            theirs = {k: v for k, v in val.items() if not is_group_field(key, k) and _known_prefix(f"{key}.{k}")}
            mine = {k: v for k, v in val.items() if k not in theirs}
            if mine or not theirs:
                plain[key] = mine
            for k, v in theirs.items():
                walk(f"{key}.{k}", v)
        else:
            plain[key] = val
    return plain, dotted


def translate_yaml(dotted: dict, flat_names: Sequence[str] = (), stream=None) -> dict:
    """{dotted name: YAML value} -> {flat flag: value}; the same rules as translate_argv."""
    out, seen = {}, {}
    for name, val in dotted.items():
        entry = HIERARCHICAL.get(name)
        if entry is None:
            raise _unknown(name, flat_names)
        if isinstance(entry, Notice):
            _notice(name, entry.why, stream)
            continue
        if _arity(name, entry) == 0:
            if not val:
                continue  # a switch set to false: nothing to do
            values = []
        elif isinstance(val, (list, tuple)):
            values = [str(v) for v in val] if name in _LISTS else list(val)
        else:
            values = [val]
        for flat, vals in _expand(name, entry, values):
            v = True if vals is None else (vals[0] if len(vals) == 1 else tuple(vals))
            if flat in seen and seen[flat][1] != v:
                raise HierarchicalError(f"{seen[flat][0]} and {name} both set {flat} here, to different values "
                                        f"({seen[flat][1]!r} vs {v!r}); give one")
            seen[flat] = (name, v)
            out[flat] = v
    return out
