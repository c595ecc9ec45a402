"""The bench scripts themselves keep working: the GPU script's --smoke run on the CPU, our side of the TRL
comparisons under the block protocol (the TRL side needs the [bench] extra, not installed for tests), and the
summary / spread arithmetic.  No timing is asserted."""
import json
import os
import subprocess
import sys

from helpers.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
            assert b["precision"] == "fp32" and b["gradient_checkpointing"] is False, "read back from the config"


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


def test_bench_like_with_like_and_revision_ratios():
    """Both sides get the same precision and checkpointing (TRL would default to bf16 and checkpointing), a side
    that resolved something else is refused before any timed block; compare_revisions' B/A ratios and reading."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import pytest
    from common import check_like_with_like, rlhf_flags, table, trl_args
    from compare_revisions import cancel_order, median_interval, paired_ratios, verdict

    assert trl_args("fp32", False) == {"bf16": False, "fp16": False, "gradient_checkpointing": False}
    assert trl_args("bf16", True)["bf16"] is True and rlhf_flags("bf16", True) == ["--bf16", "--gradient_checkpointing"]
    assert rlhf_flags("fp32", False) == []
    same = {"precision": "fp32", "gradient_checkpointing": False}
    check_like_with_like(same, {"trl": dict(same), "rlhf": dict(same)})
    with pytest.raises(RuntimeError, match="'trl': {'precision': 'bf16'}"):
        check_like_with_like(same, {"trl": dict(same, precision="bf16"), "rlhf": dict(same)})
    with pytest.raises(RuntimeError, match="precision"):
        check_like_with_like(same, {"rlhf": {"gradient_checkpointing": False}})  # reported nothing: refused

    a = [{"steps": 2, "cpu_s": 2.0, "wall_s": 3.0}] * 4
    b = [{"steps": 1, "cpu_s": c, "wall_s": 1.5} for c in (1.0, 1.01, 0.99, 1.02)]
    assert paired_ratios(a, b) == [1.0, 1.01, 0.99, 1.02] and paired_ratios(a, b, "wall_s") == [1.0] * 4
    assert median_interval([5, 1, 4, 2, 3, 8, 7, 6]) == (2, 7), "n=8: x(2)..x(7) covers the median with 93%"
    assert median_interval([1.0, 1.1, 0.9]) is None, "3 rounds: no 90% interval"
    assert verdict(paired_ratios(a, b) * 2, 0.03)["reading"] == "within"
    assert verdict([1.05, 1.06, 1.05, 1.06, 1.07, 1.05], 0.03)["reading"] == "outside"
    assert verdict([0.97, 0.95, 0.99, 1.0, 0.96, 1.01, 0.94, 0.97], 0.03)["reading"] == "unclear", "straddles 0.97"
    assert verdict([1.0, 1.01], 0.03)["reading"] == "unclear", "too few rounds to tell"
    # the start-order effect cancels: A first reads t*s, B first reads t/s (t = 1.01, s = 0.96 here)
    first, second = verdict([1.01 * 0.96] * 8, 0.03), verdict([1.01 / 0.96] * 8, 0.03)
    both = cancel_order(first, second, 0.03)
    assert abs(both["ratio"] - 1.01) < 1e-9 and abs(both["second_started_factor"] - 0.96) < 1e-9
    assert first["reading"] == "outside" and both["reading"] == "within"
    row = {"s_per_step": 1.0, "cpu_s_per_step": 0.5, "tokens_per_s": 10.0, "peak_rss_mb": 100.0,
           "blocks_cpu_s_per_step": [0.5, 0.5]}
    assert "rlhf only" in table("x", {"rlhf": row}, same, []), "--ours_only: one side, no speed-up"


def test_async_rl_bench_smoke(tmp_path):
    """bench/async_rl.py --smoke: sync and --async_train K=2 + partial rollout + 2x oversampling run under torchrun
    (actor on rank 0, rollout engine on rank 1) and the results JSON holds each configuration's throughput, idle
    times, ages, IS weights, reward curve and the comparison with sync.  Values are checked for sanity, not speed."""
    _run(["bench/async_rl.py", "--smoke"], tmp_path)
    res = json.load(open(tmp_path / "async_rl_smoke.json"))
    s = res["settings"]
    assert set(res["configs"]) == {"sync", "async_k2_partial"}, list(res["configs"])
    lens = res["length_distribution"]
    assert lens["samples"] == 512 and 1 <= lens["percentiles"]["p50"] <= lens["percentiles"]["p99"] <= 12, lens
    for name, c in res["configs"].items():
        assert len(c["reward_curve"]) == s["steps"] and len(c["accuracy_curve"]) == s["steps"], (name, c)
        assert all(0.0 <= x <= 1.0 for x in c["reward_curve"]), (name, c["reward_curve"])
        assert c["s_per_step"] > 0 and abs(c["steps_per_s"] * c["s_per_step"] - 1) < 1e-9, (name, c)
        assert c["generated_tokens_per_s"] > 0 and c["trained_response_tokens_per_s"] > 0, (name, c)
        assert 0 <= c["trainer_wait_s"] < c["s_per_step"], f"{name}: the trainer idles less than a whole step"
        assert 0 < c["response_len"] <= 12 and 0 <= c["truncated_frac"] <= 1, (name, c)
    sync, asy = res["configs"]["sync"], res["configs"]["async_k2_partial"]
    assert "age_mean" not in sync, "sync has no queue: no age metrics"
    # K=2: the first step trains the warm-up batch (age 0), later ones are 2 syncs behind; partial samples go older
    assert 0 < asy["age_mean"] <= asy["age_max"] and 2 <= asy["age_max"], asy
    assert 0 < asy["is_weight_min"] <= 1 <= asy["is_weight_max"], "IS correction is on by default under --async_train"
    assert asy["rollout_wait_s"] >= 0 and asy["dropped_stale_groups"] >= 0
    assert res["ratios_vs_sync"]["sync"]["steps_per_s"] == 1.0
    assert set(res["reward_vs_sync"]["async_k2_partial"]) >= {"delta_vs_sync", "noise_2se", "within_noise"}
    assert [r["seed"] for r in res["runs"]["async_k2_partial"]] == s["seeds"]
    assert res["machine"]["cpus"] >= 1 and len(res["machine"]["loadavg_end"]) == 3


def test_gpu_check_summary_collects_verdicts(tmp_path):
    """bench/gpu.sh's last step (bench/gpu_gates.py summary): every gate's verdict line and each trainer run's
    per-phase memory beside the planner's stage end up in $OUT's summary.json / summary.txt, the FAIL lines in
    failures.txt, and the exit status is 1 when any gate failed (0 when none did); nothing else is written."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import gpu_gates

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    (work / "verdicts.txt").write_text("GATE load_peak: PASS peak 1.0 GiB\nGATE sft_lora: FAIL exit 1 after 3s: "
                                       "ValueError: x\nGATE head_gap: SKIP CPU\n")
    mem = {"train": {"allocated_GiB": 1.5, "reserved_GiB": 2.0, "free_GiB": 70.0, "pinned_GiB": 0.25,
                     "stage": "train", "predicted_GiB": 1.75}}
    (work / "results.jsonl").write_text(json.dumps({"name": "sft_packing", "kind": "sft", "world": 1, "status": "ok",
                                                    "batch_devices": ["cuda:0"], "memory": mem}) + "\n")
    assert gpu_gates.summary(str(work), str(out)) == 1
    assert sorted(os.listdir(out)) == ["failures.txt", "summary.json", "summary.txt"]
    res = json.load(open(out / "summary.json"))
    assert [(g["gate"], g["verdict"]) for g in res["gates"]] == [("load_peak", "PASS"), ("sft_lora", "FAIL"),
                                                                 ("head_gap", "SKIP")]
    assert res["failed"] == 1 and res["runs"][0]["memory"]["train"]["predicted_GiB"] == 1.75
    assert (out / "failures.txt").read_text() == "GATE sft_lora: FAIL exit 1 after 3s: ValueError: x\n"
    txt = (out / "summary.txt").read_text()
    assert "reserved   2.000" in txt and "planned   1.750 (train)" in txt, txt
    (work / "verdicts.txt").write_text("GATE load_peak: PASS peak 1.0 GiB\n")
    assert gpu_gates.summary(str(work), str(out)) == 0
    assert (out / "failures.txt").read_text() == ""
