"""The bench scripts themselves keep working: the GPU script's --smoke run on the CPU, and our side of the
TRL comparisons (the TRL side needs the [bench] extra, not installed for tests)."""
import json
import os
import subprocess
import sys

from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path):
    # a port of its own: in-process tests earlier in the session leave MASTER_PORT set to one they used
    env = dict(os.environ, OUT=str(tmp_path), HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONPATH=ROOT,
               OMP_NUM_THREADS="2", MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_gpu_bench_smoke_on_cpu(tmp_path):
    _run(["bench/gpu_bench.py", "--smoke"], tmp_path)
    res = json.load(open(tmp_path / "gpu_bench_smoke.json"))
    assert set(res) == {"rollout", "weight_sync_and_sleep", "mfu"}
    assert not [k for k, v in res.items() if "error" in v]
    assert res["rollout"]["ours_tokens_per_s"] > 0 and res["rollout"]["bare_tokens_per_s"] > 0
    ws = res["weight_sync_and_sleep"]
    assert ws["engine_max_abs_diff_vs_actor_bf16"] == 0.0  # the engine holds exactly the actor's weights in bf16
    assert ws["sync_gb"] > 0
    assert 0 < res["mfu"]["mfu"] < 1


def test_bench_rlhf_sides_report_timed_steps(tmp_path):
    kit = str(tmp_path / "kit")
    g = _run(["bench/grpo_vs_trl.py", "--side", "rlhf", "--steps", "7", "--prompts", "2", "--n", "4",
              "--max_new", "6", "--kit_dir", kit], tmp_path)
    d = _run(["bench/dpo_vs_trl.py", "--side", "rlhf", "--steps", "7", "--batch", "4", "--kit_dir", kit], tmp_path)
    for line, timed in ((g, 2), (d, 2)):
        res = json.loads([x for x in line.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
        assert res["steps_timed"] == timed and res["s_per_step"] > 0 and res["tokens_per_s"] > 0
