"""Print the placement plan for a set of topology flags without starting anything.

    python -m rlhf.plan --actor_num_nodes 1 --actor_num_gpus_per_node 8 --colocate_all_models \
        --vllm_num_engines 4 --vllm_tensor_parallel_size 2

Without ``--world_size`` the world size is derived from the role flags (the job you would launch for them);
``--world_size N --nnodes K`` checks the flags against a given allocation instead.

``--memory`` adds the memory plan (rlhf/planning): per rank group and stage the peak device memory, read from the
models' config.json (no weights), against ``--gpu_memory_gb`` (default 80), the stage that overflows and by how
much, and flag sets checked to fit.  ``--kind sft|rm|dpo`` plans a supervised job over ``--world_size`` ranks
(default: ppo / grpo, the RL placement).

    python -m rlhf.plan --memory --config configs/grpo_qwen2.5_7b_math.yaml --generate_max_len 16384
"""
from __future__ import annotations

import sys
from typing import Optional

import click

from rlhf.config import make_command
from rlhf.distributed.placement import TopologyError, flag_groups, job_role_needs, make_placement, required_world_size


def plan_for(cfg, world_size: Optional[int], nnodes: Optional[int]):
    t = cfg.topology
    if world_size is None:
        world_size = required_world_size(t, **job_role_needs(cfg))
        if world_size is None:
            raise TopologyError("the role flags leave the world size open (the actor takes all remaining ranks): "
                                "give --actor_num_gpus_per_node, or --world_size N")
    if nnodes is None:
        nnodes = t.actor_num_nodes if t.colocate_all_models else max(1, t.nnodes_hint or 1)
        if world_size % nnodes:
            nnodes = 1
    return make_placement(t, world_size, nnodes, parallel=cfg.parallel, **job_role_needs(cfg))


KINDS = ("ppo", "grpo", "sft", "rm", "dpo")


def memory_report(job, model, gpu_memory_gb: Optional[float], placement, world: int, **groups) -> str:
    """The memory plan's table, its overflows and the flag sets that fit (rlhf.planning): ``job`` from
    ``job_from_flags``, the models' paths in ``model`` (the --model flag group; ``groups``: the flag groups a
    declared role reads, ``rlhf.distributed.placement.flag_groups``), against --gpu_memory_gb."""
    from rlhf.planning import device_budget, plan_with_fixes, report, role_dims

    try:
        plan, fits = plan_with_fixes(job, role_dims(model, **groups), placement, world, device_budget(gpu_memory_gb))
    except (OSError, ValueError) as e:
        raise click.UsageError(f"--memory reads each model's config.json: {e}; give --pretrain a local model "
                               f"directory (config.json is enough)")
    return report(plan, fits)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = {"world_size": None, "nnodes": None}
    for key in list(extra):
        flag = f"--{key}"
        if flag in argv:
            i = argv.index(flag)
            extra[key] = int(argv[i + 1])
            del argv[i:i + 2]
    memory = "--memory" in argv
    if memory:
        argv.remove("--memory")
    kind = "ppo"
    if "--kind" in argv:
        i = argv.index("--kind")
        kind = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i:i + 2]
        if kind not in KINDS:
            raise SystemExit(f"rlhf.plan: --kind must be one of {', '.join(KINDS)}, got {kind!r}")

    def run(cfg):
        from rlhf.planning import job_from_flags

        job = job_from_flags(kind, cfg.model, cfg.data, cfg.topology, cfg.rollout, cfg.optim, cfg.parallel)
        gb = cfg.topology.gpu_memory_gb
        if kind not in ("ppo", "grpo"):
            click.echo(memory_report(job, cfg.model, gb, None, extra["world_size"] or 1))
            return
        try:
            placement = plan_for(cfg, extra["world_size"], extra["nnodes"])
        except TopologyError as e:
            raise click.UsageError(f"bad topology: {e}")
        click.echo(placement.table())
        if memory:
            click.echo(memory_report(job, cfg.model, gb, placement, placement.world_size, **flag_groups(cfg)))

    make_command("plan", run, help="Print the placement plan (add --world_size N --nnodes K; --memory: the memory "
                                   "plan; --kind sft|rm|dpo: a supervised job).").main(
        argv, prog_name="rlhf.plan")


if __name__ == "__main__":
    main()
