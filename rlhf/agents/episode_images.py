"""Images in an agent's episode (OpenRLHF's VLM multi-turn agents: examples/python/vlm_multiturn_agent.py).

OpenRLHF's contract: ``execute(..., images=None)`` gets the prompt's images (PIL); a ``step`` may return
``environment_images`` (PIL) with one ``<|vision_start|><|image_pad|><|vision_end|>`` per image in its
``environment_feedback``; the episode's images so far go to the engine with every turn
(``llm_engine.generate(tokens, sampling_params, multi_modal_data={"image": images})``).  Here the token ids an
episode builds carry each ``<|image_pad|>`` already expanded to its image's token count (``ImageInputs.expand``,
as Qwen2VLProcessor does), so what the engine generated from and what the trainer scores are the same ids, and the
placeholder tokens lie outside every action range (action mask 0).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def expand_images(image_inputs, ids: Sequence[int], images: list) -> List[int]:
    """``ids`` (one ``<|image_pad|>`` per image of ``images``, in order) with each placeholder expanded; ids
    unchanged without images.  A text-only model given images is refused (naming --pretrain)."""
    if not images:
        return list(ids)
    if image_inputs is None:
        raise ValueError(f"--agent_func_path: the agent gave {len(images)} image(s) but --pretrain is a text-only "
                         f"model (no vision_config): use a vision-language model, e.g. a Qwen2-VL checkpoint")
    return image_inputs.expand(list(ids), image_inputs.encode(list(images))[1])


def request_images(image_inputs, ids: Sequence[int], images) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(pixel_values, image_grid_thw) of a generate call's ``multi_modal_data["image"]`` (a PIL image or a list),
    checked against ``ids``' expanded placeholders as vLLM checks its prompt's (vllm/multimodal/processing/
    processor.py ``_validate_mm_placeholders``); None for no images."""
    images = [images] if images is not None and not isinstance(images, (list, tuple)) else list(images or [])
    if not images:
        return None
    if image_inputs is None:
        expand_images(None, ids, images)  # raises with the fix
    px, grid = image_inputs.encode(images)
    want = int((grid.prod(-1) // image_inputs.merge ** 2).sum())
    have = sum(1 for t in ids if t == image_inputs.image_token_id)
    if want != have:
        raise ValueError(f"llm_engine.generate: the prompt has {have} image tokens for {len(images)} image(s) of "
                         f"{want} tokens: give one <|vision_start|><|image_pad|><|vision_end|> per image in the "
                         f"text (expanded by the executor)")
    return px, grid


def row_tensors(image_inputs, images: list) -> Tuple[torch.Tensor, torch.Tensor]:
    """A trained row's (pixel_values, image_grid_thw): the episode's images in order (empty tensors for none)."""
    return image_inputs.encode(list(images or []))
