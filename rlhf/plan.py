"""Print the placement plan for a set of topology flags without starting anything.

    python -m rlhf.plan --world_size 8 --nnodes 1 --colocate_all_models --vllm_num_engines 4 --vllm_tensor_parallel_size 2
"""
from __future__ import annotations

import sys

import click

from rlhf.algorithms import ADVANTAGE_ESTIMATORS
from rlhf.config import make_command
from rlhf.distributed.plan import TopologyError, make_plan


def plan_for(cfg, world_size: int, nnodes: int):
    spec = ADVANTAGE_ESTIMATORS[cfg.algorithm.advantage_estimator]
    need_ref = cfg.algorithm.init_kl_coef > 0 or cfg.algorithm.use_kl_loss
    return make_plan(cfg.topology, world_size, nnodes, need_ref=need_ref, need_critic=spec.needs_critic,
                     need_reward_model=cfg.model.reward_pretrain is not None)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = {"world_size": 1, "nnodes": 1}
    for key in list(extra):
        flag = f"--{key}"
        if flag in argv:
            i = argv.index(flag)
            extra[key] = int(argv[i + 1])
            del argv[i:i + 2]

    def run(cfg):
        try:
            click.echo(plan_for(cfg, extra["world_size"], extra["nnodes"]).table())
        except TopologyError as e:
            raise click.UsageError(f"bad topology: {e}")

    make_command("plan", run, help="Print the placement plan (add --world_size N --nnodes K).").main(
        argv, prog_name="rlhf.plan")


if __name__ == "__main__":
    main()
