"""Weight-sync throughput on this machine: actor ranks (FSDP2) -> one rollout rank whose engine loads in-process,
by the gather route (actor rank 0 gathers every parameter and broadcasts it) and by the shard route (every actor
rank sends its own blocks, ``rlhf.distributed.shard_sync``).  gloo over loopback, fp32.

    python bench/weight_sync.py                       # 2 actor ranks + 1 rollout rank, 64 MiB of weights
    python bench/weight_sync.py --actors 4 --mib 128 --repeat 3

Prints per route: the bytes each rank sent (sync_bytes), the slowest rank's seconds, and GB/s = one copy of the
model / the slowest rank's seconds.  Report the load (uptime) and the CPU with any figure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _model(mib: float):
    torch.manual_seed(0)
    width = 1001  # not divisible by the actor count: uneven shards
    rows = max(1, int(mib * 2**20 / 4 / width / 4))
    return torch.nn.Sequential(*[torch.nn.Linear(width, rows) if i % 2 == 0 else torch.nn.Linear(rows, width)
                                 for i in range(4)])


def _worker(rank, world, mib, repeat, bucket_mb, out):
    import torch.distributed as dist
    from helpers.engine_standin import StandInEngine
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from rlhf.config import TopologyConfig
    from rlhf.distributed import WeightSync, build_groups, make_placement

    class Loading(StandInEngine):
        def __init__(self, model):
            self.params = dict(model.named_parameters())

        def load_weights(self, named):
            for n, t in named:
                self.params[n].data.copy_(t)

        def reset_prefix_cache(self):
            pass

    t = TopologyConfig()
    t.actor_num_gpus_per_node, t.vllm_num_engines = world - 1, 1
    g = build_groups(make_placement(t, world), rank)
    model = engine = None
    if rank < world - 1:
        model = _model(mib)
        fully_shard(model, mesh=DeviceMesh.from_group(g.group("actor"), "cpu"))
    else:
        engine = Loading(_model(mib))
    whole = sum(p.numel() * 4 for p in _model(mib).parameters())
    rows = {}
    for route in ("gather", "shards"):
        ws = WeightSync(g, engine, bucket_mb=bucket_mb, from_shards=route == "shards")
        secs = []
        for _ in range(repeat + 1):  # the first sync also exchanges metadata: not timed
            dist.barrier()
            t0 = time.perf_counter()
            ws.sync(model)
            secs.append(time.perf_counter() - t0)
        box = [None] * world
        dist.all_gather_object(box, (ws.last["sync_bytes"], min(secs[1:])))
        slowest = max(s for _, s in box)
        rows[route] = {"sent_bytes_per_rank": [b for b, _ in box], "slowest_s": slowest,
                       "GBps": whole / slowest / 1e9, "model_bytes": whole}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--mib", type=float, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--bucket_mb", type=float, default=256)
    a = ap.parse_args()
    from helpers.mp import spawn

    out = f"/tmp/weight_sync_bench_{os.getpid()}.json"
    spawn(_worker, a.actors + 1, a.mib, a.repeat, a.bucket_mb, out)
    rows = json.load(open(out))
    print(f"{a.actors} actor ranks -> 1 rollout rank, {rows['gather']['model_bytes'] / 2**20:.1f} MiB fp32, gloo, "
          f"load {os.getloadavg()[0]:.1f}")
    for route, r in rows.items():
        print(f"  {route:7s} sent per rank {[int(b) for b in r['sent_bytes_per_rank']]}  "
              f"{r['slowest_s']:.3f} s  {r['GBps']:.2f} GB/s")


if __name__ == "__main__":
    main()
