"""Launchers: env derivation and script generation (unit), submitit local executor, and a real local SLURM."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from launch.env import expand_nodelist, job_env, master_port, torchrun_cmd, with_resume
from launch.sbatch import ROOT, SHIPPED, Job, render


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_nodelist("single") == ["single"]


def test_master_port_and_env_precedence():
    assert master_port("12345") == 20000 + 12345 % 20000
    assert 20000 <= master_port("99999999") < 40000
    env = job_env(base={"NCCL_IB_HCA": "mlx5_0,mlx5_1", "PATH": "/bin"}, overrides={"RLHF_STOP_FILE": "/x"})
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"       # the user's choice wins
    assert env["NCCL_IB_DISABLE"] == "0" and env["RLHF_STOP_FILE"] == "/x" and env["PATH"] == "/bin"


def test_torchrun_cmd():
    single = torchrun_cmd("rlhf.train_grpo", ["--bf16"], 1, 2, "127.0.0.1", 1234)
    assert "--standalone" in single and single[-3:] == ["-m", "rlhf.train_grpo", "--bf16"]
    assert "--nproc_per_node=2" in single and not any(a.startswith("--rdzv") for a in single)
    multi = torchrun_cmd("rlhf.train_ppo", ["--config", "c.yaml"], 4, 8, "gpu01", 2345, node_rank=3)
    assert "--rdzv_endpoint=gpu01:2345" in multi and "--nnodes=4" in multi and "--node_rank=3" in multi
    assert multi[-4:] == ["-m", "rlhf.train_ppo", "--config", "c.yaml"] and "--standalone" not in multi
    both = ["--load_checkpoint", "--start_fresh_if_no_checkpoint"]
    assert with_resume(["--x"]) == ["--x"] + both and with_resume(["--load_checkpoint"]) == both


def test_render_and_shipped_scripts_in_sync():
    text = render(Job("j", "rlhf.train_dpo", ["--config", "configs/dpo_llama3_8b.yaml", "--beta", "0.2"], nodes=2,
                      partition="gpu"))
    for needle in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "--signal=B:USR1@300",
                   "#SBATCH --requeue", 'source "${RLHF_HOME:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"',
                   'rlhf_run rlhf.train_dpo --config "$RLHF_HOME/configs/dpo_llama3_8b.yaml" --beta 0.2 --load_checkpoint '
                   '--start_fresh_if_no_checkpoint "$@"'):
        assert needle in text
    for name, job in SHIPPED.items():
        with open(os.path.join(ROOT, "slurm", name)) as fh:
            assert fh.read() == render(job), f"slurm/{name} is stale: python -m launch.sbatch --write_shipped"
        if job.args[:1] == ["--config"]:
            assert os.path.isfile(os.path.join(ROOT, job.args[1]))
    common = open(os.path.join(ROOT, "slurm", "common.sh")).read()
    for needle in ("scontrol show hostnames", "python -m launch.env --exports", "scontrol requeue",
                   "--rdzv_backend c10d", "trap on_usr1 USR1", "trap on_term TERM", "RLHF_STOP_FILE"):
        assert needle in common
    # the NCCL/IB defaults come from the one table in launch/env.py, under whatever the user exported
    from launch.env import NCCL_DEFAULTS

    out = subprocess.run(["bash", "-c", 'export NCCL_IB_HCA=mine; eval "$(python -m launch.env --exports)"; env'],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "NCCL_IB_HCA=mine" in out and f"NCCL_SOCKET_IFNAME={NCCL_DEFAULTS['NCCL_SOCKET_IFNAME']}" in out
    subprocess.run(["bash", "-n", os.path.join(ROOT, "slurm", "common.sh")], check=True)


@pytest.mark.slow
def test_submitit_local_executor_runs_trainer(tiny_kit, tmp_path):
    d = os.path.join(tiny_kit, "data")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "launch.submit", "--local", "--wait", "--gpus_per_node", "2",
                        "--folder", str(tmp_path / "sub" / "%j"), "--", "rlhf.train_sft", "--pretrain", tiny_kit,
                        "--dataset", f"{d}/sft_train.jsonl", "--max_global_steps", "4", "--no_progress_bar",
                        "--save_path", str(tmp_path / "m"), "--log_dir", str(tmp_path / "logs")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[train 4]" in p.stdout and "--nproc_per_node=2" in p.stdout
    assert os.path.isfile(tmp_path / "m" / "model.safetensors")


def _slurm_ok() -> bool:
    if not shutil.which("sbatch"):
        return False
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return r.returncode == 0 and re.search(r"idle|mixed|alloc", r.stdout) is not None


def _state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    m = re.search(r"JobState=(\w+)", out)
    return m.group(1) if m else "GONE"


def _wait_for(pred, timeout, step=1.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return True
        time.sleep(step)
    return False


@pytest.mark.slow
@pytest.mark.skipif(not _slurm_ok(), reason="no local SLURM (start one with .ci/slurm_up.sh)")
def test_sbatch_tiny_job_then_preempt_requeue_resume(tmp_path):
    env = dict(os.environ, RLHF_HOME=ROOT, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    script = os.path.join(ROOT, "slurm", "tiny_cpu.sh")
    r = subprocess.run(["sbatch", "--wait", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    job = re.search(r"Submitted batch job (\d+)", r.stdout).group(1)
    log = open(tmp_path / f"tiny-cpu-{job}.out").read()
    assert "[slurm] job" in log and "x 2 ranks" in log and "[train 40]" in log and "[eval 40]" in log
    assert os.path.isfile(tmp_path / "output" / "tiny_sft_ckpt" / "global_step_40" / "trainer_state.json")
    assert os.path.isfile(tmp_path / "output" / "tiny_sft" / "model.safetensors")
    # a long job: USR1 (what --signal sends before the time limit / on preemption) -> checkpoint -> requeue -> resume
    work = tmp_path / "preempt"
    work.mkdir()
    r = subprocess.run(["sbatch", script, "--max_epochs", "60", "--max_global_steps", "0", "--save_steps", "100000",
                        "--logging_steps", "25"], cwd=work, env=env, capture_output=True, text=True, check=True)
    job = re.search(r"Submitted batch job (\d+)", r.stdout).group(1)
    out = work / f"tiny-cpu-{job}.out"
    read = lambda: out.read_text() if out.exists() else ""  # noqa: E731
    try:
        assert _wait_for(lambda: "[train 50]" in read(), 180), read()
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
        assert _wait_for(lambda: "requeueing" in read(), 120), read()
        # SLURM holds a requeued job for a while; release it once the old instance has fully ended
        assert _wait_for(lambda: _state(job) == "PENDING", 120), _state(job)
        time.sleep(5)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], capture_output=True)
        assert _wait_for(lambda: "[resume] from" in read(), 180), (read(), _state(job))
    finally:
        subprocess.run(["scancel", job], capture_output=True)  # TERM: checkpoint and end, no requeue
        _wait_for(lambda: _state(job) not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"), 120)
    text = read()
    step = int(re.search(r"\[preempt\] stop file \S+: checkpoint of step (\d+) saved", text).group(1))
    assert f"[resume] from ./output/tiny_sft_ckpt/global_step_{step} at step {step}" in text
    assert "(restart 1)" in text
