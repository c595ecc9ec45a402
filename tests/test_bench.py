"""The bench scripts themselves keep working: the GPU script's --smoke run on the CPU, our side of the TRL
comparisons under the block protocol (the TRL side needs the [bench] extra, not installed for tests), and the
summary / spread arithmetic.  No timing is asserted."""
import json
import os
import subprocess
import sys

from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path, stdin=None):
    # a port of its own: in-process tests earlier in the session leave MASTER_PORT set to one they used
    env = dict(os.environ, OUT=str(tmp_path), HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONPATH=ROOT,
               OMP_NUM_THREADS="2", MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                         input=stdin)
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


def _blocks(stdout):
    return [json.loads(x[len("WAIT "):]) for x in stdout.splitlines() if x.startswith("WAIT ")]


def test_bench_rlhf_sides_report_blocks(tmp_path):
    """Our side of each comparison runs under the block protocol (bench/common.py Gate): a warm-up report, then
    one report per block with its steps, wall and CPU time, tokens and peak RSS; "go" lines on stdin drive it."""
    kit = str(tmp_path / "kit")
    go = "go\n" * 3  # after the warm-up and after each of the 2 blocks (the last "go" lets it finish)
    g = _run(["bench/grpo_vs_trl.py", "--side", "rlhf", "--prompts", "2", "--n", "4", "--max_new", "6",
              "--warmup", "1", "--block", "2", "--rounds", "2", "--kit_dir", kit], tmp_path, stdin=go)
    d = _run(["bench/dpo_vs_trl.py", "--side", "rlhf", "--batch", "4", "--warmup", "1", "--block", "2", "--rounds", "2",
              "--kit_dir", kit], tmp_path, stdin=go)
    for out in (g, d):
        blocks = _blocks(out)
        assert [b["steps"] for b in blocks] == [1, 2, 2], "warm-up of 1 step, then 2 blocks of 2 steps"
        for b in blocks:
            assert b["wall_s"] > 0 and b["cpu_s"] > 0 and b["tokens"] > 0 and b["peak_rss_mb"] > 100


def test_bench_summary_and_spread_flag():
    """Medians, the per-round paired ratios, the spread and its flag, from hand-made blocks."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from common import MAX_SPREAD, side_summary, spread, table, verdict

    warm = {"steps": 1, "wall_s": 9.0, "cpu_s": 9.0, "tokens": 10.0, "peak_rss_mb": 50.0}
    trl = [dict(warm, steps=2, wall_s=w, cpu_s=w, peak_rss_mb=300.0) for w in (4.0, 4.4, 6.0)]
    ours = [dict(warm, steps=2, wall_s=w, cpu_s=w / 2, peak_rss_mb=200.0) for w in (2.0, 2.0, 2.0)]
    rows = {"trl": side_summary(trl, warm), "rlhf": side_summary(ours, warm)}
    assert rows["trl"]["s_per_step"] == 2.2 and rows["trl"]["steps_timed"] == 6
    assert rows["rlhf"]["peak_rss_mb"] == 200.0 and rows["rlhf"]["cpu_s_per_step"] == 0.5
    ratios = [t / o for t, o in zip(rows["trl"]["blocks_s_per_step"], rows["rlhf"]["blocks_s_per_step"])]
    assert ratios == [2.0, 2.2, 3.0]
    v = verdict(ratios)
    assert v["speedup"] == 2.2 and abs(v["spread"] - spread(ratios)) < 1e-12
    assert v["spread"] > MAX_SPREAD and not v["stable"], "a 2.0-3.0 range around 2.2 is too wide to be a result"
    assert "UNSTABLE wall" in table("x", rows, {"kit": "t"}, ratios)
    assert "UNSTABLE CPU" in table("x", rows, {}, ratios), "CPU ratios 4.0, 4.4, 6.0 are as wide"
    tight = [2.0, 2.02, 1.98, 2.01]
    assert verdict(tight)["stable"] and "UNSTABLE wall" not in table("x", rows, {}, tight)
    assert not verdict([2.0])["stable"], "one round has no spread: never a result"
