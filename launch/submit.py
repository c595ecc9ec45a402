"""submitit launcher:  python -m launch.submit --nodes N --gpus_per_node G --partition P -- rlhf.train_grpo <flags>

One task per node runs torchrun; rank 0's node is the rendezvous host.  On
preemption or timeout submitit calls ``checkpoint()``: the trainers are told to
save (stop file), and the job is requeued with ``--load_checkpoint``.
``--local`` runs on this machine through submitit's local executor.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List, Optional

import click

from .env import job_env, master_port, torchrun_cmd, with_resume
from .sbatch import signal_lead_s as sbatch_lead


class TorchrunJob:
    """``grace_s``: how long ``checkpoint()`` lets the trainers finish their step and save before submitit requeues
    (and so ends) this instance: the preemption notice less a minute for the requeue itself."""

    def __init__(self, module: str, args: List[str], gpus_per_node: int, stop_file: str, env: Optional[dict] = None,
                 grace_s: float = 60.0):
        self.module, self.args, self.gpus_per_node = module, list(args), gpus_per_node
        self.stop_file, self.env, self.grace_s = stop_file, dict(env or {}), grace_s

    def command(self, nnodes: int, node_rank: int, master: str, port: int) -> List[str]:
        return torchrun_cmd(self.module, self.args, nnodes, max(self.gpus_per_node, 1), master, port, node_rank,
                            python=sys.executable)

    def __call__(self):
        import submitit

        try:
            je = submitit.JobEnvironment()
            hosts, node_rank, job_id = je.hostnames, je.node, je.job_id
        except RuntimeError:
            hosts, node_rank, job_id = ["127.0.0.1"], 0, "0"
        master = hosts[0] if len(hosts) > 1 else "127.0.0.1"
        env = job_env(overrides={**self.env, "RLHF_STOP_FILE": self.stop_file})
        os.makedirs(os.path.dirname(env["TORCH_FR_DUMP_TEMP_FILE"]) or ".", exist_ok=True)  # flight-recorder dumps
        if os.path.exists(self.stop_file) and node_rank == 0:
            os.remove(self.stop_file)
        cmd = self.command(len(hosts), node_rank, master, master_port(job_id))
        print("launch:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun exited with {proc.returncode}")
        return proc.returncode

    def checkpoint(self, *args, **kwargs):
        """Preempted / timed out: ask the trainers to checkpoint, then requeue with --load_checkpoint."""
        import submitit

        open(self.stop_file, "w").close()
        time.sleep(float(os.environ.get("RLHF_PREEMPT_GRACE_S", self.grace_s)))
        return submitit.helpers.DelayedSubmission(TorchrunJob(self.module, with_resume(self.args), self.gpus_per_node,
                                                              self.stop_file, self.env, self.grace_s))


def make_executor(folder: str, nodes: int, gpus_per_node: int, partition: Optional[str], time_min: int,
                  cpus_per_task: int, local: bool, account: Optional[str] = None, qos: Optional[str] = None,
                  signal_lead_s: int = 300):
    import submitit

    ex = submitit.AutoExecutor(folder=folder, cluster="local" if local else None)
    params = dict(nodes=nodes, tasks_per_node=1, timeout_min=time_min, cpus_per_task=cpus_per_task,
                  name="rlhf")
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    if not local:
        params.update(slurm_partition=partition, slurm_signal_delay_s=signal_lead_s)
        extra = {}
        if account:
            extra["account"] = account
        if qos:
            extra["qos"] = qos
        if extra:
            params["slurm_additional_parameters"] = extra
    ex.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return ex


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nodes", default=1, show_default=True)
@click.option("--gpus_per_node", default=8, show_default=True)
@click.option("--partition", default=None)
@click.option("--account", default=None)
@click.option("--qos", default=None)
@click.option("--time_min", default=24 * 60, show_default=True)
@click.option("--cpus_per_task", default=32, show_default=True)
@click.option("--folder", default="./output/submitit/%j", show_default=True)
@click.option("--signal_lead_s", default=0, show_default=True,
              help="seconds of notice before the time limit to finish the step and save; 0 = from the model size "
                   "and recipe (launch/sbatch.py signal_lead_s, README: SLURM)")
@click.option("--local", is_flag=True, help="run with submitit's local executor (no SLURM)")
@click.option("--wait", is_flag=True, help="block until the job ends and print its output")
@click.argument("trainer", nargs=-1, type=click.UNPROCESSED, required=True)
def main(nodes, gpus_per_node, partition, account, qos, time_min, cpus_per_task, folder, signal_lead_s, local, wait,
         trainer):
    module, *args = trainer
    if not module.startswith("rlhf."):
        raise click.UsageError(f"expected a trainer module such as rlhf.train_grpo after --, got {module!r}")
    if local and nodes > 1:
        raise click.UsageError("--local runs on this machine: use --nodes 1")
    lead, why = (signal_lead_s, "--signal_lead_s") if signal_lead_s > 0 else sbatch_lead(module, args, nodes,
                                                                                        gpus_per_node)
    if not local and lead * 2 > time_min * 60:
        raise click.UsageError(f"the preemption notice of {lead}s ({why}) is over half of --time_min {time_min}: "
                               f"give a longer --time_min, or a smaller --signal_lead_s")
    ex = make_executor(folder, nodes, gpus_per_node, partition, time_min, cpus_per_task, local, account, qos, lead)
    stop = os.path.abspath(os.path.join(os.path.dirname(folder.replace("%j", "x")) or ".", "rlhf.stop"))
    job = ex.submit(TorchrunJob(module, args, gpus_per_node, stop, grace_s=max(60.0, lead - 60.0)))
    click.echo(f"submitted job {job.job_id} ({'local' if local else 'slurm'}); logs in {folder}")
    if wait:
        job.result()
        click.echo(job.stdout() or "")


if __name__ == "__main__":
    main()
