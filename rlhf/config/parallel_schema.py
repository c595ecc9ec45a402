"""Parallelism inside a role's mesh: tensor, expert and hybrid sharding, MoE kernels, routing replay (issue 45).

Its flags are command-line flags of the same name and YAML keys (flat, or under ``parallel:``), as in schema.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.fields import opt


@dataclass
class ParallelConfig:
    """The ``parallel`` flag group (fields are added by the feature that reads them; see docs/FLAGS.md)."""
    # --- tensor parallelism and hybrid sharding (issue 45 items 1-2; rlhf.distributed.tensor_parallel) ---
    tp_size: int = opt(1, "tensor parallelism of the trained and frozen models (actor, ref, critic, reward; FSDP2 "
                          "backend): ranks that split each layer's projections, embedding and LM head "
                          "(rlhf.distributed.tensor_parallel; OpenRLHF's --ds.tensor_parallel_size); FSDP2 shards "
                          "over the remaining ranks.  Must divide each role's ranks / --ring_attn_size, the ranks "
                          "per node, and the attention and key/value heads")
    fsdp_shard_size: int = opt(0, "hybrid sharding (HSDP, veRL's fsdp_size): FSDP2 shards each model over groups "
                                  "of this many data-parallel ranks (a node) and replicates across the groups "
                                  "(gradients all-reduced between them); 0: shard over every data-parallel rank")
    ep_size: int = opt(1, "expert parallelism of the actor and reference MoE models (FSDP2): each expert "
                          "layer's experts are split over this many consecutive data-parallel ranks, tokens reach "
                          "their experts by all-to-all (rlhf.distributed.expert_parallel; torchtitan's ep); must "
                          "divide the experts and the actor's ranks; not with --tp_size > 1 or --fsdp_shard_size")
    # --- MoE (issue 45 items 3-4; rlhf.models.moe) ---
    experts_implementation: str = opt(
        "auto", "MoE expert kernels (OpenRLHF --ds.experts_implementation; transformers' experts_implementation): "
        "eager (a loop over experts), batched_mm, grouped_mm (torch grouped GEMM); auto = transformers' default "
        "(grouped_mm where it can dispatch)", choices=("auto", "eager", "batched_mm", "grouped_mm"))
    router_replay: str = opt(
        "off", "MoE rollout routing replay (veRL actor.router_replay.mode): R3 replays the rollout engine's expert "
        "choices in the reference, old-log-prob and update forwards; R2 records the old-log-prob forward's and "
        "replays them in the update; off: the trainer routes by itself (with R2/R3 router/mismatch metrics are "
        "logged)", choices=("off", "R2", "R3"))
