"""Bench kits by size, and the settings line printed from the kit actually used.

    tiny    qwen2, 2 layers, hidden 64: the test kit (vocab = the 263-token tokenizer); measures Python overhead
    medium  qwen2, 6 layers, hidden 256, 32000-token vocabulary (~22M parameters, 16M of them in the embeddings and
            the untied LM head): the full-vocabulary log-softmax costs what it costs in real RLHF

The medium kit keeps the small tokenizer: its config's vocabulary (32000) is larger than the tokenizer (263);
ids past the tokenizer decode to nothing, so a random model's completions run to the length limit on both sides
(the bench's 128 / 512 new tokens are then exactly the tokens generated and trained on).
"""
from __future__ import annotations

import json
import os
from typing import Dict

KITS: Dict[str, Dict] = {
    "tiny": dict(arch="qwen2", layers=2, hidden=64, intermediate=128, vocab=None),
    "medium": dict(arch="qwen2", layers=6, hidden=256, intermediate=1024, vocab=32000),
}
STAMP = "bench_kit.json"


def build_kit(size: str, path: str) -> str:
    """The kit ``size`` in ``path`` (built once; rebuilt when the folder holds another size)."""
    from rlhf.models.tiny_kit import make_tiny

    spec = KITS[size]
    stamp = os.path.join(path, STAMP)
    if os.path.isfile(stamp) and json.load(open(stamp)) == dict(spec, size=size):
        return path
    make_tiny(path, arch=spec["arch"], layers=spec["layers"], hidden=spec["hidden"])
    if spec["vocab"] is not None or spec["intermediate"] != 2 * spec["hidden"]:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(path)
        cfg.vocab_size = spec["vocab"] or cfg.vocab_size
        cfg.intermediate_size = spec["intermediate"]
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    with open(stamp, "w") as fh:
        json.dump(dict(spec, size=size), fh)
    return path


def kit_settings(path: str) -> Dict:
    """What the model in ``path`` is, read from its files (not from the size's name)."""
    from transformers import AutoConfig, AutoTokenizer

    c = AutoConfig.from_pretrained(path)
    h, L, i, v = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    embed = v * h * (1 if c.tie_word_embeddings else 2)
    params = L * per_layer + embed + h
    size = json.load(open(os.path.join(path, STAMP)))["size"] if os.path.isfile(os.path.join(path, STAMP)) else "?"
    return {"kit": size, "model": f"{c.model_type} {L}L h{h} ffn{i}", "vocab": v,
            "tokenizer_vocab": len(AutoTokenizer.from_pretrained(path)), "params_M": round(params / 1e6, 2),
            "embed_and_head_M": round(embed / 1e6, 2)}
