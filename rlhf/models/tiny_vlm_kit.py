"""Write an offline tiny vision-language kit (Qwen2-VL from a config, no download) and an image task.

    python -m rlhf.models.tiny_vlm_kit --out DIR [--hidden 64] [--seed 0]

DIR        Qwen2VLForConditionalGeneration (2 text layers, a 1-block vision tower with 8-pixel patches, merge 2),
           a tokenizer carrying the image tokens (<|vision_start|>, <|image_pad|>, <|vision_end|>), a chat template
           that renders {"type": "image"} content parts, and the image processor (``Qwen2VLImageProcessorPil``: PIL
           only, no torchvision) saved with save_pretrained; AutoImageProcessor / AutoModelForImageTextToText load it.
DIR/data   images/*.png (48 x 32 pixels: a coloured square on a grey background, at a random place) and
           vlm_prompts_*.jsonl ({"input", "images", "label"}), vlm_sft_*.jsonl (+ "output"),
           vlm_pref_*.jsonl ("chosen" the square's colour, "rejected" another), reward_colour.py (an OpenRLHF
           reward_func: 1 when the response starts with the colour).

The question is the same for every row ("What colour is the square?"): the answer is in the image only, so any
learning is learning to read it.  ``--hidden 128`` (head_dim 32) builds a kit vLLM's CPU attention accepts.
"""
from __future__ import annotations

import json
import os
import random

import click

from rlhf.models.tiny_kit import build_tokenizer, staged_dir

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (40, 60, 220)}
QUESTION = "What colour is the square?"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VLM_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
IMAGE_SIZE = (48, 32)  # width, height: 6 x 4 patches of 8 pixels, 6 image tokens after the 2 x 2 merge
REWARD_FILE = '''"""OpenRLHF-style reward_func of the tiny VLM kit: 1 when the response starts with the square's colour."""


def reward_func(queries, prompts, labels, **kwargs):
    import torch

    out = []
    for q, p, lab in zip(queries, prompts, labels):
        resp = q[len(p):] if q.startswith(p) else q
        out.append(1.0 if resp.strip().startswith(str(lab)) else 0.0)
    r = torch.tensor(out)
    return {"rewards": r, "scores": r, "extra_logs": {}}
'''


def build_vlm_tokenizer():
    """The tiny kit's BPE tokenizer plus the vision special tokens and one token per colour word."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.add_tokens(sorted(COLOURS))
    tok.chat_template = VLM_TEMPLATE
    return tok


def mrope_section(head_dim: int) -> list:
    """Qwen2-VL's split of the rotary half-dimension into (temporal, height, width): 1/4, 3/8, 3/8 (16, 24, 24 at
    head_dim 128)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def build_vlm_config(tok, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2):
    from transformers import Qwen2VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    special = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": mrope_section(hidden // heads)}, **special)
    vision = dict(depth=1, embed_dim=32, hidden_size=hidden, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, mlp_ratio=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, **special)


def draw(colour: str, rng: random.Random, size=IMAGE_SIZE):
    """A grey image with one 12-pixel square of ``colour`` at a random place (a little noise in the grey)."""
    from PIL import Image

    w, h = size
    g = rng.randint(110, 150)
    im = Image.new("RGB", size, (g, g, g))
    x, y = rng.randint(0, w - 12), rng.randint(0, h - 12)
    im.paste(COLOURS[colour], (x, y, x + 12, y + 12))
    return im


def vlm_rows(n: int, seed: int, image_dir: str, split: str):
    """(prompt rows, SFT rows, preference rows) of the colour task, images written under ``image_dir``."""
    rng = random.Random(seed)
    names = sorted(COLOURS)
    prompts, sft, pref = [], [], []
    for i in range(n):
        c = names[rng.randrange(len(names))]
        path = os.path.join(image_dir, f"{split}_{i}.png")
        draw(c, rng).save(path)
        wrong = names[(names.index(c) + 1 + rng.randrange(len(names) - 1)) % len(names)]
        base = {"input": QUESTION, "images": [path], "label": c}
        prompts.append(base)
        sft.append({**base, "output": c})
        pref.append({**base, "chosen": c, "rejected": wrong})
    return prompts, sft, pref


def make_tiny_vlm(out: str, hidden: int = 64, seed: int = 0, n_train: int = 96, n_eval: int = 24) -> str:
    """Build the kit into ``out`` atomically (module docstring); returns ``out``.  Image paths in the data are
    absolute (the final folder's)."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rlhf.data.arithmetic import write_jsonl

    torch.manual_seed(seed)
    final = os.path.abspath(out)
    with staged_dir(out, ".vlm-") as tmp:
        tok = build_vlm_tokenizer()
        Qwen2VLForConditionalGeneration(build_vlm_config(tok, hidden)).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                 size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64}).save_pretrained(tmp)
        data = os.path.join(tmp, "data")
        os.makedirs(os.path.join(data, "images"))
        for split, n, s in (("train", n_train, seed + 10), ("eval", n_eval, seed + 99)):
            rows = vlm_rows(n, s, os.path.join(data, "images"), split)
            for kind, rs in zip(("prompts", "sft", "pref"), rows):
                for r in rs:
                    r["images"] = [p.replace(tmp, final) for p in r["images"]]
                write_jsonl(os.path.join(data, f"vlm_{kind}_{split}.jsonl"), rs)
        with open(os.path.join(data, "reward_colour.py"), "w") as fh:
            fh.write(REWARD_FILE)
        with open(os.path.join(tmp, "kit.json"), "w") as fh:
            json.dump({"kind": "tiny-vlm", "hidden": hidden, "seed": seed}, fh)
    return out


@click.command()
@click.option("--out", required=True, help="output directory")
@click.option("--hidden", default=64, show_default=True, help="language model width (128: head_dim 32, vLLM's CPU "
              "attention minimum)")
@click.option("--seed", default=0, show_default=True)
@click.option("--n_train", default=96, show_default=True, help="training rows (images) of each data file")
@click.option("--n_eval", default=24, show_default=True, help="eval rows of each data file")
def main(out, hidden, seed, n_train, n_eval):
    make_tiny_vlm(out, hidden, seed, n_train, n_eval)
    click.echo(f"wrote the tiny Qwen2-VL kit to {out}")


if __name__ == "__main__":
    main()
