"""MoE expert weights under the checkpoint's per-expert names: the names vLLM's loaders read (issue 45).

transformers 5 holds a Qwen3-MoE / Mixtral / Qwen2-MoE layer's experts stacked, ``...mlp.experts.gate_up_proj``
(E, 2I, H) and ``...mlp.experts.down_proj`` (E, H, I); its checkpoints keep one tensor per expert and projection
(``save_pretrained`` reverses the merge, transformers/conversion_mapping.py), and so do vLLM's MoE loaders
(vllm/model_executor/models/qwen3_moe.py ``Qwen3MoeModel.load_weights``: ``FusedMoE.make_expert_params_mapping``
over ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``).  Every path that hands weights to vLLM maps its
names here: the in-process one (``VLLMEngine.load_weights``, via ``rlhf.models.moe.checkpoint_layout``) and the
direct one (``WeightSync`` to vLLM's own processes: the metadata and tensors on the wire).

    experts.gate_up_proj[e] = [gate (I, H); up (I, H)]  ->  experts.{e}.gate_proj.weight, experts.{e}.up_proj.weight
    experts.down_proj[e]    = down (H, I)                ->  experts.{e}.down_proj.weight

Pure functions of names, shapes and tensors (no collective); every other row passes as it is.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence, Tuple

GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"


def expert_rows(name: str, n_experts: int) -> list:
    """[(per-expert name, expert index, half)]: half 0/1 is the gate/up half of ``gate_up_proj``'s rows, None the
    whole expert (``down_proj``); [] for a name that is not a stacked expert weight."""
    if name.endswith(GATE_UP):
        base = name[:-len("gate_up_proj")]
        return [row for e in range(n_experts)
                for row in ((f"{base}{e}.gate_proj.weight", e, 0), (f"{base}{e}.up_proj.weight", e, 1))]
    if name.endswith(DOWN):
        base = name[:-len("down_proj")]
        return [(f"{base}{e}.down_proj.weight", e, None) for e in range(n_experts)]
    return []


def per_expert_meta(meta: Iterable[Tuple[str, Sequence[int], object]]) -> list:
    """(name, full shape, dtype) rows with each stacked expert weight replaced by its per-expert rows: gate/up
    (I, H) from (E, 2I, H), down (H, I) from (E, H, I)."""
    out = []
    for name, shape, dt in meta:
        rows = expert_rows(name, shape[0]) if len(shape) == 3 else []
        if not rows:
            out.append((name, shape, dt))
            continue
        sub = (shape[1] // 2, shape[2]) if name.endswith(GATE_UP) else (shape[1], shape[2])
        out.extend((n, tuple(sub), dt) for n, _, _ in rows)
    return out


def per_expert(named) -> Iterator[tuple]:
    """(name, tensor) rows, each stacked expert weight split into its per-expert views (no copy), in the order of
    ``per_expert_meta``."""
    for name, t in named:
        rows = expert_rows(name, t.size(0)) if t is not None and t.dim() == 3 else []
        if not rows:
            yield name, t
            continue
        halves = t.chunk(2, dim=1) if name.endswith(GATE_UP) else None
        for n, e, half in rows:
            yield n, (t[e] if half is None else halves[half][e])
