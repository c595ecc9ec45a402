"""Images in the data (--image_key) for a vision-language model: read from local paths (or file:// URLs), turned
into pixel patches by the model's image processor, and placed in the prompt as the model's placeholder tokens.

A row's ``--image_key`` column (OpenRLHF's ``--image_key``, default ``images``) holds one path or a list of paths.
The prompt gets one ``<|vision_start|><|image_pad|><|vision_end|>`` per image: a chat-message prompt whose content
already has ``{"type": "image"}`` parts keeps them (the chat template renders them, as OpenRLHF's VLM data and
Qwen2-VL's processor do); otherwise the images go first in the (first) user turn, or, without a chat template,
before the text.  Then each ``<|image_pad|>`` is expanded to the image's token count ``t * h * w / merge^2``, as
transformers' Qwen2VLProcessor does (transformers/models/qwen2_vl/processing_qwen2_vl.py ``replace_image_token``).
The processor class itself is not used: in transformers 5.19 constructing it needs torchvision (its video
processor), which is not installed here; the image processor (``Qwen2VLImageProcessorPil``) needs only PIL.

Prompts with images are never truncated (a cut image breaks the model's feature scatter): longer than
--prompt_max_len is a DataError naming the flag.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

IMAGE_PART = {"type": "image"}


class ImageDataError(ValueError):
    """A row's images cannot be used (missing file, a remote URL, too many images)."""

# A prompt's images travel as the tuple (pixel_values (patches, C*t*p*p), image_grid_thw (images, 3), files): the
# first two are what the trainer's forwards and the HF engine take, the local files what vLLM takes (its own
# processor makes the pixels: vllm/model_executor/models/qwen2_vl.py ``Qwen2VLMultiModalDataParser``).


def image_refs(value) -> List[str]:
    """The image references of a row's --image_key value: none, one string, or a list of strings."""
    if value is None:
        return []
    refs = [value] if isinstance(value, str) else list(value)
    for r in refs:
        if not isinstance(r, str):
            raise ImageDataError(f"--image_key: an image must be a path or file:// URL string, got {type(r).__name__}")
    return refs


def local_path(ref: str) -> str:
    """A local file for an image reference: a path, or a file:// URL.  http(s) is refused (no downloads here)."""
    if ref.startswith("file://"):
        ref = ref[len("file://"):]
    elif "://" in ref:
        raise ImageDataError(f"--image_key: {ref[:80]!r} is a remote URL; only local files are read (download the "
                             f"images and give their paths, or file:// URLs)")
    path = os.path.expanduser(ref)
    if not os.path.isfile(path):
        raise ImageDataError(f"--image_key: image file {path!r} does not exist")
    return path


def open_images(value, max_images: int = 0) -> list:
    """PIL images (RGB) of a row's --image_key value; more than ``max_images`` (> 0) is refused."""
    from PIL import Image

    refs = image_refs(value)
    if max_images > 0 and len(refs) > max_images:
        raise ImageDataError(f"a row has {len(refs)} images, more than --max_images_per_prompt {max_images}; raise "
                             f"it to {len(refs)} (0: no limit)")
    out = []
    for r in refs:
        with Image.open(local_path(r)) as im:
            out.append(im.convert("RGB"))
    return out


def with_image_parts(raw, n_images: int) -> list:
    """A chat-message prompt with ``n_images`` image parts: kept as is when it already has image parts, else the
    parts put first in the first user turn (a plain-text prompt becomes one user turn)."""
    msgs = raw if isinstance(raw, list) else [{"role": "user", "content": str(raw)}]
    if any(isinstance(m.get("content"), list) and any(isinstance(c, dict) and c.get("type") == "image"
                                                      for c in m["content"]) for m in msgs):
        return msgs
    out, done = [], False
    for m in msgs:
        if not done and m.get("role") == "user":
            c = m["content"]
            text = [{"type": "text", "text": c}] if isinstance(c, str) else list(c)
            m, done = {**m, "content": [dict(IMAGE_PART) for _ in range(n_images)] + text}, True
        out.append(m)
    if not done:
        raise ImageDataError("--image_key: the prompt has no user turn to put its images in")
    return out


@dataclass
class ImageInputs:
    """A vision-language model's image side: its image processor and placeholder tokens (from config.json)."""
    processor: object
    image_token_id: int
    merge: int
    image_key: str = "images"
    max_images: int = 0

    @classmethod
    def from_model_dir(cls, path: str, image_key: str = "images", max_images: int = 0) -> Optional[ImageInputs]:
        """None for a text-only model (no ``vision_config`` in config.json)."""
        f = os.path.join(path, "config.json")
        if not os.path.isfile(f):
            return None
        with open(f) as fh:
            cfg = json.load(fh)
        if "vision_config" not in cfg:
            return None
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(path), int(cfg["image_token_id"]),
                   int(cfg["vision_config"].get("spatial_merge_size", 2)), image_key, max_images)

    def encode(self, images: list) -> Tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values (patches, C*t*p*p), image_grid_thw (images, 3)) of PIL images; empty tensors for none."""
        if not images:
            return torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def expand(self, ids: Sequence[int], grid: torch.Tensor) -> List[int]:
        """Each ``<|image_pad|>`` of ``ids`` repeated to its image's token count; the counts must match."""
        sizes = (grid.prod(-1) // self.merge ** 2).tolist() if grid.numel() else []
        n = sum(1 for t in ids if t == self.image_token_id)
        if n != len(sizes):
            raise ImageDataError(f"the prompt has {n} image placeholders for {len(sizes)} images (--image_key): the "
                                 f"chat template must render each {{'type': 'image'}} part once")
        out, k = [], 0
        for t in ids:
            if t == self.image_token_id:
                out.extend([t] * int(sizes[k]))
                k += 1
            else:
                out.append(t)
        return out

    def prompt_text(self, raw, n_images: int, tokenizer, apply_chat_template: bool, input_template=None) -> str:
        """The prompt as text with one placeholder per image (module docstring)."""
        from rlhf.data.formatting import format_prompt

        if not n_images:
            return format_prompt(raw, tokenizer, apply_chat_template, input_template)
        if apply_chat_template:
            return tokenizer.apply_chat_template(with_image_parts(raw, n_images), tokenize=False,
                                                 add_generation_prompt=True)
        pad = tokenizer.convert_ids_to_tokens(self.image_token_id)
        marks = "".join(f"<|vision_start|>{pad}<|vision_end|>" for _ in range(n_images))
        return marks + format_prompt(raw, tokenizer, False, input_template)

    def prompt(self, row: dict, input_key: str, tokenizer, apply_chat_template: bool, input_template=None):
        """(text, ids with expanded placeholders, pixel_values, image_grid_thw) of a row's prompt (the files the
        images came from: ``self.files(row)``)."""
        imgs = open_images(row.get(self.image_key), self.max_images)
        text = self.prompt_text(row[input_key], len(imgs), tokenizer, apply_chat_template, input_template)
        pixels, grid = self.encode(imgs)
        ids = self.expand(tokenizer(text, add_special_tokens=False)["input_ids"], grid)
        return text, ids, pixels, grid

    def build_prompts(self, rows: List[dict], tokenizer, cfg_data) -> list:
        """``rlhf.data.formatting.build_prompts`` for rows with images: PromptItems carrying ``images`` =
        (pixel_values, image_grid_thw); a prompt over --prompt_max_len is refused (never cut into its image)."""
        from rlhf.data.formatting import PromptItem

        out = []
        for r in rows:
            text, ids, px, grid = self.prompt(r, cfg_data.input_key, tokenizer, cfg_data.apply_chat_template,
                                              cfg_data.input_template)
            if len(ids) > cfg_data.prompt_max_len:
                raise ImageDataError(f"a prompt with images is {len(ids)} tokens, over --prompt_max_len "
                                     f"{cfg_data.prompt_max_len} (image prompts are never truncated); raise it to "
                                     f"{len(ids)}")
            label = r.get(cfg_data.label_key) if cfg_data.label_key else None
            files = tuple(local_path(f) for f in image_refs(r.get(self.image_key)))
            out.append(PromptItem(text, None if label is None else str(label), ids,
                                  images=(px, grid, files) if grid.numel() else None))
        return out


def row_images(prompts: list, n_samples: int):
    """The ``Batch`` image fields (``pixel_values``, ``image_grid_thw``) of a step's rows from its prompts (rows are
    prompt-major: n_samples rows per prompt); (None, None) when no prompt has images."""
    if not any(getattr(p, "images", None) is not None for p in prompts):
        return None, None
    empty = (torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long))
    per = [p.images if p.images is not None else empty for p in prompts]
    return [per[i // n_samples][0] for i in range(len(per) * n_samples)], \
        [per[i // n_samples][1] for i in range(len(per) * n_samples)]


def image_pair(images: ImageInputs, row: dict, response: str, tokenizer, d):
    """(input_ids, loss_mask, (pixel_values, image_grid_thw)) of a supervised row with images: prompt (its image
    placeholders included) -> response + eos, loss on the response and eos only (the image tokens, like the rest
    of the prompt, get no loss: label -100 in HF terms).  The prompt is never cut (``fit_pair`` would cut into an
    image): a sample over --max_len is a DataError naming the flag."""
    _, p, px, grid = images.prompt(row, d.input_key, tokenizer, d.apply_chat_template, d.input_template)
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    if len(p) + len(r) > d.max_len:
        raise ImageDataError(f"a sample with images is {len(p) + len(r)} tokens, over --max_len {d.max_len} (image "
                             f"prompts are never truncated); raise it to {len(p) + len(r)}")
    return p + r, [0] * len(p) + [1] * len(r), (px, grid)


def collate_images(samples) -> dict:
    """The images of collated samples ((ids, mask[, (pixel_values, image_grid_thw)]) each), in sample order: {}
    when none has any."""
    imgs = [s[2] for s in samples if len(s) > 2 and s[2] is not None and s[2][1].numel()]
    if not imgs:
        return {}
    return {"pixel_values": torch.cat([i[0] for i in imgs]), "image_grid_thw": torch.cat([i[1] for i in imgs])}


def multi_modal_data(images: Optional[tuple]) -> dict:
    """vLLM's input for a prompt's images: ``{"multi_modal_data": {"image": PIL image or list}}`` beside the
    prompt_token_ids (whose placeholders are already expanded: vLLM finds them and does not insert them again);
    {} for a prompt without images."""
    if images is None or not images[2]:
        return {}
    pil = open_images(list(images[2]))
    return {"multi_modal_data": {"image": pil[0] if len(pil) == 1 else pil}}
