"""No rank waits forever: the sweep of placements and awkward sizes, and the fault tests.

The sweep runs many configurations per torchrun launch (tests/helpers/sweep.py); each launch
must end by itself well inside its deadline.  The fault tests break one rank (an
exception, SIGKILL, a reward function that blocks) and check that the whole job ends
within 60 s, non-zero, with the cause printed once and first.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers.e2e import ROOT
from helpers.net import free_port
from helpers.sweep import BASE, CASES, resumed_case

pytestmark = pytest.mark.slow

SWEEP = os.path.join(ROOT, "tests", "helpers", "sweep.py")


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def _torchrun(nproc, args, extra=(), **popen):
    return [sys.executable, "-m", "torch.distributed.run", *extra, f"--nproc_per_node={nproc}", *map(str, args)]


def _results(out):
    with open(os.path.join(out, "results.jsonl")) as fh:
        return {r["case"]: r for r in map(json.loads, fh)}


def _check_sweep(res, cases):
    assert sorted(res) == sorted(cases), f"cases that did not report: {sorted(set(cases) - set(res))}"
    for name, r in res.items():
        assert r["steps"] == list(range(r["first_step"], r["expected_steps"] + 1)), (name, r)
        assert r["finite"], f"{name}: a non-finite metric: {r['last']}"
        assert r["exported"], f"{name}: no final model written"
        assert r["last"]["response_len"] > 0, (name, r)
        flags = {**BASE, **resumed_case(name, cases[name], cases)[1][1]}
        if flags.get("async_train"):
            _check_async(name, r, flags)


def _check_async(name, r, flags):
    """--async_train (issue 29), from each step's async/* metrics: the warm-up's K batches are trained at ages
    0 .. K-1, every later one at least K syncs after its generation started and never beyond --max_staleness;
    partial rollout generates at most a chunk per sample and round; every prompt drawn is trained, filtered out,
    dropped as stale or still pending (the counts are means over the engines' first ranks)."""
    k, a = flags.get("async_queue_size", 1), r["async"]
    if flags.get("reward_pretrain"):  # scored ahead on the reward model's ranks: the same scores as scored anew
        assert r["reward_ahead_diff"] is not None and r["reward_ahead_diff"] < 1e-5, f"{name}: {r['reward_ahead_diff']}"
    engines, n, rb = flags["vllm_num_engines"], flags["n_samples_per_prompt"], flags["rollout_batch_size"]
    assert len(a) == len(r["steps"]) and all("async/age_max" in m for m in a), f"{name}: no async metrics: {a}"
    for i, m in enumerate(a):
        where = f"{name} step {i + 1}: {m}"
        assert m["async/age_max"] <= r["max_staleness"], where
        if i < k:  # the warm-up: every batch generated with the starting weights
            assert m["async/age_mean"] == m["async/age_max"] == i, where
        else:
            assert m["async/age_mean"] >= k and m["async/token_age_mean"] >= k, where
        if flags.get("partial_rollout") and m["async/generated_tokens"] > 0:
            chunk = flags["partial_rollout_chunk"]
            assert flags["generate_max_len"] > chunk and m["async/rounds"] >= 2, where
            cap = -(-flags.get("vllm_generate_batch_size", rb) // engines)  # the largest engine's groups in flight
            assert m["async/generated_tokens"] <= chunk * m["async/rounds"] * cap * n, where
    total = lambda key: sum(m[key] for m in a) * engines  # noqa: E731
    pending = (a[-1]["async/buffered_groups"] + a[-1]["async/in_flight_groups"]) * engines
    assert total("async/drawn_prompts") == (len(a) * rb + total("async/filtered_groups")
                                             + total("async/dropped_stale_groups") + pending), f"{name}: {a}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sweep_every_placement_and_awkward_sizes(world, tiny_kit, tmp_path):
    cmd = _torchrun(world, [SWEEP, "--kit", tiny_kit, "--data", tmp_path / "data", "--out", tmp_path],
                    extra=["--standalone"])
    t0 = time.time()
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=420)
    assert p.returncode == 0, f"world {world} failed after {time.time() - t0:.0f}s:\n{p.stderr[-6000:]}"
    res = _results(tmp_path)
    _check_sweep(res, CASES[world])
    if world == 1:  # dynamic filtering refilled the batch: more rounds where groups were filtered, none masked
        r = res["w1_dynamic_filtering_refill"]
        assert max(rounds for rounds, _ in r["refill"]) >= 2 and all(f == 0 for _, f in r["refill"]), r
    for name, (_, flags) in CASES[world].items():  # agents: two turns and the feedback between them, so longer
        if not flags.get("agent_func_path"):        # than one turn; scored by the environment: 0, 0.5 or 1 each
            continue
        r = res[name]
        assert r["last"]["response_len"] > flags["generate_max_len"], (name, r["last"])
        assert abs(r["last"]["reward"] * 8 - round(r["last"]["reward"] * 8)) < 1e-6, (name, r["last"])
    if world == 2:
        # streamed rewards (a reward function's, an agent environment's) filtered groups as they completed; new
        # prompts took their place, none masked
        for name in ("w2_async_k2_partial_oversample_filter", "w2_async_agent_k2_oversample_filter"):
            r = res[name]
            filtered = sum(m["async/filtered_groups"] for m in r["async"])
            assert filtered > 0 and all(f == 0 for _, f in r["refill"]), (name, r)
            # 3 groups in flight for batches of 2: extra complete groups wait in the buffer for a later batch
            assert max(m["async/buffered_groups"] for m in r["async"]) > 0, (name, r["async"])
        check_async_resume(res["w2_async_k2_partial_oversample_filter"], res["w2_async_k2_resume"], p.stdout)
        # --freezing_actor_steps 1: no actor update in step 1; --save_value_network: the critic saved
        r = res["w2_gae_rm_colocated"]
        assert r["actor_updates"] == [False, True] and r["critic_exported"], r
        # one eval prompt on 2 ranks, 2 samples: pass@1 <= pass@2; 2 of them in generations.jsonl (the default 4
        # capped by the rows); on-policy, the gap of step 1 measured by the logprob_gap stage
        r = res["w2_issue_16_prompts"]
        e = r["eval_last"]
        assert e["samples"] == 2 and 0 <= e["eval_default_pass1"] <= e["eval_default_pass2"] <= 1, e
        assert r["generations"] == 2 and r["gap"][0] is not None and r["gap"][0] < 1e-4, r
        check_quiet(p.stdout + p.stderr)
    if world == 4:  # one step off-policy: step 1 trains the weights that generated it, steps 2-3 one update older
        gap = res["w4_actor2_ref1_rollout1_async_gap"]["gap"]
        assert gap[0] < 1e-4 and all(g > 1e-3 and g > 100 * gap[0] for g in gap[1:]), gap


def check_async_resume(full, resumed, out):
    """--async_train K=2 with partial rollout and oversampling, saved at step 2 and resumed (sweep case
    w2_async_k2_resume): the queue is not checkpointed, only the engine's place in its prompt stream (trainer state
    ``async_queue``); the resume says so, generates the K batches again with the resumed weights (ages 0 and 1
    again: ``_check_async``), from the prompts after those the first run had drawn."""
    drawn = lambda r: sum(m["async/drawn_prompts"] for m in r["async"])  # noqa: E731  (one engine)
    # at step 2 the batches of steps 3 and 4 were already generated (K=2 ahead): every prompt of the run was drawn
    assert full["queue_places"]["2"] == drawn(full) > 2 * 2, (full["queue_places"], drawn(full))
    assert out.count("[resume] the async queue restarts") == 1, out[-3000:]
    assert "global_step_2" in out and resumed["first_step"] == 3
    # the resumed stream went on from the first run's place: its checkpoint at step 4 counts both runs' draws
    assert resumed["queue_places"]["4"] == drawn(full) + drawn(resumed), (resumed["queue_places"], drawn(resumed))
    assert drawn(resumed) >= 2 * 2, resumed["async"]


# what no 2-rank job should print: transformers' per-rank load report (the critic's "lm_head UNEXPECTED"), DeepSpeed's
# "Setting accelerator to CPU" (imported by transformers' save under FSDP2), FSDP2's view-tensor warning (critic and
# fused-head actor), transformers' per-rank "Writing model shards" bars, float() of a graph tensor
NOISE = ("LOAD REPORT", "Setting accelerator to CPU", "returned a view tensor", "Writing model shards",
         "Converting a tensor with requires_grad=True to a scalar")


def check_quiet(out: str) -> None:
    """The world-2 sweep loads, trains a critic, saves with FSDP2 and DeepSpeed: none of NOISE; the eval hold-out of
    the one case with a hold-out (w2_issue_16_prompts: 16 prompts, --eval_holdout 0.1) said once, by rank 0."""
    for line in NOISE:
        assert line not in out, f"{line!r} is printed:\n" + "\n".join(x for x in out.splitlines() if line in x)[:2000]
    note = "[data] --eval_holdout 0.1: holding out 1 of 16 rows of --prompt_data for eval"
    assert out.count(note) == 1, f"the eval hold-out is said {out.count(note)} times, not once"


def test_sweep_two_nodes_of_two_ranks(tiny_kit, tmp_path):
    """Two torchrun agents on localhost meeting through c10d rendezvous: node boundaries are real."""
    from helpers.sweep import NODES2

    port = free_port()
    extra = ["--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=sweep2x2"]
    args = [SWEEP, "--nodes2", "--kit", tiny_kit, "--data", tmp_path / "data", "--out", tmp_path]
    procs = [subprocess.Popen(_torchrun(2, args, extra), cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=420) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-6000:]
    _check_sweep(_results(tmp_path), NODES2)


def _fault_run(tiny_kit, tmp_path, fault, extra_flags=(), nproc=2, layout=("--colocate_all_models",), **env):
    d = os.path.join(tiny_kit, "data")
    mark = tmp_path / "fault_time"
    args = ["-m", "rlhf.train_grpo", "--pretrain", tiny_kit, "--prompt_data", f"{d}/prompts_train.jsonl",
            "--eval_dataset", f"{d}/prompts_eval.jsonl", "--max_samples", 64,
            "--remote_rm_url", os.path.join(ROOT, "tests", "helpers", "fault_reward.py"), "--rollout_batch_size", 4,
            "--n_samples_per_prompt", 2, "--train_batch_size", 8, "--micro_train_batch_size", 4,
            "--generate_max_len", 4, "--max_global_steps", 50, "--eval_steps", -1, "--log_dir", tmp_path / "logs",
            "--eval_temperature", 0, "--eval_n_samples_per_prompt", 1,
            "--save_path", tmp_path / "m", "--no_progress_bar", *layout, *extra_flags]
    cmd = _torchrun(nproc, args, extra=["--standalone"])
    t0 = time.time()
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(RLHF_FAULT=fault, RLHF_FAULT_MARK=str(mark), **env),
                       capture_output=True, text=True, timeout=240)
    end = time.time()
    assert mark.exists(), f"the fault was never injected:\n{p.stderr[-4000:]}"
    after = end - float(mark.read_text())
    return p, after, end - t0


def _rank_lines(text):
    return [ln for ln in text.splitlines() if re.match(r"\[rank \d+\]", ln)]


def test_exception_on_one_rank_ends_job_with_its_traceback_first(tiny_kit, tmp_path):
    p, after, _ = _fault_run(tiny_kit, tmp_path, "raise")
    assert p.returncode != 0
    assert after < 60, f"the job took {after:.0f}s to end after the fault"
    lines = _rank_lines(p.stderr)
    assert lines and lines[0].startswith("[rank 1] error:") and "injected reward failure" in lines[0], lines[:5]
    assert sum("Traceback" in ln for ln in lines) == 1, "\n".join(lines)  # the reward function's, once
    assert any("ValueError: injected reward failure on this rank only" in ln for ln in lines)
    assert any(ln.startswith("[rank 0] stopping: the job was aborted by rank 1") for ln in lines), "\n".join(lines)


def test_wrong_length_reward_on_one_rank_ends_job(tiny_kit, tmp_path):
    p, after, _ = _fault_run(tiny_kit, tmp_path, "wrong_len")
    assert p.returncode != 0 and after < 60
    lines = _rank_lines(p.stderr)
    assert lines[0].startswith("[rank 1]") and any("'rewards' has" in ln for ln in lines), "\n".join(lines[:20])


def test_rank_killed_mid_step_ends_job(tiny_kit, tmp_path):
    p, after, _ = _fault_run(tiny_kit, tmp_path, "kill")
    assert p.returncode != 0
    assert after < 60, f"the job took {after:.0f}s to end after rank 1 was killed"
    assert "Signal 9 (SIGKILL)" in p.stderr or "exitcode  : -9" in p.stderr, p.stderr[-3000:]
    lines = _rank_lines(p.stderr)
    assert lines[0].startswith("[rank 0] lost a peer rank"), "\n".join(lines[:20])
    assert not any("Traceback" in ln for ln in lines), "a survivor's traceback would point at the wrong rank"


def test_blocking_reward_function_is_caught_by_the_watchdog(tiny_kit, tmp_path):
    """A synchronous reward function that never returns on rank 1: the phase deadline ends the job and the
    report names every rank's phase."""
    p, after, _ = _fault_run(tiny_kit, tmp_path, "block", ["--watchdog_timeout_s", 5, "--watchdog_slow_timeout_s", 60,
                                                           "--reward_timeout_s", 1000])
    assert p.returncode != 0
    assert after < 60, f"the job took {after:.0f}s to end after rank 1 blocked"
    err = p.stderr
    assert "exceeded its deadline of 5s" in err, err[-3000:]
    assert re.search(r"rank 1: reward_function for \d+s", err), err[-3000:]


def test_separate_roles_exception_on_rollout_rank(tiny_kit, tmp_path):
    """Roles on ranks of their own (actor 0, rollout 1, async): rank 1 raises in its reward call while rank 0
    may be training; the job still ends promptly."""
    p, after, _ = _fault_run(tiny_kit, tmp_path, "raise", layout=("--actor_num_gpus_per_node", 1,
                                                                  "--vllm_num_engines", 1, "--async_train"))
    assert p.returncode != 0 and after < 60
    assert _rank_lines(p.stderr)[0].startswith("[rank 1] error:")


ASYNC_K2_PARTIAL = ("--actor_num_gpus_per_node", 1, "--vllm_num_engines", 1, "--async_train", "--async_queue_size", 2,
                    "--partial_rollout", "--partial_rollout_chunk", 1, "--vllm_generate_batch_size", 6)


def test_rollout_rank_killed_mid_generation_async(tiny_kit, tmp_path):
    """--async_train, K=2, partial rollout (chunks of 1 of 4 tokens), 6 groups in flight for batches of 4: rewards
    are streamed, so the reward function runs on the rollout rank (rank 1; the actor is rank 0) inside its produce
    stage, in the loop of generation rounds.  Its 3rd call is the produce of step 2 (the warm-up's two calls left 4
    buffered groups, so the batch of step 3 needed none): SIGKILL there while rank 0 trains step 2 ends the job
    promptly, the lost peer named first, after step 1 was logged."""
    from rlhf.utils.logging import read_metrics

    p, after, _ = _fault_run(tiny_kit, tmp_path, "kill", layout=ASYNC_K2_PARTIAL, RLHF_FAULT_CALL="3")
    assert p.returncode != 0
    assert after < 60, f"the job took {after:.0f}s to end after the rollout rank was killed"
    assert "Signal 9 (SIGKILL)" in p.stderr or "exitcode  : -9" in p.stderr, p.stderr[-3000:]
    lines = _rank_lines(p.stderr)
    assert lines and lines[0].startswith("[rank 0] lost a peer rank"), "\n".join(lines[:20])
    assert not any("Traceback" in ln for ln in lines), "a survivor's traceback would point at the wrong rank"
    steps = [r["step"] for r in read_metrics(str(tmp_path / "logs" / "metrics.jsonl")) if r["split"] == "train"]
    assert steps == [1], f"the rollout rank died in the produce of step 2, yet the steps logged are {steps}"


def test_sigterm_to_torchrun_checkpoints_and_says_not_complete(tiny_kit, tmp_path):
    """What scancel or an operator sends: torchrun forwards SIGTERM to the ranks; they agree at the step boundary,
    checkpoint, and say the run is not complete; a resume continues from that step."""
    import signal

    d = os.path.join(tiny_kit, "data")
    ck = tmp_path / "ck"
    args = ["-m", "rlhf.train_grpo", "--pretrain", tiny_kit, "--prompt_data", f"{d}/prompts_train.jsonl",
            "--eval_dataset", f"{d}/prompts_eval.jsonl", "--remote_rm_url", "builtin:arithmetic",
            "--rollout_batch_size", 4, "--n_samples_per_prompt", 2, "--train_batch_size", 8,
            "--micro_train_batch_size", 4, "--generate_max_len", 4, "--max_global_steps", 400, "--ckpt_path", ck,
            "--eval_temperature", 0, "--eval_n_samples_per_prompt", 1,
            "--log_dir", tmp_path / "logs", "--save_path", tmp_path / "m", "--no_progress_bar",
            "--colocate_all_models"]
    p = subprocess.Popen(_torchrun(2, args, extra=["--standalone"]), cwd=tmp_path, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    assert p.poll() is None, p.communicate()[1][-3000:]
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert time.time() - t0 < 35, "the ranks did not stop within torchrun's 30 s grace"
    steps = sorted(int(n.split("_")[-1]) for n in os.listdir(ck) if n.startswith("global_step_"))
    assert steps, f"no checkpoint written on SIGTERM:\n{out[-2000:]}\n{err[-3000:]}"
    assert "[preempt] stop signal" in out and "NOT complete" in out, out[-2000:]
    assert p.returncode != 0  # torchrun itself was signalled: not a completion
    assert not (tmp_path / "m" / "model.safetensors").exists()  # no final export for an incomplete run
