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

Checked before anything loads: the adapter was trained on --model_path (peft records its base as
``base_model_name_or_path`` in adapter_config.json: the same folder, a copy whose weights match, or the same hub
name; ``--allow_base_mismatch`` merges anyway) and every LoRA pair fits its base weight's shape; --output_path may
be an existing folder (even the one holding the inputs): only an earlier export's files there are replaced
(``rlhf.checkpoint.install_export``), and files the merge would overwrite that no export wrote are refused.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

import torch

from rlhf.checkpoint import CheckpointError, begin_export, check_export_target, install_export
from rlhf.errors import CombineError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def check_output(output_path: str, is_rm: bool) -> None:
    """CombineError when --output_path holds files the merge would overwrite that no export wrote (checked before
    the merge; nothing there is ever deleted)."""
    from rlhf.models.load import RM_NORM_FILE

    try:
        check_export_target(output_path, "output_path", (RM_NORM_FILE,) if is_rm else ())
    except CheckpointError as e:
        raise CombineError(str(e)) from None


# ---------------------------------------------------------------- the adapter's base

_LORA_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def recorded_base(lora_path: str) -> Optional[str]:
    """The base peft recorded when the adapter was made (adapter_config.json ``base_model_name_or_path``)."""
    with open(os.path.join(lora_path, "adapter_config.json")) as fh:
        return json.load(fh).get("base_model_name_or_path") or None


def _hub_id(path: str) -> Optional[str]:
    """'org/name' for a folder in the HF cache (.../models--org--name/snapshots/<rev>), else None."""
    m = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", os.path.realpath(path).replace(os.sep, "/"))
    return f"{m.group(1)}/{m.group(2)}" if m else None


def _sample_tensors(path: str, keys: List[str]) -> Dict[str, torch.Tensor]:
    from safetensors import safe_open

    from rlhf.models.load import weight_index

    idx = weight_index(path)
    out = {}
    for k in keys:
        with safe_open(idx[k], "pt") as f:
            out[k] = f.get_tensor(k).to(torch.float32)
    return out


def same_weights(a: str, b: str, samples: int = 4) -> Optional[bool]:
    """Whether two local model folders hold the same weights, judged on a few tensors both have (dtype and sharding
    may differ: a bf16 copy of an fp32 model matches); None when either has no safetensors to compare."""
    from rlhf.models.load import weight_index

    ia, ib = weight_index(a), weight_index(b)
    sa, sb = _base_shapes(a), _base_shapes(b)
    # tensors both have with the same shape, small enough to read quickly (no 2 GB embedding of a 70B model)
    common = sorted(k for k in set(ia) & set(ib) if sa.get(k) == sb.get(k) and _numel(sa[k]) <= 1 << 24)
    if not common:
        return None
    picks = [common[i * (len(common) - 1) // max(1, samples - 1)] for i in range(samples)]
    ta, tb = _sample_tensors(a, picks), _sample_tensors(b, picks)
    return all(torch.allclose(ta[k], tb[k], rtol=1e-2, atol=1e-3) for k in picks)


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def base_mismatch(model_path: str, recorded: str) -> Optional[str]:
    """Why --model_path is not the base the adapter recorded (None: it is, or nothing tells them apart)."""
    here = os.path.isdir(model_path)
    if os.path.isdir(recorded) and here:
        if os.path.realpath(recorded) == os.path.realpath(model_path):
            return None
        same = same_weights(model_path, recorded)
        return None if same in (True, None) else "their weights differ"
    here, there = _names(model_path), _names(recorded)
    if here & there or {os.path.basename(n) for n in here} & {os.path.basename(n) for n in there}:
        return None
    return "the names differ" + ("" if os.path.exists(recorded) else f" ({recorded} is not a folder here)")


def _names(path: str) -> set:
    """How a model is named: its hub id when it is a folder of the HF cache, else the path (lower case); the last
    part is compared too, so /models/Qwen2.5-0.5B matches Qwen/Qwen2.5-0.5B."""
    return {(_hub_id(path) or path.rstrip("/")).lower()}


def _base_shapes(model_path: str) -> Dict[str, Tuple[int, ...]]:
    from safetensors import safe_open

    from rlhf.models.load import weight_index

    shapes: Dict[str, Tuple[int, ...]] = {}
    by_file: Dict[str, List[str]] = {}
    for k, f in weight_index(model_path).items():
        by_file.setdefault(f, []).append(k)
    for f, keys in by_file.items():
        with safe_open(f, "pt") as fh:
            for k in keys:
                shapes[k] = tuple(fh.get_slice(k).get_shape())
    return shapes


def shape_mismatch(model_path: str, lora_path: str) -> Optional[str]:
    """The first LoRA pair that does not fit its base weight (lora_A: rank x in, lora_B: out x rank), or None;
    pairs whose base weight is not found by name are left to peft."""
    from safetensors import safe_open

    ad = os.path.join(lora_path, "adapter_model.safetensors")
    if not os.path.isfile(ad) or not os.path.isdir(model_path):
        return None
    base = _base_shapes(model_path)
    with safe_open(ad, "pt") as fh:
        for k in sorted(fh.keys()):
            m = _LORA_KEY.match(k)
            if not m:
                continue
            module, ab = m.groups()
            target = next((c for c in (f"{module}.weight", f"{module}.base_layer.weight",
                                       f"model.{module}.weight", module.split(".", 1)[-1] + ".weight")
                           if c in base), None)
            if target is None or len(base[target]) != 2:
                continue
            shape = tuple(fh.get_slice(k).get_shape())
            out_f, in_f = base[target]
            fits = shape[1] == in_f if ab == "A" else shape[0] == out_f
            if not fits:
                side = f"in_features {in_f}" if ab == "A" else f"out_features {out_f}"
                return f"{k} has shape {list(shape)}, but {target} in --model_path has shape {[out_f, in_f]} ({side})"
    return None


def check_base(model_path: str, lora_path: str, allow_mismatch: bool = False) -> List[str]:
    """CombineError naming both when the adapter does not belong to --model_path; notices otherwise."""
    recorded = recorded_base(lora_path)
    shapes = shape_mismatch(model_path, lora_path)
    if shapes:
        raise CombineError(f"--lora_path {lora_path} does not fit --model_path {model_path}: {shapes}. The adapter "
                           f"was trained on {recorded or 'a base it does not record'}; give that model as --model_path")
    if not recorded:
        return [f"--lora_path {lora_path}: adapter_config.json does not record base_model_name_or_path; the base "
                f"could not be checked (shapes fit)"]
    why = base_mismatch(model_path, recorded)
    if why is None:
        return []
    msg = (f"--lora_path {lora_path} was trained on {recorded} (adapter_config.json base_model_name_or_path), but "
           f"--model_path is {model_path}: {why}")
    if allow_mismatch:
        return [f"{msg}; merging anyway (--allow_base_mismatch)"]
    raise CombineError(f"{msg}. Give --model_path {recorded}, or add --allow_base_mismatch if {model_path} is that "
                       f"model under another name")


def adapter_has_head(lora_path: str) -> bool:
    """Whether the adapter carries its own value head (peft ``modules_to_save``; a SEQ_CLS adapter lists score)."""
    with open(os.path.join(lora_path, "adapter_config.json")) as fh:
        return "score" in (json.load(fh).get("modules_to_save") or [])


def load_base(model_path: str, is_rm: bool, dtype: torch.dtype, lora_path: Optional[str] = None):
    """The base model in ``dtype``: a causal LM, or (is_rm) a 1-label sequence classifier whose ``score`` holds the
    head saved under the config's value_head_prefix (the rule of rlhf.models.load.load_reward_model). A base without
    a head (a causal LM) is taken only when the adapter brings the head (its copy replaces the random one)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf.models.load import ModelKindError, _head_key, weight_index
    from rlhf.utils.quiet import quiet_progress

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
               param_dtype: str = "bf16", allow_base_mismatch: bool = False) -> str:
    """Base + adapter -> merged HF folder at ``output_path`` (written beside it, then put in place by
    ``install_export``: only an earlier export's files there are replaced)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from rlhf.models.load import RM_NORM_FILE

    check_paths(model_path, lora_path, output_path)
    check_output(output_path, is_rm)
    for n in check_base(model_path, lora_path, allow_base_mismatch):
        print(f"lora_combiner: {n}", flush=True)
    dtype = DTYPES[param_dtype]
    print(f"Loading the base model from {model_path} ({param_dtype})", flush=True)
    base = load_base(model_path, is_rm, dtype, lora_path)
    print(f"Loading the LoRA adapter from {lora_path}", flush=True)
    merged = PeftModel.from_pretrained(base, lora_path).merge_and_unload()
    merged = merged.to(dtype)  # every saved tensor in --param_dtype (peft may upcast adapter-side copies)
    if is_rm and getattr(merged.config, "value_head_prefix", None) not in (None, "score"):
        merged.config.value_head_prefix = "score"  # the head is saved as score.weight now
    print(f"Saving the complete model to {output_path}", flush=True)
    try:
        tmp = begin_export(output_path)
    except CheckpointError as e:
        raise CombineError(str(e)) from None
    from rlhf.utils.quiet import quiet_save

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
    try:
        install_export(tmp, output_path)
    except CheckpointError as e:
        raise CombineError(str(e)) from None
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
    p.add_argument("--allow_base_mismatch", action="store_true",
                   help="merge even when --model_path is not the base the adapter records (adapter_config.json "
                        "base_model_name_or_path), e.g. the same model under another name; shapes must still fit")
    return p


def main(argv: Optional[List[str]] = None) -> str:
    a = parser().parse_args(argv)
    try:
        return apply_lora(a.model_path, a.lora_path, a.output_path, a.is_rm, a.param_dtype, a.allow_base_mismatch)
    except CombineError as e:
        raise SystemExit(f"lora_combiner: {e}") from None


if __name__ == "__main__":
    main()
