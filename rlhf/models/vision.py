"""Vision-language models (Qwen2-VL / Qwen2.5-VL family): which auto class loads them, the multimodal RoPE (mrope)
position ids their forwards need, padded and packed, and the vision tower (freeze, count).

Qwen2-VL's text positions are 3-row (temporal, height, width) "mrope" ids: text tokens have three equal rows,
an image's placeholder tokens take their patch's (t, h, w) on the merged grid, and the text after an image
continues from ``start + max(h, w) / merge``.  transformers computes them inside ``forward`` only when no
``position_ids`` are given, from ``mm_token_type_ids`` (transformers/models/qwen2_vl/modeling_qwen2_vl.py
``Qwen2VLModel.get_rope_index`` / ``compute_3d_position_ids``).  Our forwards always pass position ids, so we call
``get_rope_index`` ourselves:

- padded rows: ``(3, B, T)`` from ``get_rope_index(ids, mm_token_type_ids, image_grid_thw, attention_mask)``;
- one packed row of several samples: ``(4, 1, N)``: row 0 the text positions restarting at 0 per sample (from
  which transformers builds the block-diagonal mask of a packed row, modeling_qwen2_vl.py ``Qwen2VLModel.forward``:
  "User specifically passed packed position_ids"), rows 1-3 each sample's mrope ids, concatenated.

The images of a batch travel as ``pixel_values`` (sum of patches, C * t * p * p) and ``image_grid_thw`` (images, 3),
in the order their placeholder tokens appear in the rows (row-major), as the model's ``masked_scatter`` of the
image features expects.  Imitates veRL verl/models/transformers/qwen2_vl.py (``get_rope_index`` per sample,
position ids carried with the batch) and OpenRLHF's VLM forwards (pixel_values / image_grid_thw passed through).
"""
from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence

import torch

VISION_TOWER = ("visual",)  # the vision encoder's module name in Qwen2-VL / Qwen2.5-VL (``model.visual``)


def is_vision_config(config) -> bool:
    """A config (object or config.json dict) of a vision-language model: it has a ``vision_config``."""
    if isinstance(config, dict):
        return "vision_config" in config
    return getattr(config, "vision_config", None) is not None


def is_vision_model_dir(path: str) -> bool:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        return False
    with open(f) as fh:
        return is_vision_config(json.load(fh))


def causal_auto_class(path: str):
    """The transformers auto class of the policy at ``path``: ``AutoModelForImageTextToText`` for a vision-language
    model (AutoModelForCausalLM does not map Qwen2VLConfig), else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if os.path.isdir(path) and is_vision_model_dir(path) else AutoModelForCausalLM


def _inner(model):
    """The module that has ``get_rope_index`` (Qwen2VLModel) under wrappers (peft, FSDP2 keeps the class)."""
    m = model
    for _ in range(4):
        if hasattr(type(m), "get_rope_index"):
            return m
        m = m.get_submodule("model") if "model" in dict(m.named_children()) else \
            m.get_submodule("base_model") if "base_model" in dict(m.named_children()) else None
        if m is None:
            break
    raise TypeError(f"{type(model).__name__} has no multimodal RoPE (get_rope_index): not a Qwen2-VL-family model")


def token_types(model, ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids``: 1 on image placeholder tokens, 0 on text (what the processor returns)."""
    return (ids == int(model.config.image_token_id)).int()


def mrope_positions(model, ids: torch.Tensor, attention_mask: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """(3, B, T) mrope position ids of padded rows (0 on padding)."""
    pos, _ = _inner(model).get_rope_index(ids, token_types(model, ids), image_grid_thw=grid,
                                          attention_mask=attention_mask)
    return pos


def images_per_row(model, ids: torch.Tensor, grid: torch.Tensor) -> List[int]:
    """How many images each row holds: its placeholder tokens counted against each image's token count
    (t * h * w / merge^2), images taken in order."""
    merge = int(model.config.vision_config.spatial_merge_size)
    sizes = (grid.prod(-1) // merge ** 2).tolist()
    counts, k = [], 0
    for n in (ids == int(model.config.image_token_id)).sum(1).tolist():
        c = 0
        while n > 0:
            n -= sizes[k]
            k, c = k + 1, c + 1
        if n != 0:
            raise ValueError("image placeholder tokens do not match image_grid_thw (a prompt truncated into its image?)")
        counts.append(c)
    return counts


def packed_mrope_positions(model, rows: Sequence[torch.Tensor], grid: torch.Tensor) -> torch.Tensor:
    """(4, 1, N) position ids of the samples ``rows`` (1-D id tensors, no padding) packed back to back: row 0 the
    text positions restarting per sample, rows 1-3 each sample's mrope ids."""
    dev = rows[0].device
    counts = images_per_row(model, torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=-1),
                            grid) if grid is not None and grid.numel() else [0] * len(rows)
    parts, k = [], 0
    for r, c in zip(rows, counts):
        ids = r.unsqueeze(0)
        g = grid[k:k + c] if c else None
        k += c
        if g is None:
            p = torch.arange(r.numel(), device=dev).view(1, 1, -1).expand(3, 1, -1)
        else:
            p = mrope_positions(model, ids, torch.ones_like(ids), g)
        text = torch.arange(r.numel(), device=dev).view(1, 1, -1)
        parts.append(torch.cat([text, p.to(dev)], 0))
    return torch.cat(parts, 2)


def check_images(model, ids: torch.Tensor, images: Optional[dict]) -> None:
    """Rows holding image placeholder tokens must come with their images: without them a vision-language model
    reads the placeholders as text and every log-prob is silently wrong (a path that dropped the Batch's image
    fields).  A model without a vision config is not checked."""
    cfg = getattr(model, "config", None)
    if images or cfg is None or not is_vision_config(cfg) or getattr(cfg, "image_token_id", None) is None:
        return
    if bool((ids == int(cfg.image_token_id)).any()):
        raise RuntimeError("rows with image placeholder tokens reached a vision-language model's forward without "
                           "their pixel_values / image_grid_thw (the Batch's image fields were not carried on this "
                           "path; rlhf.data.images.row_images)")


def vision_forward_kwargs(model, images: Optional[dict], ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    """The extra forward inputs of padded rows: {} without images, else pixel_values, image_grid_thw and the (3, B, T)
    mrope ``position_ids`` (replacing the 1-D ones)."""
    check_images(model, ids, images)
    if not images:
        return {}
    grid = images["image_grid_thw"]
    return {"pixel_values": images["pixel_values"], "image_grid_thw": grid,
            "position_ids": mrope_positions(model, ids, attention_mask, grid)}


def gather_images(pixel_rows: Optional[list], grid_rows: Optional[list], rows, device) -> Optional[dict]:
    """The images of rows ``rows`` (a slice or index list) of a batch whose per-row image lists are ``pixel_rows`` /
    ``grid_rows`` (rlhf.batch ``IMAGES`` fields), concatenated in row order on ``device``; None when there are none."""
    if pixel_rows is None:
        return None
    idx = range(len(pixel_rows))[rows] if isinstance(rows, slice) else rows
    px = [pixel_rows[i] for i in idx if pixel_rows[i] is not None and pixel_rows[i].numel()]
    if not px:
        return None
    gr = [grid_rows[i] for i in idx if grid_rows[i] is not None and grid_rows[i].numel()]
    return {"pixel_values": torch.cat(px).to(device), "image_grid_thw": torch.cat(gr).to(device)}


def batch_images(batch, rows, device) -> Optional[dict]:
    """``gather_images`` of a ``Batch``'s ``pixel_values`` / ``image_grid_thw`` fields."""
    return gather_images(batch.pixel_values, batch.image_grid_thw, rows, device)


def vision_parameters(model) -> List[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if any(f".{t}." in f".{n}" for t in VISION_TOWER)]


def freeze_vision_tower(model) -> int:
    """--freeze_visual_encoder: the vision encoder's parameters take no gradient (the merger projecting into the
    language model included, as OpenRLHF freezes ``visual``).  Returns how many parameters it froze."""
    ps = vision_parameters(model)
    if not ps:
        raise ValueError("--freeze_visual_encoder: the model has no vision tower ('visual' module); drop the flag "
                         "for a text-only model")
    for p in ps:
        p.requires_grad_(False)
    return sum(p.numel() for p in ps)


def vision_tower_params(config) -> int:
    """Parameters of a Qwen2-VL vision tower from its ``vision_config`` (dict or object), exactly (transformers
    modeling_qwen2_vl.py ``Qwen2VisionTransformerPretrainedModel``): patch embedding C * t * p^2 * D (no bias); per
    block two LayerNorms 4 D, qkv 3 D^2 + 3 D, proj D^2 + D, MLP 2 D I + I + D (I = D * mlp_ratio); the merger
    LayerNorm 2 D, M^2 + M, M H + H (M = D m^2, m: spatial merge, H: the language model's width).  0 without one.
    (Qwen2.5-VL's gated MLP and RMSNorm differ by a few percent: an estimate there.)"""
    vc = config.get("vision_config") if isinstance(config, dict) else getattr(config, "vision_config", None)
    if not vc:
        return 0
    g = (lambda k, d=None: vc.get(k, d)) if isinstance(vc, dict) else (lambda k, d=None: getattr(vc, k, d))
    D, p, t, m = int(g("embed_dim", 1280)), int(g("patch_size", 14)), int(g("temporal_patch_size", 2)), \
        int(g("spatial_merge_size", 2))
    H, depth, ratio = int(g("hidden_size", 3584)), int(g("depth", 32)), float(g("mlp_ratio", 4))
    inner, M = int(D * ratio), D * m * m
    blocks = depth * (4 * D + 3 * D * D + 3 * D + D * D + D + 2 * D * inner + inner + D)
    return int(g("in_channels", 3)) * t * p * p * D + blocks + 2 * D + M * M + M + M * H + H


def sample_has_images(task, row: dict, mode) -> bool:
    """A supervised row (SFT / DPO) that carries images for the task's vision-language model (``task.images``:
    rlhf.data.images.ImageInputs, None for a text-only model)."""
    from rlhf.data.images import image_refs

    if task.images is None or not image_refs(row.get(task.images.image_key)):
        return False
    if mode:
        raise ValueError(f"rows with images (--image_key {task.images.image_key}) train as prompt -> response; "
                         f"--{mode} is not supported with images: drop it")
    return True


def supervised_vision_kwargs(model, batch: dict) -> dict:
    """The extra forward inputs of a collated supervised batch with images (rlhf.data.images.collate_images): {}
    without; else pixel_values, image_grid_thw and mrope position ids, (3, B, T) padded or (4, 1, N) packed (the
    samples of the packed row told apart by ``segment_ids``)."""
    if "pixel_values" not in batch:
        return {}
    grid = batch["image_grid_thw"]
    out = {"pixel_values": batch["pixel_values"], "image_grid_thw": grid}
    if "segment_ids" in batch:
        ids, seg = batch["input_ids"][0], batch["segment_ids"][0]
        out["position_ids"] = packed_mrope_positions(model, [ids[seg == i] for i in range(int(seg.max()) + 1)], grid)
    else:
        out["position_ids"] = mrope_positions(model, batch["input_ids"], batch["attention_mask"], grid)
    return out


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def copy_processor_files(model, dst: str) -> None:
    """An export of a vision-language model keeps its image processor: the processor files of the folder the model
    was loaded from (``config._name_or_path``) copied into ``dst`` (the tokenizer alone cannot prepare images)."""
    import shutil

    cfg = getattr(model, "config", None)
    src = getattr(cfg, "_name_or_path", "") or ""
    if not (cfg is not None and is_vision_config(cfg) and os.path.isdir(src)):
        return
    for f in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(src, f)) and not os.path.exists(os.path.join(dst, f)):
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))


def vision_token_ids(config) -> tuple:
    """The placeholder and delimiter tokens of a vision-language model's config (image, video, vision start / end):
    a response must not hold them (``cut_at_tokens``); () for a text-only model."""
    if config is None or not is_vision_config(config):
        return ()
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    return tuple(sorted({int(get(k)) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                 "vision_end_token_id") if get(k) is not None}))


def cut_at_tokens(batch, token_ids: Sequence[int], pad_id: int):
    """A rollout batch with each response cut before its first token of ``token_ids`` (a vision placeholder the
    policy sampled: fed back, the model would take it for an image slot without an image, and its forward refuses
    placeholders that do not match the images).  The cut row ends there as a length-cut row does (the HF engine's
    ``max_model_len`` rule): pad from there, action / attention mask 0, truncated; the kept tokens' log-probs are
    untouched.  Returns ``batch`` (changed in place)."""
    if not token_ids or batch is None:
        return batch
    P = batch.prompt_len
    resp = batch.sequences[:, P:]
    hit = torch.isin(resp, torch.tensor(list(token_ids), device=resp.device))
    if not bool(hit.any()):
        return batch
    keep = hit.long().cumsum(1) == 0
    batch.sequences = torch.cat([batch.sequences[:, :P], resp.masked_fill(~keep, pad_id)], 1)
    batch.attention_mask = torch.cat([batch.attention_mask[:, :P], batch.attention_mask[:, P:] * keep], 1)
    batch.action_mask = batch.action_mask * keep
    batch.rollout_logprobs = batch.rollout_logprobs * keep
    batch.truncated = batch.truncated | hit.any(1)
    return batch


def vision_tokens_of(path: str) -> tuple:
    """``vision_token_ids`` of the model folder ``path`` (its config.json; () without one)."""
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        return ()
    with open(f) as fh:
        return vision_token_ids(json.load(fh))


def refuse_vision_roles(needs: dict) -> None:
    """A vision-language policy trains with the actor, the reference and reward functions; a critic or a reward
    model would need a value / score head on a Qwen2-VL backbone fed the images, which transformers 5.19 does not
    have (no ``Qwen2VLForSequenceClassification``) and this library does not build: refused before any process
    group.  ``needs``: rlhf.distributed.placement.role_needs."""
    from rlhf.errors import InputError

    if needs.get("need_critic"):
        raise InputError("--advantage_estimator gae needs a critic, and a critic of a vision-language model is not "
                         "supported; use a critic-free estimator, e.g. --advantage_estimator group_norm (GRPO)")
    if needs.get("need_reward_model"):
        raise InputError("--reward_pretrain: a reward model for a vision-language policy is not supported; score "
                         "with a reward function instead, e.g. --remote_rm_url reward_func.py")
