"""Render sbatch scripts (the ones shipped in slurm/ are rendered from here; a test keeps them in sync).

    python -m launch.sbatch --name my-ppo --nodes 2 --gpus_per_node 8 --time 24:00:00 -- \
        rlhf.train_ppo --config configs/ppo_llama3_8b.yaml > my_job.sh
    python -m launch.sbatch --write_shipped        # regenerate slurm/*.sh
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

import click

from .env import shell_join

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Job:
    name: str
    module: str
    args: List[str]
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int = 64
    time: str = "24:00:00"
    partition: Optional[str] = None
    mem: Optional[str] = None
    cpu_only: bool = False
    extra: List[str] = field(default_factory=list)


def render(job: Job) -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job.name}", f"#SBATCH --nodes={job.nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --cpus-per-task={job.cpus_per_task}"]
    if not job.cpu_only:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.mem:
        lines.append(f"#SBATCH --mem={job.mem}")
    if job.partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    lines += [f"#SBATCH --time={job.time}", "#SBATCH --output=%x-%j.out", "#SBATCH --open-mode=append",
              "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", *[f"#SBATCH {e}" for e in job.extra], "",
              f"# {job.name}: {job.nodes} node(s) x {job.gpus_per_node} ranks. Extra flags after the script name",
              "# override the config, e.g.  sbatch slurm/<this>.sh --actor_learning_rate 1e-6",
              ]
    if job.cpu_only:
        lines.append(f"export GPUS_PER_NODE=${{GPUS_PER_NODE:-{job.gpus_per_node}}}")
    lines.append('source "${RLHF_HOME:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"')
    args = list(job.args)
    cfg = ""
    if args[:1] == ["--config"]:  # recipes are found in the checkout, wherever the job runs
        cfg = f'--config "$RLHF_HOME/{args[1]}" '
        args = args[2:]
    rest = (shell_join(args) + " ") if args else ""
    # the first start has no checkpoint yet: allowed (and said), a requeued one resumes
    lines.append(f'rlhf_run {job.module} {cfg}{rest}--load_checkpoint --start_fresh_if_no_checkpoint "$@"')
    return "\n".join(lines) + "\n"


SHIPPED = {
    "ppo_70b.sh": Job("ppo-70b", "rlhf.train_ppo", ["--config", "configs/ppo_llama3_70b_hybrid.yaml"], nodes=4,
                      time="48:00:00"),
    "ppo_8b.sh": Job("ppo-8b", "rlhf.train_ppo", ["--config", "configs/ppo_llama3_8b.yaml"]),
    "grpo_7b.sh": Job("grpo-7b", "rlhf.train_grpo", ["--config", "configs/grpo_qwen2.5_7b_math.yaml"]),
    "dpo_8b.sh": Job("dpo-8b", "rlhf.train_dpo", ["--config", "configs/dpo_llama3_8b.yaml"], time="12:00:00"),
    "rm_8b.sh": Job("rm-8b", "rlhf.train_rm", ["--config", "configs/rm_llama3_8b.yaml"], time="12:00:00"),
    "tiny_cpu.sh": Job("tiny-cpu", "rlhf.train_sft",
                       ["--config", "configs/sft_tiny.yaml", "--save_steps", "20", "--max_global_steps", "40"],
                       gpus_per_node=2, cpus_per_task=2, time="00:20:00", cpu_only=True),
}


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--name", default="rlhf")
@click.option("--nodes", default=1, show_default=True)
@click.option("--gpus_per_node", default=8, show_default=True)
@click.option("--cpus_per_task", default=64, show_default=True)
@click.option("--time", "time_", default="24:00:00", show_default=True)
@click.option("--partition", default=None)
@click.option("--write_shipped", is_flag=True, help="regenerate slurm/*.sh")
@click.argument("trainer", nargs=-1, type=click.UNPROCESSED)
def main(name, nodes, gpus_per_node, cpus_per_task, time_, partition, write_shipped, trainer):
    if write_shipped:
        for fname, job in SHIPPED.items():
            path = os.path.join(ROOT, "slurm", fname)
            with open(path, "w") as fh:
                fh.write(render(job))
            os.chmod(path, 0o755)
        return
    if not trainer:
        raise click.UsageError("give the trainer after --, e.g. -- rlhf.train_ppo --config configs/x.yaml")
    module, *args = trainer
    click.echo(render(Job(name, module, list(args), nodes, gpus_per_node, cpus_per_task, time_, partition)), nl=False)


if __name__ == "__main__":
    main()
