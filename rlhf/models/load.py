"""Load HF models and tokenizers from a local dir (or a hub name, when the machine can reach one)."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from rlhf.console import is_rank0
from rlhf.errors import ModelKindError
from rlhf.utils.quiet import load_report, quiet_progress


def resolve_pretrain(path: Optional[str]) -> str:
    """None means the built-in tiny kit (built on first use)."""
    if path:
        return os.path.expanduser(path)
    from rlhf.models.tiny_kit import ensure_tiny

    return ensure_tiny()


CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
REWARD_SUFFIXES = ("ForSequenceClassification", "RewardModel", "CriticModel")  # the last two: OpenRLHF's classes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or path.count("/") != 1 or os.path.exists(path)


def model_architectures(path: str, flag: str) -> list:
    """config.json's ``architectures`` of a local model dir (checked: exists, is a dir, holds config.json)."""
    if not os.path.exists(path):
        raise ModelKindError(flag, f"--{flag} {path}: no such directory (give the directory save_pretrained wrote, "
                                   f"or a hub name org/model on a machine that can reach the hub)")
    if not os.path.isdir(path):
        raise ModelKindError(flag, f"--{flag} {path} is a file; give the model directory that holds config.json")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg) and os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ModelKindError(flag, _adapter_message(path, flag))
    if not os.path.isfile(cfg):
        listing = ", ".join(sorted(os.listdir(path))[:8]) or "nothing"
        raise ModelKindError(flag, f"--{flag} {path} is not a model directory: no config.json (it holds {listing}); "
                                   f"give the directory save_pretrained wrote")
    try:
        with open(cfg) as fh:
            return list(json.load(fh).get("architectures") or [])
    except ValueError as e:
        raise ModelKindError(flag, f"--{flag} {path}: config.json is not valid JSON ({e})") from None


def _adapter_message(path: str, flag: str) -> str:
    """A peft adapter folder (adapter_config.json, no config.json: what a --lora_rank run saves) given where a model
    is needed: name the base it records and the merge that makes a model of it."""
    try:
        with open(os.path.join(path, "adapter_config.json")) as fh:
            base = json.load(fh).get("base_model_name_or_path") or "BASE"
    except ValueError:
        base = "BASE"
    return (f"--{flag} {path} is a LoRA adapter (trained on {base}), not a model: merge it into its base first, "
            f"python -m rlhf.tools.lora_combiner --model_path {base} --lora_path {path} --output_path "
            f"{path.rstrip('/')}_merged, and give --{flag} {path.rstrip('/')}_merged")


def hub_offline() -> Optional[str]:
    """The variable that turns the hub off ("HF_HUB_OFFLINE=true"), read as huggingface_hub reads it (1, ON, YES,
    TRUE in any case: huggingface_hub/constants.py ``_is_true``), or None when the hub may be reached."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var}={os.environ[var]}"
    return None


def hub_cached(name: str) -> bool:
    """A hub model whose config.json is in the local hub cache (from_pretrained loads it offline)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # not a valid repo id, no huggingface_hub: not cached
        return False


def check_model_dir(path: str, want: str, flag: str, need_tokenizer: bool = False,
                    value_head_prefix: Optional[str] = None) -> None:
    """Fail before any process group when ``path`` is not the kind of model ``flag`` needs.

    want: "causal" (a language model), "reward" (a *ForSequenceClassification reward model) or "any".
    A hub name (org/model) that is not a local path is left to from_pretrained unless offline mode is on and it is
    not in the hub cache.
    """
    path = os.path.expanduser(path)
    if not _looks_local(path):
        offline = hub_offline()
        if offline and not hub_cached(path):
            raise ModelKindError(flag, f"--{flag} {path}: not a local directory nor in the hub cache, and {offline} "
                                       f"forbids downloading it; give the local folder save_pretrained wrote, or "
                                       f"download it first where the hub is reachable (hf download {path})")
        return
    archs = model_architectures(path, flag)
    is_reward = any(a.endswith(REWARD_SUFFIXES) for a in archs)
    is_causal = any(a.endswith(CAUSAL_SUFFIXES) for a in archs)
    names = ", ".join(archs) or "no architectures listed"
    if want == "causal" and is_reward:
        raise ModelKindError(flag, f"--{flag} {path} is a reward model ({names}), not a language model: its LM head "
                                   f"would be initialised at random; give it as --reward_pretrain, and a causal LM "
                                   f"(*ForCausalLM) as --{flag}")
    if want == "reward" and not is_reward:
        what = f"a causal LM ({names}) without a reward head" if is_causal else f"not a reward model ({names})"
        raise ModelKindError(flag, f"--{flag} {path} is {what}: its score head would be initialised at random; "
                                   f"train one with rlhf.train_rm and give its --save_path (a *ForSequenceClassification "
                                   f"model)")
    if want == "reward" and is_reward:
        _head_key(path, value_head_prefix)
    if need_tokenizer and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ModelKindError(flag, f"--{flag} {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                                   f"save the tokenizer into the model directory (tokenizer.save_pretrained(dir))")


def attn_implementation(flash_attn: bool) -> str:
    return _attn(flash_attn)


def _attn(flash_attn: bool) -> str:
    if flash_attn:
        if not torch.cuda.is_available():
            raise RuntimeError("--flash_attn needs CUDA and the [flash] extra; drop the flag on CPU")
        return "flash_attention_2"
    return "sdpa"


def load_tokenizer(path: str, padding_side: str = "left"):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def from_pretrained_or_meta(auto_cls, path: str, on_meta: bool = False, config_kwargs=None, report: bool = True,
                            **kwargs):
    """``auto_cls.from_pretrained(path)``, or with on_meta the same architecture without weights (no host memory):
    the FSDP2 engine then fills the shards by broadcast from rank 0, so a node holds one copy, not one per rank.
    transformers' load report (missing / unexpected keys) is printed by rank 0 only, and not at all with
    ``report=False`` (a caller that checks ``output_loading_info`` itself)."""
    with quiet_progress(), load_report(report and is_rank0()):
        return _from_pretrained_or_meta(auto_cls, path, on_meta, config_kwargs, **kwargs)


def _from_pretrained_or_meta(auto_cls, path, on_meta, config_kwargs, **kwargs):
    from transformers import AutoConfig

    if on_meta:
        with torch.device("meta"):
            return auto_cls.from_config(AutoConfig.from_pretrained(path, **(config_kwargs or {})), **kwargs)
    return auto_cls.from_pretrained(path, **(config_kwargs or {}), **kwargs)


def weight_dtype(bf16: bool, trainable: bool, lora: bool = False) -> torch.dtype:
    """The dtype a model's weights are loaded (and stored) in.

    Trainable models: fp32 always, whatever --bf16 and --flash_attn say: the weights are the optimizer's master
    copy, and AdamW on bf16 weights loses every update smaller than 2^-8 of the weight (at lr 1e-6 nearly all of
    them); --bf16 is the compute dtype (FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16 mode with fp32 master
    partitions).  Frozen models (reference, reward model, the HF rollout engine) have no optimizer: bf16 under
    --bf16 halves their memory.  veRL does the same (verl/workers/fsdp_workers.py: model dtype fp32 for the actor,
    bf16 otherwise).  Always explicit: transformers 5 would otherwise load the checkpoint's own dtype.

    ``lora``: under --lora_rank the base weights are frozen (no optimizer steps them), so under --bf16 they are
    loaded in bf16 like any frozen model; the adapters, the only master weights, are fp32 (``apply_lora``).  veRL
    loads the LoRA actor's base in bf16 the same way (verl/workers/fsdp_workers.py: ``torch_dtype`` fp32 only for a
    fully trained actor)."""
    return torch.bfloat16 if bf16 and (not trainable or lora) else torch.float32


def load_causal_lm(path: str, bf16: bool = False, flash_attn: bool = False, gradient_checkpointing: bool = False,
                   lora_rank: int = 0, lora_alpha: int = 16, target_modules: str = "all-linear", on_meta: bool = False,
                   trainable: bool = True, freeze_visual: bool = False, load_in_4bit: bool = False):
    """on_meta: see from_pretrained_or_meta; trainable: see weight_dtype; freeze_visual: --freeze_visual_encoder
    (rlhf.models.vision.freeze_vision_tower); load_in_4bit (QLoRA, checked by rlhf.config.qlora): the frozen base in
    nf4 through bitsandbytes, bf16 compute (OpenRLHF's ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)``,
    openrlhf/models/actor.py)."""
    from rlhf.models.vision import causal_auto_class  # a vision-language model: AutoModelForImageTextToText

    quant = {}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        quant["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                          bnb_4bit_use_double_quant=True,
                                                          bnb_4bit_compute_dtype=torch.bfloat16)
    model = from_pretrained_or_meta(causal_auto_class(path), path, on_meta, dtype=weight_dtype(bf16, trainable, lora_rank > 0),
                                    attn_implementation=_attn(flash_attn), **quant)
    model.config.use_cache = False
    if freeze_visual:
        from rlhf.models.vision import freeze_vision_tower

        freeze_vision_tower(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank > 0:
        model = apply_lora(model, lora_rank, lora_alpha, target_modules)
    return model


def apply_lora(model, rank: int, alpha: int, target_modules: str, task_type: str = "CAUSAL_LM"):
    """peft LoRA over ``target_modules``. ``task_type="SEQ_CLS"`` (reward models) keeps the score head trainable and
    saved with the adapter (peft's modules_to_save for sequence classification), so ``rlhf.tools.lora_combiner
    --is_rm`` merges a trained head, not the random one."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover
        raise RuntimeError("--lora_rank needs peft: pip install 'rlhf[lora]'") from e
    targets = target_modules if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",")]
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                             task_type=task_type))
    trainable_in_fp32(model)
    return model


def trainable_in_fp32(model: torch.nn.Module) -> None:
    """The trainable parameters (LoRA adapters, a score head peft saves with them) in fp32, whatever the frozen
    base's dtype: they are the optimizer's master weights (``weight_dtype``).  peft upcasts bf16 adapters itself by
    default (``get_peft_model(autocast_adapter_dtype=True)``); said here, whatever peft's default becomes."""
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()


RM_NORM_FILE = "reward_norm.json"


def weight_index(path: str) -> dict:
    """{tensor name: safetensors file} of a local model dir ({} when it has no safetensors)."""
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(idx):
        with open(idx) as fh:
            return {k: os.path.join(path, f) for k, f in json.load(fh)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, "pt") as f:
            return {k: single for k in f.keys()}
    return {}


def _config_json(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        return {}
    with open(f) as fh:
        return json.load(fh)


def _head_key(path: str, value_head_prefix: Optional[str]) -> str:
    """The reward head's weight name: --value_head_prefix, else config.json's value_head_prefix (OpenRLHF
    writes it), else HF's 'score'; it must be in the checkpoint, or the head would be initialised at random."""
    prefix = value_head_prefix or _config_json(path).get("value_head_prefix") or "score"
    keys = weight_index(path)
    if keys and f"{prefix}.weight" not in keys:
        heads = sorted(k[:-len(".weight")] for k in keys if k.endswith(".weight") and "." not in k[:-len(".weight")]
                       and not k.startswith(("lm_head", "embed")))
        hint = f"; its top-level heads: {', '.join(heads)} -- e.g. --value_head_prefix {heads[0]}" if heads else ""
        raise ModelKindError("value_head_prefix", f"{path} has no reward head weight '{prefix}.weight' (it would be "
                                                  f"initialised at random){hint}")
    return f"{prefix}.weight"


def load_reward_model(path: str, bf16: bool = False, flash_attn: bool = False, on_meta: bool = False,
                      value_head_prefix: Optional[str] = None, **from_pretrained):
    """Sequence-classification RM; returns (model, (mean, std)) with normalisation stats saved by train_rm
    (reward_norm.json) or by OpenRLHF (config.json's mean / std, written by its train_rm whatever the flags); the
    caller applies them only with --normalize_reward (OpenRLHF openrlhf/models/model.py: ``if
    self.normalize_reward: reward = (reward - self.mean) / self.std``, the flag overriding config.json's).  A head saved under another
    name (OpenRLHF's --value_head_prefix, e.g. value_head) is loaded into HF's ``score``.  ``from_pretrained``
    overrides or adds ``from_pretrained`` arguments (rlhf.serve_rm: ``dtype``, ``attn_implementation``,
    ``device_map``)."""
    from transformers import AutoModelForSequenceClassification

    head = _head_key(path, value_head_prefix) if os.path.isdir(path) else "score.weight"
    kwargs = {"dtype": weight_dtype(bf16, trainable=False), **from_pretrained}
    if "attn_implementation" not in kwargs:
        kwargs["attn_implementation"] = _attn(flash_attn)
    model = from_pretrained_or_meta(AutoModelForSequenceClassification, path, on_meta, {"num_labels": 1}, **kwargs)
    if head != "score.weight" and not on_meta:
        from safetensors import safe_open

        with safe_open(weight_index(path)[head], "pt") as f:
            w = f.get_tensor(head)
        with torch.no_grad():
            model.score.weight.copy_(w.reshape(model.score.weight.shape).to(model.score.weight.dtype))
    model.requires_grad_(False)
    model.eval()
    return model, saved_reward_stats(path)


def saved_reward_stats(path: str) -> tuple:
    """(mean, std) saved with a reward model: train_rm's reward_norm.json, else OpenRLHF's config.json mean / std,
    else (0, 1).  ``load_reward_model`` returns them, and the critic started from a reward model folds them into
    its value head (rlhf.models.critic)."""
    stats = (0.0, 1.0)
    f = os.path.join(path, RM_NORM_FILE)
    cfg = _config_json(path) if os.path.isdir(path) else {}
    if os.path.isfile(f):
        with open(f) as fh:
            d = json.load(fh)
        stats = (float(d["mean"]), float(d["std"]))
    elif "mean" in cfg and "std" in cfg:  # OpenRLHF's train_rm writes them (config.normalize_reward is the flag's)
        stats = (float(cfg["mean"]), float(cfg["std"]))
    return stats
