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
                       has_bnb: Optional[bool] = None, rl: bool = False) -> None:
    """Raise ``ConfigError`` unless --load_in_4bit can run here (``cuda`` / ``has_bnb``: None asks this machine).
    RL is refused: the weight sync would send the packed 4-bit base to the rollout engine, which has to read the
    base from the checkpoint instead (not wired yet); SFT, DPO and RM load the actor in 4 bits."""
    if not load_in_4bit:
        return
    if rl:
        raise ConfigError("load_in_4bit", "--load_in_4bit is not supported for RL yet: the rollout engine would "
                                          "receive the packed 4-bit base; use --lora_rank over a --bf16 base (the "
                                          "adapter sync sends the base once), or --load_in_4bit with SFT / DPO / RM")
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
