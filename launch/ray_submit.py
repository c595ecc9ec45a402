"""Place the same torchrun program on an existing Ray cluster, one task per node (for teams that already run Ray).

    python -m launch.ray_submit --nodes 4 --gpus_per_node 8 -- rlhf.train_ppo --config configs/ppo_llama3_70b_hybrid.yaml

Ray only places processes: training itself is the same SPMD torchrun job (no
Ray actors inside), with the same env and resume behaviour.  Needs the [ray] extra.
"""
from __future__ import annotations

import os
import subprocess
import sys

import click

from .env import job_env, torchrun_cmd


def run_node(module, args, nnodes, gpus, node_rank, master, port, env):
    cmd = torchrun_cmd(module, args, nnodes, gpus, master, port, node_rank, python=sys.executable)
    return subprocess.run(cmd, env=job_env(overrides=env)).returncode


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--address", default="auto", show_default=True, help="Ray cluster address")
@click.option("--nodes", default=1, show_default=True)
@click.option("--gpus_per_node", default=8, show_default=True)
@click.option("--port", default=29511, show_default=True)
@click.argument("trainer", nargs=-1, type=click.UNPROCESSED, required=True)
def main(address, nodes, gpus_per_node, port, trainer):
    try:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError as e:
        raise click.UsageError("launch.ray_submit needs Ray: pip install 'rlhf[ray]'") from e
    module, *args = trainer
    ray.init(address=address)
    pg = placement_group([{"CPU": 1, "GPU": gpus_per_node}] * nodes, strategy="STRICT_SPREAD")
    ray.get(pg.ready())
    node_ip = ray.remote(num_cpus=0)(lambda: ray.util.get_node_ip_address())
    ips = ray.get([node_ip.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
                   for i in range(nodes)])
    task = ray.remote(num_cpus=1, num_gpus=gpus_per_node)(run_node)
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "WANDB_", "HF_", "RLHF_"))}
    codes = ray.get([task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote(
        module, args, nodes, gpus_per_node, i, ips[0], port, env) for i in range(nodes)])
    if any(codes):
        raise SystemExit(f"torchrun failed on nodes {[i for i, c in enumerate(codes) if c]}")


if __name__ == "__main__":
    main()
