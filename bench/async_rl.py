"""Asynchronous RL on the CPU (issue 29): sync vs --async_train K=1, K=2 and K=2 + partial rollout, on rollout
ranks of their own, with a skewed response-length distribution.

    python bench/async_rl.py [--out DIR]      # the full bench: ~6-7 min on 2 shared cores (SFT cached in --work)
    python bench/async_rl.py --smoke          # the machinery only: sync and async_k2_partial, 4 steps (the test)

Every configuration runs the real CLI (``torchrun -m rlhf.train_grpo``, 2 ranks: the actor on rank 0, the HF
rollout engine on rank 1: ``--actor_num_gpus_per_node 1 --vllm_num_engines 1``) with the same seeds, steps, batch
sizes and placement; only the async flags differ:

    sync               (no --async_train)
    async_k1           --async_train                        (--async_queue_size 1)
    async_k2           --async_train --async_queue_size 2
    async_k2_partial   --async_train --async_queue_size 2 --partial_rollout --vllm_generate_batch_size 2x
                       (2x oversampling; --partial_rollout_chunk: its default, --generate_max_len / 4)

The skewed lengths (most responses short, a few long, a tail to --generate_max_len).  The policy is the tiny model
SFT'd on the arithmetic task (``configs/sft_tiny.yaml``, as rlhf/demo.py does), built once and cached under
--work, from the kit's SFT rows where a fraction (``--long_frac``, 10%) of the outputs go on after the answer
with a run of "." tokens of uniform length in [8, 160] (one token each; seed 0): the model learns to stop right
after the answer most of the time and, now and then, to run on for tens of tokens.  The reward
(builtin:arithmetic) reads the first integer of the response, so the tail does not change what is rewarded.
Then the EOS row of the (untied) LM head is scaled by ``--eos_scale`` (0.85) to thicken the tail.  Both steps are
deterministic.  Measured at --temperature 1.0 (128 prompts x 4 samples, --generate_max_len 128), the SFT'd
model alone (scale 1.0): mean 4.7 tokens, p50 3, p90 3, p95 9, p99 61, 0.2% truncated; with the scale 0.85
(what the bench uses): mean 10.1, p50 3, p75 3, p90 24, p95 74, p98 114, p99 128, 1.8% truncated, 11.5% over 16
tokens.  The bench re-measures it each time (``length_distribution`` in the JSON).

Two kinds of runs, because GRPO moves the length distribution as it trains (at the learning rate that moves the
reward in 30 steps, the tail grows in some runs and vanishes in others, by seed: the step times then compare
different distributions, not the configurations):
- timing runs (``--timing_seeds``, 2 seeds x 20 steps): --actor_learning_rate 0, the same compute (forwards,
  backward, optimizer step, weight sync) on a policy that stays as measured: the throughput and idle numbers
  (``configs.<name>.throughput``, the ratios vs sync) come from these;
- learning runs (``--seeds``, 3 seeds x 30 steps, --actor_learning_rate 5e-4, k3 KL loss 0.02): the reward
  curves, ages, IS weights (1 exactly without learning), the stream's counts, and their own timings and lengths.

The HF engine generates --micro_rollout_batch_size rows (16) at a time and a chunk lasts until its longest row
stops, as a real engine's batch lasts until its longest request: one long sample holds up the others.

Per configuration (from the runs' metrics.jsonl; the first ``--skip`` steps (2) are left out of the timings):
s/step and steps/s, trained response tokens/s, generated tokens/s (async: ``async/generated_tokens``, which
counts the oversampled and in-flight tokens too), trainer idle time per step (``async/trainer_wait_s``; for sync
the same sum: ``time_rollout`` + ``time_weight_sync``, the actor rank waiting for generation and the weights'
hand-over), rollout idle time (``async/rollout_wait_s``; for sync ``time_step - time_rollout``), mean / max age,
IS-weight mean / min / max (TIS clamps them to [0.5, 5]), ``is_filter_ratio`` and ``vllm_kl``, the stream's
counts, and the reward curve (reward and exact-match accuracy per step; mean of the first and last quarter).
Then the ratios vs sync, and the reward comparison:
a config's last-quarter reward is "within noise" of sync's when the difference is under twice its standard error,
the larger of two estimates: from the per-step rewards of the last quarter (all seeds pooled) and from the
per-seed last-quarter means (between seeds; with 2 seeds or more), each sqrt(se_config^2 + se_sync^2).

The machine is shared: each run records the load average and the CPU share used by other processes while it
ran (/proc/stat busy time minus this bench's children's CPU time), so a slow spell can be told apart.  Seeds run
the configurations in alternating order.  Results: ``async_rl_cpu.json`` (``async_rl_smoke.json`` with --smoke)
in --out, else $OUT, else bench/results.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS  # noqa: E402

CONFIG_NAMES = ("sync", "async_k1", "async_k2", "async_k2_partial")
SFT_SPEC_VERSION = 1  # bump when the SFT recipe below changes (the cache is keyed on it)


def config_flags(name: str, rollout_batch_size: int, oversample: float) -> List[str]:
    return {"sync": [],
            "async_k1": ["--async_train"],
            "async_k2": ["--async_train", "--async_queue_size", "2"],
            "async_k2_partial": ["--async_train", "--async_queue_size", "2", "--partial_rollout",
                                 "--vllm_generate_batch_size", str(int(round(oversample * rollout_batch_size)))],
            }[name]


def _env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT",
                                                            "MASTER_ADDR")}
    return dict(env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def torchrun(module: str, args: List[str], log: str, timeout: int = 900) -> float:
    """Run ``module`` on 2 ranks; its output goes to ``log``.  Returns the wall seconds; raises with the log's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", module,
           "--no_progress_bar", *map(str, args)]
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
    if p.returncode != 0:
        tail = open(log).read()[-6000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{tail}")
    return time.perf_counter() - t0


# ---- the policy ------------------------------------------------------------------------------------------------------
def _stamped(path: str, spec: Dict) -> bool:
    stamp = os.path.join(path, "bench_spec.json")
    return os.path.isfile(stamp) and json.load(open(stamp)) == spec


def _stamp(path: str, spec: Dict) -> None:
    with open(os.path.join(path, "bench_spec.json"), "w") as fh:
        json.dump(spec, fh)


def skewed_sft_rows(src: str, dst: str, long_frac: float, long_min: int, long_max: int) -> int:
    """The kit's SFT rows; ``long_frac`` of them run on after the answer with ``long_min..long_max`` "." tokens."""
    rng = random.Random(0)
    n_long = 0
    with open(src) as fi, open(dst, "w") as fo:
        for line in fi:
            r = json.loads(line)
            out = str(r["label"])
            if rng.random() < long_frac:
                out += "." * rng.randint(long_min, long_max)
                n_long += 1
            fo.write(json.dumps(dict(r, output=out)) + "\n")
    return n_long


def build_policy(work: str, smoke: bool, long_frac: float, eos_scale: float, log) -> Dict:
    """The kit (random tiny model + task data) and the policy the runs start from (see the module docstring)."""
    from rlhf.models.tiny_kit import make_tiny

    kit = os.path.join(work, "kit")
    if not os.path.isfile(os.path.join(kit, "config.json")):
        make_tiny(kit)
    base = kit
    info = {"kit": kit}
    if not smoke:
        spec = {"version": SFT_SPEC_VERSION, "long_frac": long_frac, "long_tokens": [8, 160]}
        sft = os.path.join(work, "sft")
        if not _stamped(sft, spec):
            data = os.path.join(work, "sft_skewed.jsonl")
            n_long = skewed_sft_rows(os.path.join(kit, "data", "sft_train.jsonl"), data, long_frac, 8, 160)
            log(f"SFT on the skewed rows ({n_long} long outputs) -> {sft}")
            wall = torchrun("rlhf.train_sft", ["--config", os.path.join(ROOT, "configs", "sft_tiny.yaml"),
                                               "--pretrain", kit, "--dataset", data, "--save_path", sft,
                                               "--ckpt_path", os.path.join(work, "sft_ckpt"),
                                               "--log_dir", os.path.join(work, "logs", "sft")],
                            os.path.join(work, "sft.log"))
            log(f"  SFT done in {wall:.0f} s")
            _stamp(sft, spec)
        base = sft
        info["sft"] = dict(spec, path=sft)
    policy = os.path.join(work, f"policy_{'smoke' if smoke else 'sft'}_eos{eos_scale:g}")
    pspec = {"base": base, "eos_scale": eos_scale, "base_mtime": os.path.getmtime(os.path.join(base, "config.json"))}
    if not _stamped(policy, pspec):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base)
        with torch.no_grad():
            model.get_output_embeddings().weight[tok.eos_token_id] *= eos_scale
        model.save_pretrained(policy)
        tok.save_pretrained(policy)
        _stamp(policy, pspec)
    info.update(policy=policy, eos_scale=eos_scale,
                tied_head=bool(json.load(open(os.path.join(policy, "config.json"))).get("tie_word_embeddings")))
    return info


def length_distribution(policy: str, prompts_file: str, max_new: int, n_prompts: int = 128, n: int = 4) -> Dict:
    """Response lengths of the policy at temperature 1.0, sampled by the HF engine the runs use."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.data.arithmetic import extract_answer
    from rlhf.engines.hf_engine import HFEngine
    from rlhf.engines.rollout import SamplingParams

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(policy)
    rows = [json.loads(x) for x in open(prompts_file)][:n_prompts]
    ids = [tok(r["input"], add_special_tokens=False)["input_ids"] for r in rows]
    model = AutoModelForCausalLM.from_pretrained(policy)
    model.config.use_cache = True
    b = HFEngine(model, tok, micro_batch_size=64).generate(ids, SamplingParams(n=n, temperature=1.0,
                                                                                max_new_tokens=max_new, seed=0))
    lens = b.action_mask.sum(1).float()
    text = tok.batch_decode(b.sequences[:, b.prompt_len:], skip_special_tokens=True)
    acc = sum(extract_answer(t) == str(rows[i // n]["label"]) for i, t in enumerate(text)) / len(text)
    qs = (0.5, 0.75, 0.9, 0.95, 0.98, 0.99)
    pct = torch.quantile(lens, torch.tensor(qs)).tolist()
    return {"samples": int(lens.numel()), "temperature": 1.0, "max_new_tokens": max_new,
            "mean": float(lens.mean()), "max": float(lens.max()),
            "percentiles": {f"p{int(round(100 * q))}": round(float(v), 1) for q, v in zip(qs, pct)},
            "frac_over_16": float((lens > 16).float().mean()), "truncated_frac": float(b.truncated.float().mean()),
            "accuracy": acc}


# ---- measuring a run -------------------------------------------------------------------------------------------------
def _busy_jiffies() -> Optional[int]:
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
        return sum(f) - f[3] - f[4]  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        return None


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _mean(xs: List[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def quarter_means(curve: List[float]) -> Dict:
    k = max(1, len(curve) // 4)
    return {"first_quarter": _mean(curve[:k]), "last_quarter": _mean(curve[-k:]), "quarter_steps": k}


def summarize_run(rows: List[Dict], name: str, rows_per_step: int, skip: int) -> Dict:
    """One run's numbers from its train rows (the mean over ranks that computed each metric, as logged)."""
    timed = rows[skip:] if len(rows) > skip else rows
    col = lambda key, rs=timed: [r[key] for r in rs if key in r]  # noqa: E731
    t_sum = sum(col("time_step"))
    s_step = _mean(col("time_step"))
    resp_tokens = sum(r["response_len"] * rows_per_step for r in timed)
    out = {"steps": len(rows), "steps_timed": len(timed), "s_per_step": s_step, "steps_per_s": 1.0 / s_step,
           "trained_response_tokens_per_s": resp_tokens / t_sum, "tokens_per_s_logged": _mean(col("tokens_per_s")),
           "response_len": _mean(col("response_len", rows)), "truncated_frac": _mean(col("truncated_frac", rows)),
           "time_rollout": _mean(col("time_rollout")), "time_weight_sync": _mean(col("time_weight_sync")),
           "time_actor_update": _mean(col("time_actor_update"))}
    if name == "sync":
        out["trainer_wait_s"] = _mean([r["time_rollout"] + r.get("time_weight_sync", 0.0) for r in timed])
        out["rollout_wait_s"] = _mean([r["time_step"] - r["time_rollout"] for r in timed])
        out["generated_tokens_per_s"] = out["trained_response_tokens_per_s"]
    else:
        out["trainer_wait_s"] = _mean(col("async/trainer_wait_s"))
        out["rollout_wait_s"] = _mean(col("async/rollout_wait_s"))
        out["time_produce"] = _mean(col("time_produce"))
        out["generated_tokens_per_s"] = sum(col("async/generated_tokens")) / t_sum
        out.update({"age_mean": _mean(col("async/age_mean", rows)),
                    "age_max": max(col("async/age_max", rows), default=None),
                    "token_age_mean": _mean(col("async/token_age_mean", rows)),
                    "partial_frac": _mean(col("async/partial_frac", rows)),
                    "rounds_per_step": _mean(col("async/rounds", rows)),
                    "restarted_groups": sum(col("async/restarted_groups", rows)),
                    "dropped_stale_groups": sum(col("async/dropped_stale_groups", rows)),
                    "is_weight_mean": _mean(col("is_weight_mean", rows)),
                    "is_weight_min": min(col("is_weight_min", rows), default=None),
                    "is_weight_max": max(col("is_weight_max", rows), default=None),
                    "is_filter_ratio": _mean(col("is_filter_ratio", rows)),
                    "vllm_kl": _mean(col("vllm_kl", rows))})
    out["trainer_idle_frac"] = out["trainer_wait_s"] / s_step
    out["reward_curve"] = [round(r["reward"], 4) for r in rows]
    out["accuracy_curve"] = [round(r.get("reward_accuracy", float("nan")), 4) for r in rows]
    out["reward"] = quarter_means(out["reward_curve"])
    out["accuracy"] = quarter_means(out["accuracy_curve"])
    return out


def run_config(name: str, seed: int, a, policy: str, prompts: str, work: str, phase: str) -> Dict:
    """One run of the CLI.  ``phase`` "frozen": --actor_learning_rate 0 (the timings); "learning": --lr."""
    from rlhf.utils.logging import read_metrics

    frozen = phase == "frozen"
    steps, lr = (a.timing_steps, 0.0) if frozen else (a.steps, a.lr)
    d = os.path.join(work, "runs", f"{phase}_{name}_seed{seed}")
    os.makedirs(d, exist_ok=True)
    metrics = os.path.join(d, "logs", "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    args = ["--pretrain", policy, "--prompt_data", prompts, "--eval_split", "0", "--remote_rm_url",
            "builtin:arithmetic", "--rollout_batch_size", a.rollout_batch_size, "--n_samples_per_prompt", a.n,
            "--train_batch_size", a.rollout_batch_size * a.n, "--micro_train_batch_size", a.micro_train_batch_size,
            "--micro_rollout_batch_size", a.micro_rollout_batch_size, "--generate_max_len", a.generate_max_len,
            "--temperature", "1.0", "--max_global_steps", steps, "--seed", seed,
            "--actor_learning_rate", lr, "--lr_scheduler", "constant", "--use_kl_loss", "--kl_estimator", "k3",
            "--init_kl_coef", a.kl, "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1",
            "--log_dir", os.path.join(d, "logs"), "--save_path", os.path.join(d, "model"),
            *config_flags(name, a.rollout_batch_size, a.oversample)]
    load0, busy0, cpu0 = os.getloadavg(), _busy_jiffies(), _children_cpu()
    wall = torchrun("rlhf.train_grpo", args, os.path.join(d, "run.log"))
    busy1, cpu1, load1 = _busy_jiffies(), _children_cpu(), os.getloadavg()
    rows = [r for r in read_metrics(metrics) if r["split"] == "train"]
    out = summarize_run(rows, name, a.rollout_batch_size * a.n, a.skip)
    others = None
    if busy0 is not None and busy1 is not None:
        hz = os.sysconf("SC_CLK_TCK")
        others = max(0.0, ((busy1 - busy0) / hz - (cpu1 - cpu0)) / (wall * (os.cpu_count() or 1)))
    out.update(phase=phase, seed=seed, wall_s=wall, loadavg_before=load0[0], loadavg_after=load1[0],
               other_processes_cpu_frac=others, flags=config_flags(name, a.rollout_batch_size, a.oversample))
    return out


# ---- over seeds ------------------------------------------------------------------------------------------------------
TIMINGS = ("s_per_step", "trained_response_tokens_per_s", "generated_tokens_per_s", "trainer_wait_s",
           "trainer_idle_frac", "rollout_wait_s", "time_rollout", "time_produce", "time_weight_sync",
           "time_actor_update", "response_len", "truncated_frac", "wall_s", "other_processes_cpu_frac")
SCALARS = TIMINGS + ("age_mean", "token_age_mean", "partial_frac", "rounds_per_step", "is_weight_mean",
                      "is_filter_ratio", "vllm_kl")


def aggregate(runs: List[Dict], keys=SCALARS, curves: bool = True) -> Dict:
    """The mean over seeds of each number (the per-seed values alongside); steps/s = 1 / the mean s/step."""
    out: Dict = {"seeds": [r["seed"] for r in runs], "steps": runs[0]["steps"]}
    for k in keys:
        vals = [r.get(k) for r in runs]
        if any(v is not None for v in vals):
            out[k] = _mean(vals)
            out[k + "_per_seed"] = vals
    out["steps_per_s"] = 1.0 / out["s_per_step"]
    if not curves:
        return out
    for k, f in (("age_max", max), ("is_weight_min", min), ("is_weight_max", max), ("restarted_groups", sum),
                 ("dropped_stale_groups", sum)):
        vals = [r[k] for r in runs if r.get(k) is not None]
        if vals:
            out[k] = f(vals)
    for curve in ("reward_curve", "accuracy_curve"):
        n = min(len(r[curve]) for r in runs)
        out[curve] = [round(statistics.fmean(r[curve][i] for r in runs), 4) for i in range(n)]
    for what in ("reward", "accuracy"):
        q = [r[what] for r in runs]
        lq = [x["last_quarter"] for x in q]
        out[what] = {"first_quarter": _mean([x["first_quarter"] for x in q]), "last_quarter": _mean(lq),
                     "last_quarter_per_seed": lq, "seed_spread_last_quarter": max(lq) - min(lq) if len(q) > 1 else None}
    return out


def _last_quarter_values(runs: List[Dict]) -> List[float]:
    vals = []
    for r in runs:
        vals += r["reward_curve"][-r["reward"]["quarter_steps"]:]
    return vals


def _se(xs: List[float]) -> float:
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("inf")


def compare(configs: Dict[str, Dict], runs: Dict[str, List[Dict]]) -> Dict:
    """Throughput ratios vs sync (from ``throughput``) and the reward comparison (see the module docstring)."""
    if "sync" not in configs:
        return {}
    s = configs["sync"]["throughput"]
    ratios, rewards = {}, {}
    sync_lq = _last_quarter_values(runs["sync"])
    for name, c in configs.items():
        t = c["throughput"]
        ratios[name] = {"steps_per_s": t["steps_per_s"] / s["steps_per_s"],
                        "trained_response_tokens_per_s": t["trained_response_tokens_per_s"]
                        / s["trained_response_tokens_per_s"],
                        "generated_tokens_per_s": t["generated_tokens_per_s"] / s["generated_tokens_per_s"],
                        "trainer_wait_s": t["trainer_wait_s"] / s["trainer_wait_s"] if s["trainer_wait_s"] else None}
        lq = _last_quarter_values(runs[name])
        delta = c["reward"]["last_quarter"] - configs["sync"]["reward"]["last_quarter"]
        se_steps = (_se(lq) ** 2 + _se(sync_lq) ** 2) ** 0.5
        se_seeds = (_se(c["reward"]["last_quarter_per_seed"]) ** 2
                    + _se(configs["sync"]["reward"]["last_quarter_per_seed"]) ** 2) ** 0.5
        noise = 2 * (se_steps if len(runs[name]) < 2 else max(se_steps, se_seeds))
        rewards[name] = {"last_quarter": c["reward"]["last_quarter"], "delta_vs_sync": delta, "noise_2se": noise,
                         "se_steps": se_steps, "se_seeds": se_seeds if len(runs[name]) > 1 else None,
                         "within_noise": bool(abs(delta) <= noise),
                         "gain_first_to_last": c["reward"]["last_quarter"] - c["reward"]["first_quarter"],
                         "seed_spread_last_quarter": c["reward"]["seed_spread_last_quarter"]}
    return {"ratios_vs_sync": ratios, "reward_vs_sync": rewards}


def table(configs: Dict[str, Dict], cmp: Dict, source: str) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [f"throughput ({source} runs)                                                              | learning runs",
             f"{'config':17} {'s/step':>6} {'steps/s':>7} {'x sync':>6} {'gen tok/s':>9} {'trainer idle':>12} "
             f"{'rollout idle':>12} {'resp len':>8} | {'s/step':>6} {'age':>7} {'IS w min/max':>12} {'resp len':>8} "
             f"{'reward q1->q4':>13} {'vs sync':>20}"]
    for name, c in configs.items():
        t = c["throughput"]
        r = cmp.get("ratios_vs_sync", {}).get(name, {})
        rw = cmp.get("reward_vs_sync", {}).get(name, {})
        age = "-" if c.get("age_mean") is None else f"{c['age_mean']:.1f}/{c['age_max']:.0f}"
        isw = "-" if c.get("is_weight_min") is None else f"{c['is_weight_min']:.2f}/{c['is_weight_max']:.2f}"
        vs = "-" if not rw else (f"{rw['delta_vs_sync']:+.3f} {'ok' if rw['within_noise'] else 'OUT'} "
                                 f"2se {rw['noise_2se']:.3f}")
        idle = f"{t['trainer_wait_s']:.3f} {100 * t['trainer_idle_frac']:3.0f}%"
        lines.append(f"{name:17} {t['s_per_step']:6.3f} {t['steps_per_s']:7.2f} {f(r.get('steps_per_s'), '5.2f'):>5}x "
                     f"{t['generated_tokens_per_s']:9.0f} {idle:>12} {f(t.get('rollout_wait_s'), '12.3f'):>12} "
                     f"{t['response_len']:8.1f} | {c['s_per_step']:6.3f} {age:>7} {isw:>12} {c['response_len']:8.1f} "
                     f"{c['reward']['first_quarter']:5.3f}->{c['reward']['last_quarter']:.3f} {vs:>20}")
    lines.append("idle: seconds per step (share of the step); age mean/max in steps; reward: mean over seeds of the "
                 "first / last quarter; vs sync: last-quarter difference, ok = within twice its standard error")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny: the random kit, a few steps, short lengths")
    p.add_argument("--out", default=None, help="results folder (default: $OUT, else bench/results)")
    p.add_argument("--work", default=None, help="cache and run folder (default: $OUT/async_rl_work, else "
                                                "/tmp/rlhf_bench_async_rl)")
    p.add_argument("--configs", nargs="+", choices=CONFIG_NAMES, default=None)
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds of the learning runs")
    p.add_argument("--steps", type=int, default=None, help="steps of the learning runs")
    p.add_argument("--timing_seeds", nargs="*", type=int, default=None,
                   help="seeds of the frozen (--actor_learning_rate 0) timing runs; none: time the learning runs")
    p.add_argument("--timing_steps", type=int, default=None)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the timings")
    p.add_argument("--rollout_batch_size", type=int, default=None)
    p.add_argument("--n", type=int, default=None, help="--n_samples_per_prompt")
    p.add_argument("--micro_train_batch_size", type=int, default=None)
    p.add_argument("--micro_rollout_batch_size", type=int, default=16)
    p.add_argument("--generate_max_len", type=int, default=None)
    p.add_argument("--oversample", type=float, default=2.0, help="--vllm_generate_batch_size / --rollout_batch_size "
                                                                  "of async_k2_partial")
    p.add_argument("--lr", type=float, default=5e-4, help="--actor_learning_rate of the learning runs")
    p.add_argument("--kl", type=float, default=0.02, help="--init_kl_coef (k3 KL loss)")
    p.add_argument("--long_frac", type=float, default=0.10)
    p.add_argument("--eos_scale", type=float, default=None)
    a = p.parse_args(argv)
    full = dict(configs=list(CONFIG_NAMES), seeds=[1, 2, 3], steps=30, timing_seeds=[1, 2], timing_steps=20,
                rollout_batch_size=16, n=4, micro_train_batch_size=32, generate_max_len=128, eos_scale=0.85)
    smoke = dict(configs=["sync", "async_k2_partial"], seeds=[1], steps=4, timing_seeds=[], timing_steps=4,
                 rollout_batch_size=4, n=2, micro_train_batch_size=8, generate_max_len=12, eos_scale=1.0)
    for k, v in (smoke if a.smoke else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    env_out = os.environ.get("OUT")
    out_dir = a.out or env_out or RESULTS
    work = a.work or (os.path.join(env_out, "async_rl_work") if env_out else "/tmp/rlhf_bench_async_rl")
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(work, exist_ok=True)

    def log(m):
        print(m, flush=True)

    t0 = time.perf_counter()
    load_start = os.getloadavg()
    pol = build_policy(work, a.smoke, a.long_frac, a.eos_scale, log)
    prompts = os.path.join(pol["kit"], "data", "prompts_train.jsonl")
    lengths = length_distribution(pol["policy"], prompts, a.generate_max_len)
    log(f"lengths at temperature 1.0 ({lengths['samples']} samples): mean {lengths['mean']:.1f} "
        + " ".join(f"{k} {v:g}" for k, v in lengths["percentiles"].items())
        + f", {100 * lengths['truncated_frac']:.1f}% truncated, accuracy {lengths['accuracy']:.3f}")
    runs: Dict[str, List[Dict]] = {c: [] for c in a.configs}
    frozen: Dict[str, List[Dict]] = {c: [] for c in a.configs}
    plan = [("frozen", s) for s in a.timing_seeds] + [("learning", s) for s in a.seeds]
    for i, (phase, seed) in enumerate(plan):
        for name in (a.configs if i % 2 == 0 else list(reversed(a.configs))):
            r = run_config(name, seed, a, pol["policy"], prompts, work, phase)
            (frozen if phase == "frozen" else runs)[name].append(r)
            others = r["other_processes_cpu_frac"]
            log(f"  {phase:8} {name:17} seed {seed}: {r['s_per_step']:.3f} s/step, trainer idle "
                f"{r['trainer_wait_s']:.3f} s, reward {r['reward']['first_quarter']:.3f} -> "
                f"{r['reward']['last_quarter']:.3f}, resp len {r['response_len']:.1f} ({r['wall_s']:.0f} s; load "
                f"{r['loadavg_before']:.1f}, others {'-' if others is None else format(100 * others, '.0f')}% CPU)")
    source = "frozen (--actor_learning_rate 0)" if a.timing_seeds else "learning"
    configs = {}
    for c in a.configs:
        configs[c] = aggregate(runs[c])
        configs[c]["throughput"] = dict(aggregate(frozen[c] or runs[c], TIMINGS, curves=False), source=source)
    cmp = compare(configs, runs)
    others = [r["other_processes_cpu_frac"] for rs in (*runs.values(), *frozen.values()) for r in rs
              if r["other_processes_cpu_frac"] is not None]
    settings = {k: getattr(a, k) for k in ("smoke", "configs", "seeds", "steps", "timing_seeds", "timing_steps",
                                           "skip", "rollout_batch_size", "n", "micro_train_batch_size",
                                           "micro_rollout_batch_size", "generate_max_len", "oversample", "lr", "kl",
                                           "long_frac", "eos_scale")}
    settings.update(ranks=2, placement="actor on rank 0, HF rollout engine on rank 1 (--actor_num_gpus_per_node 1 "
                                       "--vllm_num_engines 1)", temperature=1.0, reward="builtin:arithmetic",
                    partial_rollout_chunk=max(1, a.generate_max_len // 4),
                    train_batch_size=a.rollout_batch_size * a.n, policy=pol)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    res = {"settings": settings, "commit": commit, "length_distribution": lengths, "configs": configs, **cmp,
           "runs": runs, "frozen_runs": frozen,
           "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                       "other_processes_cpu_frac_mean": _mean(others), "other_processes_cpu_frac_max":
                       max(others) if others else None, "bench_wall_s": time.perf_counter() - t0}}
    path = os.path.join(out_dir, "async_rl_smoke.json" if a.smoke else "async_rl_cpu.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    log(table(configs, cmp, source))
    m = res["machine"]
    log(f"other processes used {100 * (m['other_processes_cpu_frac_mean'] or 0):.0f}% of the CPUs on average "
        f"(max {100 * (m['other_processes_cpu_frac_max'] or 0):.0f}%), load {m['loadavg_start'][0]:.1f} -> "
        f"{m['loadavg_end'][0]:.1f}; bench {m['bench_wall_s']:.0f} s; results: {path}")
    return res


if __name__ == "__main__":
    main()
