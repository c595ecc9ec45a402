"""A decoder's dimensions, read from its config.json (no weights), and the parameter counts the planner needs.

``ModelDims.from_pretrained(path_or_name)`` reads the config with transformers' ``AutoConfig`` (nothing else is
read or downloaded beyond config.json); ``KNOWN`` holds the public configurations of the recipes' models
(Llama-3-70B, Qwen2.5-7B, Qwen2.5-0.5B: the numbers of their config.json files on the Hub), so the plans in
docs/memory_plans.md and the tests need no download.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict

# the fields of each model's config.json that the planner reads (values as published with the models)
KNOWN: Dict[str, Dict] = {
    "llama3-70b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8192,
                       intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, torch_dtype="bfloat16"),
    "qwen2.5-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, torch_dtype="bfloat16"),
}


# Hub names of the recipes' models -> KNOWN (the same numbers as their config.json), so a plan needs no download
HUB_NAMES = {
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama3-70b", "meta-llama/Meta-Llama-3-70B": "llama3-70b",
    "OpenRLHF/Llama-3-70b-rm": "llama3-70b",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b", "Qwen/Qwen2.5-7B": "qwen2.5-7b",
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b",
}


def write_config(name: str, path: str) -> str:
    """Write KNOWN[name] as ``path/config.json`` (a directory AutoConfig reads); returns ``path``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(KNOWN[name], fh, indent=1)
    return path


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False      # Qwen2 has q/k/v biases, Llama none
    vision: int = 0             # a vision-language model's vision tower (rlhf.models.vision.vision_tower_params)
    experts: int = 0            # MoE: experts per layer (Qwen3-MoE num_experts, Mixtral num_local_experts; 0: dense)
    expert_intermediate: int = 0  # MoE: each expert's intermediate size (moe_intermediate_size, else intermediate)

    @classmethod
    def from_config(cls, c) -> ModelDims:
        from rlhf.models.vision import vision_tower_params

        vision, c = vision_tower_params(c), (getattr(c, "text_config", None) or c)  # a VLM: its language model
        heads = c.num_attention_heads
        hd = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(hidden=c.hidden_size, layers=c.num_hidden_layers, heads=heads,
                   kv_heads=getattr(c, "num_key_value_heads", None) or heads, head_dim=hd,
                   intermediate=c.intermediate_size, vocab=c.vocab_size,
                   tied=bool(getattr(c, "tie_word_embeddings", False)),
                   qkv_bias=getattr(c, "model_type", "") in ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
                   or bool(getattr(c, "attention_bias", False)), vision=vision,
                   experts=int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0),
                   expert_intermediate=int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size))

    @classmethod
    def from_pretrained(cls, path: str) -> ModelDims:
        """Read config.json only (transformers' AutoConfig: no weights are opened)."""
        from transformers import AutoConfig

        return cls.from_config(AutoConfig.from_pretrained(path))

    @classmethod
    def known(cls, name: str) -> ModelDims:
        from types import SimpleNamespace

        return cls.from_config(SimpleNamespace(**KNOWN[name]))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One decoder block: q, k, v, o projections (+ q/k/v biases), gate/up/down, two RMSNorm weights.

            h (q + 2 kv) + q h + 3 h i + 2 h  [+ q + 2 kv biases]"""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        mlp = self.layer_expert_params + h * self.experts if self.experts else 3 * h * i  # MoE: experts + router
        return h * (q + 2 * kv) + q * h + mlp + 2 * h + ((q + 2 * kv) if self.qkv_bias else 0)

    @property
    def layer_expert_params(self) -> int:
        """One MoE block's experts, E x 3 h i_e (every layer sparse; 0 for a dense model)."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head's own weight (0 when tied to the embedding)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """What FSDP2's root unit holds: embedding, final norm, LM head."""
        return self.embed_params + self.head_params + self.hidden

    @property
    def params(self) -> int:
        """Causal LM: L blocks + embedding + final norm + untied head (+ a VLM's vision tower)."""
        return self.layers * self.layer_params + self.root_params + self.vision

    @property
    def value_params(self) -> int:
        """A critic / reward model: the backbone and a scalar head (h -> 1) instead of the LM head."""
        return self.layers * self.layer_params + self.embed_params + self.hidden + self.hidden


def dims_of(path: str) -> ModelDims:
    """A model directory's config.json; else a KNOWN name or a hub name of HUB_NAMES; else AutoConfig by hub name
    (config.json only)."""
    if os.path.isdir(os.path.expanduser(path)):
        return ModelDims.from_pretrained(os.path.expanduser(path))
    name = path if path in KNOWN else HUB_NAMES.get(path)
    if name is not None:
        return ModelDims.known(name)
    return ModelDims.from_pretrained(path)
