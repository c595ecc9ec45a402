"""Launchers: env derivation and script generation (unit), submitit local executor, and a real local SLURM."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from launch.env import expand_nodelist, job_env, master_port, torchrun_cmd, with_resume
from launch.sbatch import LEAD_FLOOR_S, ROOT, SHIPPED, Job, model_params, params_from_hf_config, render, signal_lead_s


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
    lead = signal_lead_s("rlhf.train_dpo", ["--config", "configs/dpo_llama3_8b.yaml", "--beta", "0.2"], 2, 8)[0]
    for needle in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                   f"--signal=B:USR1@{lead}\n", f"export RLHF_SIGNAL_LEAD_S={lead}\n",
                   "#SBATCH --requeue", 'source "${RLHF_HOME:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"',
                   'rlhf_run rlhf.train_dpo --config "$RLHF_HOME/configs/dpo_llama3_8b.yaml" --beta 0.2 --load_checkpoint '
                   '--start_fresh_if_no_checkpoint "$@"'):
        assert needle in text
    for name, job in SHIPPED.items():
        with open(os.path.join(ROOT, "slurm", name)) as fh:
            assert fh.read() == render(job), f"slurm/{name} is stale: python -m launch.sbatch --write_shipped"
        if job.args[:1] == ["--config"]:
            assert os.path.isfile(os.path.join(ROOT, job.args[1]))
    assert "#SBATCH --signal=B:USR1@300\n" not in open(os.path.join(ROOT, "slurm", "ppo_70b.sh")).read()
    common = open(os.path.join(ROOT, "slurm", "common.sh")).read()
    for needle in ("scontrol show hostnames", "python -m launch.env --exports", "scontrol requeue",
                   "--rdzv_backend c10d", "trap on_usr1 USR1", "trap on_term TERM", "RLHF_STOP_FILE"):
        assert needle in common
    # the NCCL/IB defaults come from the one table in launch/env.py, under whatever the user exported
    from launch.env import NCCL_DEFAULTS

    out = subprocess.run(["bash", "-c", 'export NCCL_IB_HCA=mine; eval "$(python -m launch.env --exports)"; env'],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "NCCL_IB_HCA=mine" in out and f"NCCL_SOCKET_IFNAME={NCCL_DEFAULTS['NCCL_SOCKET_IFNAME']}" in out
    # a hang leaves a flight-recorder trace: dump on NCCL timeout, a ring buffer (new and pre-2.9 names), and the
    # error-handling mode that lets the dump finish (3 = SkipCleanUp)
    for k, v in (("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"), ("TORCH_FR_BUFFER_SIZE", "2000"),
                 ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
                 ("NCCL_NVLS_ENABLE", "0")):
        assert f"{k}={v}\n" in out, f"{k} is not {v} in the job env"
    assert "output/flight_recorder/rank_" in out and 'mkdir -p output "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"' in common
    subprocess.run(["bash", "-n", os.path.join(ROOT, "slurm", "common.sh")], check=True)


def test_param_count_from_config_and_from_name(tmp_path):
    llama3_8b = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, vocab_size=128256,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
    assert abs(params_from_hf_config(llama3_8b) / 8.03e9 - 1) < 0.01, params_from_hf_config(llama3_8b)
    qwen_05b = dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, vocab_size=151936,
                    num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    assert abs(params_from_hf_config(qwen_05b) / 0.494e9 - 1) < 0.01, params_from_hf_config(qwen_05b)
    import json

    (tmp_path / "config.json").write_text(json.dumps(llama3_8b))
    assert model_params(str(tmp_path)) == (params_from_hf_config(llama3_8b), str(tmp_path / "config.json"))
    assert model_params("meta-llama/Meta-Llama-3-70B-Instruct")[0] == 70 * 10 ** 9
    assert model_params("Qwen/Qwen2.5-0.5B")[0] == 5 * 10 ** 8
    assert model_params("org/no-size-here")[0] is None and model_params(None)[0] is None


def test_signal_lead_time_follows_model_size_nodes_and_override():
    ppo70 = ["--config", "configs/ppo_llama3_70b_hybrid.yaml"]
    lead70, why = signal_lead_s("rlhf.train_ppo", ppo70, 4, 8)
    lead8, _ = signal_lead_s("rlhf.train_ppo", ["--config", "configs/ppo_llama3_8b.yaml"], 1, 8)
    # 70B PPO: actor + critic, 2 x 70e9 x 14 B = 1960 GB over 4 nodes at 1 GB/s = 490 s of writing, and as long
    # again to read it back for the manifest's hashes (rlhf/checkpoint/save.py save_checkpoint): 980 s of saving
    assert "save ~980s" in why and lead70 >= 1.5 * 980 and lead70 % 60 == 0, why
    assert lead70 > lead8 > LEAD_FLOOR_S
    assert signal_lead_s("rlhf.train_ppo", ppo70, 8, 8)[0] < lead70          # more nodes: smaller shards, faster
    assert signal_lead_s("rlhf.train_sft", ["--config", "configs/sft_tiny.yaml"], 1, 2)[0] == LEAD_FLOOR_S
    assert Job("x", "rlhf.train_ppo", ppo70, nodes=4, signal_lead_s=900).lead() == (900, "--signal_lead_s, as given")
    import click

    with pytest.raises(click.UsageError, match="over half of --time 00:30:00"):
        render(Job("x", "rlhf.train_ppo", ppo70, nodes=4, time="00:30:00"))


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


# ---- the fail-fast watchdog a launched job relies on (rlhf/distributed/failfast.py) -------------------------------
class _Board:
    """AbortBoard's interface without a store: records what each rank's board would show."""

    def __init__(self):
        self.shown = []

    def set_phase(self, rank, name):
        self.shown.append(name)

    def aborted(self):
        return None

    def phases(self, world):
        return {0: self.shown[-1] if self.shown else "not started"}


def _dog(**kw):
    from rlhf.distributed.watchdog import Watchdog

    return Watchdog(board_=_Board(), start=False, **kw)


def test_watchdog_waiting_rank_reports_role_and_is_held_to_that_phase_plus_what_it_owes():
    dog = _dog(default_s=0.2, slow_s=0.2, deadlines={"actor_update": 0.3})
    with dog.phase("actor_update", waits_for="actor"):
        assert dog.current() == ("waiting for actor (actor_update)", 0.3)
        assert dog.board.shown[-1] == "waiting for actor (actor_update)"
    # the actor ranks may still be updating while this rank already waits in weight_sync's collective
    with dog.phase("weight_sync"):
        label, limit = dog.current()
        assert (label, round(limit, 6)) == ("weight_sync", 0.5), "the wait for actor_update was not carried"
        time.sleep(0.3)
        assert dog.overdue() is None, "a rank waiting for the actor tripped on weight_sync's own deadline"
        time.sleep(0.25)
        report = dog.overdue()
        assert report is not None and "phase 'weight_sync' exceeded its deadline" in report
    with dog.phase("weight_sync"):  # own work ended: nothing owed any more
        assert round(dog.current()[1], 6) == 0.2
    with dog.phase("ref", waits_for="ref"):
        time.sleep(0.25)
        report = dog.overdue()
        assert "phase 'waiting for ref (ref)'" in report and "the ranks of that role are stuck" in report


def test_watchdog_nested_phases_and_explicit_deadline_leave_the_owed_wait_alone():
    dog = _dog(default_s=1.0, slow_s=2.0)
    with dog.phase("critic_update", waits_for="critic"):       # first run: the slow deadline
        assert dog.current()[1] == 2.0
    with dog.phase("rollout_refill", deadline_s=30.0):
        assert dog.current() == ("rollout_refill", 32.0)
        with dog.phase("rollout_refill round 1", deadline_s=3.0):
            assert dog.current() == ("rollout_refill round 1", 3.0)   # a round: its own deadline only
        assert dog.current() == ("rollout_refill", 32.0)
    assert dog.current() is None and dog._owed == 0.0


def test_refill_deadline_scales_with_rounds():
    from rlhf.distributed.watchdog import refill_deadlines

    assert refill_deadlines(600.0, 1200.0, 8) == (1800.0, 1800.0 * 9)
    assert refill_deadlines(600.0, 1200.0, 0) == (1800.0, 1800.0)


def test_rl_trainer_waits_for_only_roles_it_does_not_hold():
    from types import SimpleNamespace as NS

    from rlhf.rl.stages import AdvantagesStage, RewardStage, UpdateStage, WeightSyncStage
    from rlhf.rl.trainer import RLTrainer

    roles = {"actor": NS(is_member=False), "rollout": NS(is_member=True), "critic": NS(is_member=False)}
    tr = NS(roles=NS(all=lambda: roles))
    wf = lambda stage: RLTrainer.waits_for(tr, stage)  # noqa: E731
    assert wf(UpdateStage("actor")) == "actor"
    assert wf(WeightSyncStage(None, None)) is None              # a member of rollout
    assert wf(AdvantagesStage(None, None, None, None, None)) is None        # no role: every rank works
    assert wf(RewardStage(None)) is None                        # no such role (a function)
    roles["actor"] = NS(is_member=True)
    assert wf(UpdateStage("actor")) is None


def test_watchdog_thread_ends_a_stuck_rank_and_leaves_a_flight_recorder_dump(tmp_path):
    code = ("import time\nfrom rlhf.distributed.watchdog import Watchdog, AbortBoard\n"
            "d = Watchdog(default_s=0.3, poll_s=0.05, board_=AbortBoard(None))\n"
            "with d.phase('values', waits_for='critic'):\n    time.sleep(20)\n")
    env = dict(os.environ, PYTHONPATH=ROOT, TORCH_FR_DUMP_TEMP_FILE=str(tmp_path / "fr" / "rank_"),
               WORLD_SIZE="1", RANK="0")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and time.time() - t0 < 15, (p.returncode, p.stderr)
    assert "phase 'waiting for critic (values)' exceeded its deadline of 0s" in p.stderr, p.stderr
    assert os.path.getsize(tmp_path / "fr" / "rank_0") > 0 and "flight recorder of rank 0" in p.stderr, p.stderr


def test_sbatch_scripts_give_torchrun_the_grace_a_save_needs():
    """torchrun SIGKILLs its ranks --shutdown_timeout seconds after forwarding a TERM (30 by default, or
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT: torch/distributed/launcher/api.py LaunchConfig): the scripts export a grace
    that covers the rest of a cut step and the save (issue 42 item 2: a 70B save of ~490 s within 30 s saved
    nothing), say which SLURM KillWait it needs, and how to stop without a deadline."""
    from launch.sbatch import GRACE_FLOOR_S, estimate, shutdown_timeout_s

    job = SHIPPED["ppo_70b.sh"]
    e, _ = estimate(job.module, job.args, job.nodes, job.gpus_per_node)
    grace, why = shutdown_timeout_s(job.module, job.args, job.nodes, job.gpus_per_node)
    assert grace >= 1.5 * e.save_s and grace % 60 == 0 and grace > 30, (grace, why)
    with open(os.path.join(ROOT, "slurm", "ppo_70b.sh")) as fh:
        text = fh.read()
    assert f'export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{grace}}}"' in text
    assert f"KillWait >= {grace + 30}s" in text and "scancel --signal=USR1 --batch" in text
    assert shutdown_timeout_s("rlhf.train_sft", [], 1, 2)[0] == GRACE_FLOOR_S  # no model size: the floor


def test_load_and_save_deadlines_scale_with_the_bytes_they_move():
    """70B PPO (actor + critic) on 4 nodes: a save writes 1960 GB (490 s per node at 1 GB/s) and reads it back for
    the manifest's hashes (rlhf/checkpoint/save.py save_checkpoint: every rank hashes its share), a resume has
    rank 0 hash the whole checkpoint (pick_checkpoint): the watchdog's load/save deadlines follow, far above the
    fixed --watchdog_slow_timeout_s (1200 s) that would have ended the job mid-save; a tiny model keeps the floor."""
    import types

    from launch.sbatch import io_deadlines_s
    from rlhf.rl.checks import io_deadlines

    big = io_deadlines_s(2 * 70_000_000_000, 4 * 70_000_000_000, 4, 1200.0)
    assert big["save"] == pytest.approx(2.0 * (490 + 490)), big
    assert big["load"] == pytest.approx(2.0 * (490 + 1960)), big  # its share read + rank 0 hashing 1960 GB
    assert io_deadlines_s(1_000_000, 2_000_000, 1, 1200.0) == {"load": 1200.0, "save": 1200.0}
    model = types.SimpleNamespace(critic_pretrain=None, ref_pretrain=None, reward_pretrain=None)
    plan = types.SimpleNamespace(ranks={"actor": [0], "critic": [0], "ref": [0], "rollout": [0]})
    got = io_deadlines(model, "meta-llama/Meta-Llama-3-70B-Instruct", plan, 4, 1200.0)
    assert got == pytest.approx(big | {"load": max(big["load"], 2.0 * 3 * 70e9 * 4 / 1e9)}), got
