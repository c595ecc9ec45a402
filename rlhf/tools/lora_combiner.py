"""Merge a LoRA adapter into its base model and save a plain HF model folder (no adapter left).

    python -m rlhf.tools.lora_combiner --model_path BASE --lora_path ADAPTER --output_path OUT \\
        [--is_rm] [--param_dtype bf16|fp16|fp32]

Mirrors OpenRLHF's openrlhf/cli/lora_combiner.py (same flags; its current spelling ``--ds.param_dtype`` and the
older ``--bf16`` are accepted too): the base is loaded in ``--param_dtype`` (default bf16, as there) as a causal
LM, or with ``--is_rm`` as a one-label sequence-classification model; the adapter goes on with peft's
``PeftModel.from_pretrained`` and peft's ``merge_and_unload`` folds every LoRA pair into its weight
(W + scaling * B @ A); the merged model and the base's tokenizer are saved with ``save_pretrained``.

Reward models (``--is_rm``): the value head comes from the base, read under its config's ``value_head_prefix``
(OpenRLHF writes e.g. ``value_head``; HF's name is ``score``) as every RM loader here does
(``rlhf.models.load.load_reward_model``), unless the adapter carries a trained copy of the head (peft's
``modules_to_save``, which a ``SEQ_CLS`` adapter has): then merge_and_unload keeps the adapter's copy (and a
causal-LM base without any head is fine; without either, the head would be random: an error). The merged
folder stores the head as ``score`` and says so in its config (``value_head_prefix: score``); a
``reward_norm.json`` (the reward mean / std PPO normalises with) next to the adapter, else next to the base, is
copied along.

The trainers here save a LoRA run as such an adapter folder (adapter_config.json, adapter_model.safetensors and
the tokenizer in --save_path); this tool turns it into a model any HF / vLLM loader reads.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import List, Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class CombineError(ValueError):
    pass


def check_paths(model_path: str, lora_path: str, output_path: str) -> None:
    """CombineError naming the flag when --lora_path is no peft adapter or --output_path would overwrite an input."""
    if not os.path.isfile(os.path.join(lora_path, "adapter_config.json")):
        what = "a full model (config.json), not an adapter" if os.path.isfile(os.path.join(lora_path, "config.json")) \
            else "no such directory" if not os.path.isdir(lora_path) else "no adapter_config.json in it"
        raise CombineError(f"--lora_path {lora_path}: {what}; give the folder a --lora_rank run saved "
                           f"(adapter_config.json + adapter_model.safetensors)")
    if os.path.exists(model_path) and not os.path.isfile(os.path.join(model_path, "config.json")):
        raise CombineError(f"--model_path {model_path}: no config.json in it; give the base model's HF folder (the "
                           f"--pretrain the adapter was trained on)")
    out = os.path.realpath(output_path)
    for flag, p in (("model_path", model_path), ("lora_path", lora_path)):
        if os.path.exists(p) and os.path.realpath(p) == out:
            raise CombineError(f"--output_path {output_path} is the --{flag}: it would be overwritten; give a new "
                               f"folder, e.g. --output_path {output_path.rstrip('/')}-merged")


def adapter_has_head(lora_path: str) -> bool:
    """Whether the adapter carries its own value head (peft ``modules_to_save``; a SEQ_CLS adapter lists score)."""
    with open(os.path.join(lora_path, "adapter_config.json")) as fh:
        return "score" in (json.load(fh).get("modules_to_save") or [])


def load_base(model_path: str, is_rm: bool, dtype: torch.dtype, lora_path: Optional[str] = None):
    """The base model in ``dtype``: a causal LM, or (is_rm) a 1-label sequence classifier whose ``score`` holds the
    head saved under the config's value_head_prefix (the rule of rlhf.models.load.load_reward_model). A base without
    a head (a causal LM) is taken only when the adapter brings the head (its copy replaces the random one)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf.models.load import ModelKindError, _head_key, quiet_progress, weight_index

    with quiet_progress():
        if not is_rm:
            return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, low_cpu_mem_usage=True)
        model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=dtype,
                                                                   low_cpu_mem_usage=True)
    try:
        head = _head_key(model_path, None) if os.path.isdir(model_path) else "score.weight"
    except ModelKindError as e:
        if lora_path and adapter_has_head(lora_path):
            return model
        raise CombineError(f"--is_rm: {e}; and the adapter in --lora_path carries no head of its own (peft "
                           f"modules_to_save), so the merged reward model's head would be random") from None
    if head != "score.weight":
        from safetensors import safe_open

        with safe_open(weight_index(model_path)[head], "pt") as f:
            w = f.get_tensor(head)
        with torch.no_grad():
            model.score.weight.copy_(w.reshape(model.score.weight.shape).to(dtype))
    return model


def apply_lora(model_path: str, lora_path: str, output_path: str, is_rm: bool = False,
               param_dtype: str = "bf16") -> str:
    """Base + adapter -> merged HF folder at ``output_path`` (written under a temp name, then renamed)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from rlhf.models.load import RM_NORM_FILE

    check_paths(model_path, lora_path, output_path)
    dtype = DTYPES[param_dtype]
    print(f"Loading the base model from {model_path} ({param_dtype})", flush=True)
    base = load_base(model_path, is_rm, dtype, lora_path)
    print(f"Loading the LoRA adapter from {lora_path}", flush=True)
    merged = PeftModel.from_pretrained(base, lora_path).merge_and_unload()
    merged = merged.to(dtype)  # every saved tensor in --param_dtype (peft may upcast adapter-side copies)
    if is_rm and getattr(merged.config, "value_head_prefix", None) not in (None, "score"):
        merged.config.value_head_prefix = "score"  # the head is saved as score.weight now
    print(f"Saving the complete model to {output_path}", flush=True)
    tmp = output_path.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    from rlhf.models.load import quiet_save

    with quiet_save():  # no DeepSpeed import ("Setting accelerator to CPU") or shard bars
        merged.save_pretrained(tmp, safe_serialization=True)
    try:
        tok = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):  # a base folder without a tokenizer: the adapter folder's (the trainers save one)
        tok = AutoTokenizer.from_pretrained(lora_path)
    tok.save_pretrained(tmp)
    if is_rm:
        for src in (lora_path, model_path):
            if os.path.isfile(os.path.join(src, RM_NORM_FILE)):
                shutil.copy(os.path.join(src, RM_NORM_FILE), os.path.join(tmp, RM_NORM_FILE))
                break
    if os.path.exists(output_path):
        shutil.rmtree(output_path)
    os.replace(tmp, output_path)
    return output_path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlhf.tools.lora_combiner",
                                description="Apply LoRA to a base model and save the combined model.")
    p.add_argument("--model_path", required=True, help="base model directory (the --pretrain the adapter was "
                                                       "trained on)")
    p.add_argument("--lora_path", required=True, help="LoRA adapter directory (adapter_config.json)")
    p.add_argument("--output_path", required=True, help="where to save the combined model")
    p.add_argument("--is_rm", action="store_true", help="a reward model (AutoModelForSequenceClassification, "
                                                         "1 label; the value head is kept)")
    p.add_argument("--param_dtype", "--ds.param_dtype", dest="param_dtype", default="bf16", choices=sorted(DTYPES),
                   help="dtype of the merge and the saved weights (default bf16, as OpenRLHF)")
    p.add_argument("--bf16", action="store_const", const="bf16", dest="param_dtype",
                   help="OpenRLHF's older spelling of --param_dtype bf16")
    return p


def main(argv: Optional[List[str]] = None) -> str:
    a = parser().parse_args(argv)
    try:
        return apply_lora(a.model_path, a.lora_path, a.output_path, a.is_rm, a.param_dtype)
    except CombineError as e:
        raise SystemExit(f"lora_combiner: {e}") from None


if __name__ == "__main__":
    main()
