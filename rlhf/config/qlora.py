"""--load_in_4bit (QLoRA, OpenRLHF's --ds.load_in_4bit): checked before any process group.

A 4-bit (nf4) frozen base through bitsandbytes (transformers ``BitsAndBytesConfig(load_in_4bit=True)``), with LoRA
adapters trained over it, as OpenRLHF's ``get_llm_for_sequence_regression`` / ``Actor(load_in_4bit=...)``.
bitsandbytes' 4-bit kernels need CUDA (and the package): refused elsewhere, with the reason.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

from rlhf.errors import ConfigError


def check_load_in_4bit(load_in_4bit: bool, lora_rank: int, cuda: Optional[bool] = None,
                       has_bnb: Optional[bool] = None) -> None:
    """Raise ``ConfigError`` unless --load_in_4bit can run here (``cuda`` / ``has_bnb``: None asks this machine)."""
    if not load_in_4bit:
        return
    if lora_rank <= 0:
        raise ConfigError("load_in_4bit", "--load_in_4bit freezes a 4-bit base and trains LoRA adapters over it: "
                                          "add --lora_rank 16 (or drop --load_in_4bit)")
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if not cuda:
        raise ConfigError("load_in_4bit", "--load_in_4bit: bitsandbytes' 4-bit kernels need a CUDA GPU and this "
                                          "machine has none: drop --load_in_4bit (LoRA over a bf16 base: --bf16 "
                                          "--lora_rank 16)")
    if has_bnb is None:
        has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    if not has_bnb:
        raise ConfigError("load_in_4bit", "--load_in_4bit needs bitsandbytes, which is not installed: pip install "
                                          "bitsandbytes (or drop --load_in_4bit)")
