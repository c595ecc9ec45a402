"""One RL step's record: ``Batch``, whose fields declare what they are, and the ops that read those declarations.

Every field says (``dataclasses.field(metadata=...)``, read by ``spec``):

- ``kind``: ``ROW`` (B,), ``TOKEN`` (B, R) response tokens, ``SEQ`` (B, P + R) prompt | response, ``NAMED`` a dict
  of (B,) float tensors by name, ``IMAGES`` a list of B tensors (row i's images' rows: a prompt's image patches,
  any count; block ``"object"``: gathered as objects, never padded), or ``META`` (the step's: not per row);
- ``block``: ``"int"`` or ``"float"``, the gather block its columns travel in (``dtype``: what it is stored as);
- ``pad``: the value a wider batch pads it with (prompts on the left, responses on the right; ``PAD_ID`` is the
  tokenizer's pad id, given to the op);
- ``writer``: the stage that writes it; ``doc``: what it holds.

Rows are prompt-major: the n samples of prompt i are rows [i*n, (i+1)*n).  ``select`` / ``cat`` / ``padded`` /
``gather_batch`` loop over the declared fields, so a new field is one declaration here and no code in the ops.
Field metadata drives the helpers as in OpenRLHF openrlhf/trainer/ppo_utils/experience_maker.py (``Experience``,
whose ``select`` / ``concat`` iterate ``dataclasses.fields``); shapes and meanings on every field as torchtitan
torchtitan/experiments/rl/types.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Sequence

import torch

ROW, TOKEN, SEQ, NAMED, META = "row", "token", "seq", "named", "meta"
IMAGES = "images"  # a per-row list of tensors of any length (pixel rows are per image patch, not per token)
PAD_ID = "pad_id"  # pad value: the tokenizer's pad id, given to the op


def tensor_field(kind: str, block: str, dtype, pad, writer: str, doc: str, only: Optional[str] = None):
    """A per-row field (None until its stage writes it).  ``only``: written in that mode only (``"async"``)."""
    return field(default=None, metadata=dict(kind=kind, block=block, dtype=dtype, pad=pad, writer=writer, doc=doc,
                                             only=only))


def meta_field(default, writer: str, doc: str, per_view: bool = False):
    """The step's (not per row); ``per_view``: a ``select`` view starts it afresh (metrics)."""
    make = default if callable(default) else (lambda: default)
    return field(default_factory=make, metadata=dict(kind=META, writer=writer, doc=doc, per_view=per_view))


@dataclass
class Batch:
    """One RL step: the rollout's rows, what each stage adds to them, and the step's own values."""
    sequences: torch.Tensor = tensor_field(
        SEQ, "int", torch.long, PAD_ID, "rollout", "(B, P + R) left-padded prompt | right-padded response ids")
    attention_mask: torch.Tensor = tensor_field(
        SEQ, "int", torch.long, 0, "rollout", "(B, P + R) 1 on prompt and response tokens")
    action_mask: torch.Tensor = tensor_field(
        TOKEN, "int", torch.long, 0, "rollout", "(B, R) 1 on model tokens incl. the stop token; the advantages "
        "stage zeroes the rows that train nothing (invalid reward, filtered group)")
    rollout_logprobs: torch.Tensor = tensor_field(
        TOKEN, "float", torch.float32, 0.0, "rollout", "(B, R) log-probs under the engine's (temperature-scaled) "
        "sampling distribution")
    versions: torch.Tensor = tensor_field(
        TOKEN, "int", torch.long, -1, "rollout", "(B, R) the weight version (step) that generated each response "
        "token, -1 on padding", only="async")
    truncated: torch.Tensor = tensor_field(
        ROW, "int", torch.bool, False, "rollout", "(B,) hit the length limit without a stop token")
    group_index: torch.Tensor = tensor_field(
        ROW, "int", torch.long, 0, "rollout", "(B,) the row's prompt's place in the prompt stream", only="async")
    rewards: torch.Tensor = tensor_field(
        ROW, "float", torch.float32, 0.0, "reward", "(B,) reward-source rewards (invalid rows: any value, NaN too)")
    scores: torch.Tensor = tensor_field(
        ROW, "float", torch.float32, 0.0, "reward", "(B,) task scores (dynamic filtering, accuracy)")
    valid: torch.Tensor = tensor_field(
        ROW, "int", torch.bool, False, "reward", "(B,) the reward is finite and usable")
    extra_logs: Dict[str, torch.Tensor] = tensor_field(
        NAMED, "float", torch.float32, 0.0, "reward", "name -> (B,) per-row reward-function logs")
    ref_logprobs: torch.Tensor = tensor_field(
        TOKEN, "float", torch.float32, 0.0, "ref", "(B, R) reference log-probs, masked")
    teacher_logprobs: torch.Tensor = tensor_field(
        TOKEN, "float", torch.float32, 0.0, "teacher", "(B, R) the frozen teacher's log-probs of the sampled "
        "tokens, masked")
    teacher_topk_logprobs: torch.Tensor = tensor_field(
        TOKEN, "float", torch.float32, 0.0, "teacher", "(B, R, k) --opd_topk: the teacher's k largest log-probs at "
        "each response position (0 on padding)", only="topk")
    teacher_topk_ids: torch.Tensor = tensor_field(
        TOKEN, "int", torch.long, 0, "teacher", "(B, R, k) --opd_topk: their token ids", only="topk")
    old_logprobs: torch.Tensor = tensor_field(
        TOKEN, "float", torch.float32, 0.0, "old_logprobs", "(B, R) actor log-probs before the update (None: one "
        "on-policy update needs none)")
    values: torch.Tensor = tensor_field(
        TOKEN, "float", torch.float32, 0.0, "values", "(B, R) critic values, masked")
    advantages: torch.Tensor = tensor_field(
        TOKEN, "float", torch.float32, 0.0, "advantages", "(B, R) advantages, 0 where action_mask is")
    returns: torch.Tensor = tensor_field(
        TOKEN, "float", torch.float32, 0.0, "advantages", "(B, R) returns, 0 where action_mask is")
    routed_experts: torch.Tensor = tensor_field(
        SEQ, "int", torch.long, -1, "rollout", "(B, P + R, L * k) MoE routing: the experts each token went to, "
        "layer-major (column l * k + j: layer l's j-th choice), -1 where none (rlhf.models.moe); --router_replay R3: "
        "the rollout engine's, R2: the old-log-prob forward's", only="routing")
    prompt_len: Optional[int] = meta_field(None, "rollout", "P: the prompt columns of sequences (the layout)")
    step: int = meta_field(0, "loop", "0-based training step")
    prompts: list = meta_field(list, "loop", "the step's prompts, one per group of n_samples rows")
    n_samples: int = meta_field(1, "loop", "samples per prompt")
    kl_coef: float = meta_field(0.0, "loop", "the KL controller's coefficient this step")
    opd_topk_coef: float = meta_field(0.0, "teacher", "--opd_coef of the top-k term (the actor's loss)")
    metrics: Dict[str, float] = meta_field(dict, "every stage", "this step's metrics", per_view=True)
    pixel_values: List[torch.Tensor] = tensor_field(
        IMAGES, "object", torch.float32, None, "prompts", "B x (patches, C*t*p*p) the row's prompt's image patches "
        "(a vision-language model; None: text-only), in placeholder order (rlhf.models.vision)")
    image_grid_thw: List[torch.Tensor] = tensor_field(
        IMAGES, "object", torch.long, None, "prompts", "B x (images, 3) the (t, h, w) patch grid of each image")

    @property
    def num_actions(self) -> int:
        return self.action_mask.size(1)

    def size(self) -> int:
        """B: the rows (of the first per-row field that is set; 0 when none is)."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.metadata["kind"] in (ROW, TOKEN, SEQ) and v is not None:
                return v.size(0)
        return 0

    @property
    def labels(self) -> List:
        return [p.label for p in self.prompts for _ in range(self.n_samples)]

    def select(self, rows) -> Batch:
        """These rows (index, slice, bool mask or index tensor) at the same padded widths; meta carried."""
        return type(self)(**{f.name: _pick(f, getattr(self, f.name), rows) for f in fields(self)})

    def padded(self, P: int, R: int, pad_id: int) -> Batch:
        """The same rows re-padded to prompt width ``P`` (on the left) and response width ``R`` (on the right)."""
        lp, rp = P - self.prompt_len, R - self.num_actions
        out = {}
        for f in fields(self):
            v, m = getattr(self, f.name), f.metadata
            if v is not None and m["kind"] in (SEQ, TOKEN) and (lp or rp):
                pad = pad_id if m["pad"] == PAD_ID else m["pad"]
                v = torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (lp if m["kind"] == SEQ else 0, rp),
                                            value=pad)  # columns are dim 1 (routed_experts has one more)
            out[f.name] = v
        out["prompt_len"] = P
        return type(self)(**out)

    def fill(self, other: Batch, names: Optional[Sequence[str]] = None) -> Batch:
        """Take fields ``names`` of ``other`` (default every per-row field and the layout): the rollout stage puts
        the gathered rows into the step's record, whose meta (step, prompts, metrics, ...) stays.  Returns self."""
        for f in fields(self):
            if (f.name in names) if names is not None else (f.metadata["kind"] != META or f.name == "prompt_len"):
                setattr(self, f.name, getattr(other, f.name))
        return self


def spec(name: str, cls=None) -> dict:
    """The declared metadata of field ``name`` (of ``Batch``, or of the record class ``cls``)."""
    return next(f.metadata for f in fields(cls or Batch) if f.name == name)


def row_fields(writer: Optional[str] = None, mode: Optional[str] = None) -> List[str]:
    """The per-row fields (in declaration order) that ``writer`` writes (None: all), in ``mode`` (None: the ones
    every mode writes; "async": also those written only there)."""
    return [f.name for f in fields(Batch) if f.metadata["kind"] != META
            and (writer is None or f.metadata["writer"] == writer) and f.metadata["only"] in (None, mode)]


def _pick(f, v, rows):
    kind = f.metadata["kind"]
    if kind == META:
        return type(v)() if f.metadata["per_view"] else v
    if v is None:
        return None
    if kind == IMAGES:
        idx = torch.arange(len(v))[rows]
        return v[int(idx)] if idx.dim() == 0 else [v[int(i)] for i in idx]
    return {k: t[rows] for k, t in v.items()} if kind == NAMED else v[rows]


def cat(batches: Sequence[Batch], pad_id: int) -> Batch:
    """The rows of ``batches`` in order, re-padded to the widest prompt (left) and response (right).  A field
    must be set in every part or in none; named logs keep the names every part has.  Meta from the first part
    (the layout: the common widths)."""
    P = R = None
    parts = list(batches)
    if any(b.prompt_len is not None for b in batches):  # rows without a layout (reward fields only) need none
        P, R = max(b.prompt_len for b in batches), max(b.num_actions for b in batches)
        parts = [b.padded(P, R, pad_id) for b in batches]
    out, cls = {}, type(batches[0])
    for f in fields(cls):
        vals = [getattr(b, f.name) for b in parts]
        if f.metadata["kind"] == META:
            out[f.name] = vals[0]
        elif all(v is None for v in vals):
            out[f.name] = None
        elif any(v is None for v in vals):
            raise ValueError(f"cat: field {f.name!r} is set in {sum(v is not None for v in vals)} of {len(vals)} "
                             f"batches: set it in every part (or in none)")
        elif f.metadata["kind"] == NAMED:
            keys = sorted(set.intersection(*(set(v) for v in vals)))
            out[f.name] = {k: torch.cat([v[k] for v in vals]) for k in keys}
        elif f.metadata["kind"] == IMAGES:
            out[f.name] = [t for v in vals for t in v]
        else:
            out[f.name] = torch.cat(vals)
    out["prompt_len"] = P
    return cls(**out)
