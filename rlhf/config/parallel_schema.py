"""Parallelism inside a role's mesh: tensor, expert and hybrid sharding, MoE kernels, routing replay (issue 45).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``parallel:``), as in schema.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def opt(default, help: str, choices=None):
    """schema.opt's field (copied: schema imports this file)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    return field(default=default, metadata=meta)


@dataclass
class ParallelConfig:
    """The ``parallel`` flag group (fields are added by the feature that reads them; see docs/FLAGS.md)."""
    tp_size: int = opt(1, "tensor parallelism of the trained and frozen models (actor, ref, critic, reward; FSDP2 "
                          "backend): ranks that split each layer's projections, embedding and LM head "
                          "(rlhf.distributed.tensor_parallel; OpenRLHF's --ds.tensor_parallel_size); FSDP2 shards "
                          "over the remaining ranks.  Must divide each role's ranks / --ring_attn_size, the ranks "
                          "per node, and the attention and key/value heads")
    fsdp_shard_size: int = opt(0, "hybrid sharding (HSDP, veRL's fsdp_size): FSDP2 shards each model over groups "
                                  "of this many data-parallel ranks (a node) and replicates across the groups "
                                  "(gradients all-reduced between them); 0: shard over every data-parallel rank")
