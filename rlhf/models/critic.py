"""Critic: LM backbone + scalar value head, values at the action positions."""
from __future__ import annotations

import os

import torch
from torch import nn

from rlhf.distributed.sequence_parallel import sp_of

from .forward import position_ids_from_mask, sp_values


class CriticModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, gradient_checkpointing: bool = False, on_meta: bool = False,
                        flash_attn: bool = False):
        """Trainable: fp32 weights (the optimizer's masters; --bf16 is the engine's compute dtype) and the
        attention implementation of --flash_attn, both explicit (load.weight_dtype)."""
        from transformers import AutoModel

        from .load import attn_implementation, from_pretrained_or_meta, weight_dtype

        kw = dict(dtype=weight_dtype(False, trainable=True), attn_implementation=attn_implementation(flash_attn))
        if on_meta:
            backbone = from_pretrained_or_meta(AutoModel, path, True, **kw)
        else:  # a causal LM's lm_head is "unexpected" here by design: report only what would start random
            backbone, info = from_pretrained_or_meta(AutoModel, path, report=False, output_loading_info=True, **kw)
            missing = sorted(info.get("missing_keys") or [])
            if missing and os.environ.get("RANK", "0") == "0":
                print(f"[critic] {path}: {len(missing)} backbone weights are not in the checkpoint and start at "
                      f"random: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}", flush=True)
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if on_meta:  # value head and backbone shards arrive from rank 0 (FSDP2Engine load_on_first)
            with torch.device("meta"):
                return cls(backbone, backbone.config.hidden_size)
        model = cls(backbone, backbone.config.hidden_size)
        head = os.path.join(path, "value_head.pt")
        if os.path.isfile(head):
            model.value_head.load_state_dict(torch.load(head, map_location="cpu"))
        return model

    def forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
        """V(s_t) for the states before each of the last num_actions tokens: (B, num_actions)."""
        if sp_of(self) is not None:  # --ring_attn_size: this rank's slice of the packed row (0 at response padding)
            return sp_values(self, sequences, attention_mask, num_actions)
        h = self.backbone(input_ids=sequences, attention_mask=attention_mask,
                          position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
        # a fresh tensor, not a view (squeeze): FSDP2 warns on every forward of a root module that returns a view
        return self.value_head(h[:, -num_actions - 1:-1])[..., 0].to(torch.float32, copy=True)

    def save_hf(self, state_dict: dict, tokenizer, path: str) -> None:
        """Write the backbone (HF safetensors) and ``value_head.pt`` under a temporary name, then rename: the
        directory ``from_pretrained`` (and ``--critic_pretrain``) reads back.  ``state_dict``: the full weights."""
        import shutil

        tmp = path.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        backbone = {k[len("backbone."):]: v for k, v in state_dict.items() if k.startswith("backbone.")}
        from .load import quiet_save

        with quiet_save():
            self.backbone.save_pretrained(tmp, state_dict=backbone, safe_serialization=True)
        torch.save({k[len("value_head."):]: v for k, v in state_dict.items() if k.startswith("value_head.")},
                   os.path.join(tmp, "value_head.pt"))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
