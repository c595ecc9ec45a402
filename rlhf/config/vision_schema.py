"""Vision-language inputs: images in the data, the processor, the vision tower (issue 46).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``vision:``), as in schema.py.
They apply when --pretrain is a vision-language model (config.json has a ``vision_config``: Qwen2-VL / Qwen2.5-VL);
a text-only model reads no images (rlhf.data.images, rlhf.models.vision).
"""
from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.fields import opt


@dataclass
class VisionConfig:
    """The ``vision`` flag group (see docs/FLAGS.md)."""
    image_key: str = opt("images", "OpenRLHF's --image_key / data.image_key: the column of a row's image(s) (one path "
                         "or a list; local paths or file:// URLs), for a vision-language --pretrain; the prompt gets "
                         "one image placeholder per image (chat-message prompts may place {'type': 'image'} parts)")
    max_images_per_prompt: int = opt(0, "OpenRLHF's --max_images_per_prompt: a row with more images is refused "
                                     "(0: no limit)")
    freeze_visual_encoder: bool = opt(False, "OpenRLHF's --freeze_visual_encoder (actor.freeze_visual_encoder): the "
                                      "vision tower ('visual', its merger included) takes no gradient; only the "
                                      "language model trains")
