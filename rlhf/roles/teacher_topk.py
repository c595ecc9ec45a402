"""The teacher's top-k at every response position (--opd_topk k): one no-grad forward of a frozen role over the
batch's rows, each member its micro-batches, the rows gathered to every rank in one float gather (sampled-token
log-probs | top-k log-probs | top-k ids, the ids exact in float32 below 2**24), as ``ModelRole.logprobs``
(rlhf.roles.base).  The forward itself: rlhf.models.topk_forward ``response_topk``."""
from __future__ import annotations

from typing import Tuple

import torch

from rlhf.batch import Batch
from rlhf.models.topk_forward import response_topk

EXACT_IDS = 1 << 24  # float32 holds every integer below this exactly


@torch.no_grad()
def role_topk(role, batch: Batch, forwards, k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sampled-token log-probs (B, R), top-k log-probs (B, R, k), top-k ids (B, R, k) long) of ``role``'s model
    at ``forwards``' temperature, chunking and packing (rlhf.rl.components.Forwards), masked by the action mask."""
    R = batch.num_actions

    def fn(p: slice):
        model, dev = role.engine.model, role.engine.compute_device
        lab, top, ids = response_topk(model, batch.sequences[p].to(dev), batch.attention_mask[p].to(dev),
                                      batch.action_mask[p].to(dev), k, forwards.temperature, forwards.chunk,
                                      forwards.packing)
        if int(ids.max()) >= EXACT_IDS:
            raise ValueError(f"--opd_topk: token id {int(ids.max())} does not travel exactly in the float gather")
        return torch.cat([lab, top.flatten(1), ids.flatten(1).float()], 1)

    def call(b: Batch, micro):
        return role.rows_forward(b.sequences.size(0), micro, fn, R * (1 + 2 * k))

    out = forwards.run(role, batch, call, forwards.packing)
    m = batch.action_mask
    B = out.size(0)
    lab, top, ids = out[:, :R], out[:, R:R + R * k].view(B, R, k), out[:, R + R * k:].view(B, R, k)
    return lab * m, top * m.unsqueeze(-1), ids.round().long() * m.unsqueeze(-1)
