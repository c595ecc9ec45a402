"""The run's identity saved in every manifest (``run_identity``) and the resume checks against it: a different
model shape or run refuses, a changed data stream refuses, changed hyper-parameters are reported.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from rlhf.checkpoint.errors import CheckpointError

SHAPE_FLAGS = ("pretrain_shape", "lora_rank", "needs_critic", "critic_pretrain_shape")


SAME_RUN_FLAGS = ("pretrain", "ref_pretrain", "critic_pretrain", "reward_pretrain", "dataset", "prompt_data",
                  "advantage_estimator")


REPORTED_FLAGS = ("learning_rate", "actor_learning_rate", "critic_learning_rate", "max_epochs", "num_episodes",
                  "max_global_steps", "train_batch_size")


# the data stream: step N's prompts (samples) are a slice of a --seed shuffle at N x the batch, so another value
# on resume re-trains some and skips others; {flag: why}
RL_STREAM_FLAGS = {
    "seed": "the prompt order of each episode is a shuffle drawn from --seed",
    "rollout_batch_size": "step N's prompts are positions N x --rollout_batch_size of the episode's shuffle",
    "n_samples_per_prompt": "each step's samples, its optimizer steps and the learning-rate schedule (and any "
                            "queued async rollouts) were made with it"}


SUPERVISED_STREAM_FLAGS = {
    "seed": "the sample order of each epoch is a shuffle drawn from --seed",
    "train_batch_size": "step N's samples are positions N x --train_batch_size of the epoch's shuffle"}


def _model_shape(path: Optional[str]) -> Optional[dict]:
    """The shape-deciding fields of an HF config.json (None when unreadable)."""
    if not path:
        return None
    try:
        with open(os.path.join(path, "config.json")) as fh:
            c = json.load(fh)
    except (OSError, ValueError):
        return None
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size")
    return {k: c.get(k) for k in keys}


def _norm_path(p):
    return os.path.abspath(os.path.expanduser(p)) if p and os.path.exists(os.path.expanduser(p)) else p


def run_identity(cfg) -> dict:
    """What makes a checkpoint this run's: shapes, models and data, the objective, and harmless settings.

    The one function outside rlhf/config/ that reads the whole config, on purpose: a run's identity is a record of
    its flags across five groups (model, data, algorithm, optim and, for the data stream, rollout), written into
    every checkpoint's manifest and compared field by field on resume (``compare_identity``), as the config's own
    ``to_dict`` records all of it; passing the five groups one by one would say the same thing longer."""
    m, a, o = cfg.model, cfg.algorithm, cfg.optim
    d = cfg.data
    from rlhf.algorithms import advantages  # noqa: F401 - registers the estimators
    from rlhf.algorithms.registry import ADVANTAGE_ESTIMATORS

    spec = ADVANTAGE_ESTIMATORS.get(a.advantage_estimator)
    needs_critic = getattr(spec, "needs_critic", None)
    ident = {"pretrain_shape": _model_shape(m.pretrain), "lora_rank": m.lora_rank, "needs_critic": needs_critic,
             "critic_pretrain_shape": _model_shape(m.critic_pretrain),
             "pretrain": _norm_path(m.pretrain), "ref_pretrain": _norm_path(m.ref_pretrain),
             "critic_pretrain": _norm_path(m.critic_pretrain), "reward_pretrain": _norm_path(m.reward_pretrain),
             "dataset": getattr(d, "dataset", None), "prompt_data": getattr(d, "prompt_data", None),
             "advantage_estimator": a.advantage_estimator}
    for k in REPORTED_FLAGS:
        for grp in (o, a, d):
            if hasattr(grp, k):
                ident[k] = getattr(grp, k)
                break
    groups = list(vars(cfg).values())
    ident["data_stream"] = {k: _flag_value(groups, k) for k in stream_flags(d)}
    return ident


def stream_flags(data) -> Dict[str, str]:
    """The flags that place each step in the data stream: RL (``data``, the --data flag group, names
    --prompt_data) or supervised."""
    return RL_STREAM_FLAGS if getattr(data, "prompt_data", None) else SUPERVISED_STREAM_FLAGS


def _flag_value(groups: List, name: str):
    """Flag ``name``'s value in the first of the flag ``groups`` that has it (None when none does)."""
    for grp in groups:
        if hasattr(grp, name):
            return getattr(grp, name)
    return None


def compare_identity(path: str, saved: dict, now: dict) -> List[str]:
    """Raise CheckpointError when checkpoint ``path`` was saved by a different run (a shape-changing flag, or a
    different model / data / objective); return notices for harmless changes (learning rate, steps)."""
    if not saved:
        return []
    for k in SHAPE_FLAGS + SAME_RUN_FLAGS:
        if k in saved and saved[k] != now.get(k):
            flag = k.replace("_shape", "").replace("needs_critic", "advantage_estimator")
            kind = "changes the model's shapes" if k in SHAPE_FLAGS else "makes it a different run"
            raise CheckpointError(
                f"checkpoint {path} was saved with --{flag} {_show(saved, k)}, this run has {_show(now, k)}: "
                f"that {kind}, so resuming it would load another run's weights. Give this run its own --ckpt_path, "
                f"or rerun with the saved --{flag}")
    check_stream(path, saved.get("data_stream") or {}, now.get("data_stream") or {})
    changed = [f"--{k} {saved[k]} -> {now.get(k)}" for k in REPORTED_FLAGS if k in saved and saved[k] != now.get(k)
               and k not in (now.get("data_stream") or {})]
    return [f"[resume] {path}: changed since the save: {', '.join(changed)}"] if changed else []


def check_stream(path: str, saved: dict, now: dict) -> None:
    """CheckpointError naming the flag when a data-stream flag differs from the checkpoint's (a checkpoint saved
    before these were recorded is not checked)."""
    why = {**SUPERVISED_STREAM_FLAGS, **RL_STREAM_FLAGS}
    for k, v in saved.items():
        if k in now and now[k] != v:
            raise CheckpointError(
                f"checkpoint {path} was saved with --{k} {v}, this run has --{k} {now[k]}: {why.get(k, k)}, so "
                f"resuming with another value would train some of the data again and skip the rest. Resume with --{k} "
                f"{v}, or give this run its own --ckpt_path to start over with --{k} {now[k]}")


def _show(ident: dict, k: str):
    if k.endswith("_shape"):
        return ident.get(k.replace("_shape", ""), ident.get(k))
    return ident.get(k)
