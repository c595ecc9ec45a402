"""Shared pieces of the side-by-side benchmarks: interleaved timing, peak memory, the table.

How a comparison runs (robust on a shared, noisy machine):
- each side (TRL, rlhf) runs in a process of its own, started once; both stay alive for the whole run;
- a side runs ``warmup`` steps (not timed), then pauses (``Gate``) and waits for the parent's "go";
- the parent lets the sides run alternately, ``block`` steps at a time, for ``rounds`` rounds in the order
  A B | B A | A B ...; a block is a few seconds, so a slow spell of the machine hits both sides of a round;
- each round gives one paired speed-up (TRL block s/step / rlhf block s/step), in wall time and in process CPU
  time (user + sys); the result is the median over rounds with its spread (half the inter-quartile range,
  relative to the median).  A speed-up whose spread is over ``MAX_SPREAD`` is flagged UNSTABLE and must not be
  quoted as a result.  With one thread per side (the default here) CPU time is the work done and wall time adds
  the waits for a core that other tenants hold: on a shared machine the CPU-time ratio is the reproducible one;
- each side reports its peak RSS (the process's high-water mark, imports and model loading included).
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
MAX_SPREAD = 0.10  # half the inter-quartile range of the per-round speed-ups, relative to their median


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def set_threads() -> int:
    import torch

    n = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(n)
    return n


class Gate:
    """The side process's end of the protocol: call ``step(tokens)`` once at the end of every training step.

    After ``warmup`` steps, and after every ``block`` steps from then on, it prints one ``WAIT {json}`` line
    (the block's wall time from "go" to the end of its last step, its steps and tokens, the peak RSS) and
    blocks until the parent writes a line: "go" runs the next block, "stop" (or EOF) exits the process.
    """

    def __init__(self, warmup: int, block: int, rounds: int):
        self.warmup, self.block = warmup, block
        self.total = warmup + rounds * block  # the steps the side's trainer must be told to run
        self.n, self.last, self.tokens, self.t0, self.c0 = 0, 0, 0.0, time.perf_counter(), time.process_time()

    def step(self, tokens: float) -> None:
        self.n += 1
        self.tokens += tokens
        if self.n == self.warmup or (self.n > self.warmup and (self.n - self.warmup) % self.block == 0):
            self._wait()

    def _wait(self) -> None:
        msg = {"steps": self.n - self.last, "wall_s": time.perf_counter() - self.t0,
               "cpu_s": time.process_time() - self.c0, "tokens": self.tokens,
               "peak_rss_mb": peak_rss_mb()}
        print("WAIT " + json.dumps(msg), flush=True)
        line = sys.stdin.readline().strip()
        if line != "go":
            sys.stdout.flush()
            os._exit(0)
        self.last, self.tokens, self.t0, self.c0 = self.n, 0.0, time.perf_counter(), time.process_time()


def gate_rlhf_logger(gate: Gate, tokens) -> None:
    """Call ``gate.step(tokens(metrics))`` after each train-metrics row our trainers log (rlhf.utils.logging)."""
    from rlhf.utils.logging import MetricsLogger

    plain = MetricsLogger.log

    def log_and_gate(self, step, metrics, prefix="train"):
        plain(self, step, metrics, prefix)
        if prefix == "train":
            gate.step(tokens(metrics))

    MetricsLogger.log = log_and_gate


class Side:
    """The parent's handle on one side's process."""

    def __init__(self, script: str, which: str, args: List[str]):
        self.which = which
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1",
                   WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, script, "--side", which, *args], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)

    def wait_block(self) -> Dict:
        for line in self.proc.stdout:
            if line.startswith("WAIT "):
                return json.loads(line[len("WAIT "):])
        self.proc.wait()
        self.err.seek(0)
        raise RuntimeError(f"{self.which} side exited with {self.proc.returncode} before its next block:\n"
                           + self.err.read()[-6000:])

    def go(self) -> Dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.wait_block()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def run_interleaved(script: str, args: List[str], rounds: int, log=None) -> Tuple[Dict[str, Dict], List[float]]:
    """Both sides' per-block results and the per-round paired speed-ups (TRL s/step over rlhf s/step).

    The sides start one after the other (start-up and warm-up never overlap), then alternate blocks.
    """
    log = log or (lambda m: print(m, flush=True))
    sides: Dict[str, Side] = {}
    blocks: Dict[str, List[Dict]] = {"trl": [], "rlhf": []}
    warm: Dict[str, Dict] = {}
    try:
        for which in ("trl", "rlhf"):
            sides[which] = Side(script, which, args)
            warm[which] = sides[which].wait_block()
            log(f"  {which}: started, warm-up done ({warm[which]['steps']} steps, {warm[which]['wall_s']:.1f} s)")
        for r in range(rounds):
            order = ("trl", "rlhf") if r % 2 == 0 else ("rlhf", "trl")
            for which in order:
                blocks[which].append(sides[which].go())
            t, o = (blocks[w][-1] for w in ("trl", "rlhf"))
            log(f"  round {r + 1}/{rounds}: trl {t['wall_s'] / t['steps']:.3f} s/step, "
                f"rlhf {o['wall_s'] / o['steps']:.3f} s/step")
    finally:
        for s in sides.values():
            s.stop()
    rows = {w: side_summary(blocks[w], warm[w]) for w in blocks}
    ratios = [t / o for t, o in zip(rows["trl"]["blocks_s_per_step"], rows["rlhf"]["blocks_s_per_step"])]
    return rows, ratios


def side_summary(blocks: List[Dict], warm: Dict) -> Dict:
    steps = [b["steps"] for b in blocks]
    per = [b["wall_s"] / s for b, s in zip(blocks, steps)]
    cpu = [b["cpu_s"] / s for b, s in zip(blocks, steps)]
    wall = sum(b["wall_s"] for b in blocks)
    return {"s_per_step": statistics.median(per), "tokens_per_s": sum(b["tokens"] for b in blocks) / wall,
            "cpu_s_per_step": statistics.median(cpu), "steps_timed": sum(steps), "blocks_s_per_step": per,
            "blocks_cpu_s_per_step": cpu,
            "peak_rss_mb": max([warm["peak_rss_mb"]] + [b["peak_rss_mb"] for b in blocks])}


def spread(xs: List[float]) -> Optional[float]:
    """Half the inter-quartile range relative to the median (None below 2 values)."""
    if len(xs) < 2:
        return None
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return (q3 - q1) / 2 / statistics.median(xs)


def verdict(ratios: List[float]) -> Dict:
    sp = spread(ratios)
    return {"speedup": statistics.median(ratios), "spread": sp, "min": min(ratios), "max": max(ratios),
            "stable": sp is not None and sp <= MAX_SPREAD}


def cpu_ratios(rows: Dict[str, Dict]) -> List[float]:
    """Per-round speed-ups in process CPU time (user + sys): less sensitive than wall time to other tenants."""
    return [t / o for t, o in zip(rows["trl"]["blocks_cpu_s_per_step"], rows["rlhf"]["blocks_cpu_s_per_step"])]


def table(name: str, rows: Dict[str, Dict], settings: Dict, ratios: List[float]) -> str:
    ours, peer = rows["rlhf"], rows["trl"]
    v, vc = verdict(ratios), verdict(cpu_ratios(rows))
    lines = [f"{name}  ({', '.join(f'{k}={x}' for k, x in settings.items())})",
             f"{'':8} {'s/step':>10} {'cpu s/step':>11} {'tokens/s':>10} {'peak RSS MB':>12}"]
    for side, r in (("trl", peer), ("rlhf", ours)):
        lines.append(f"{side:8} {r['s_per_step']:>10.4f} {r['cpu_s_per_step']:>11.4f} {r['tokens_per_s']:>10.1f} "
                     f"{r['peak_rss_mb']:>12.0f}")
    tok_ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    lines += [f"{'ratio':8} {v['speedup']:>9.2f}x {vc['speedup']:>10.2f}x {tok_ratio:>9.2f}x "
              f"{ours['peak_rss_mb'] / peer['peak_rss_mb']:>11.2f}x   (speed-ups: medians of the per-round paired "
              "ratios, trl / rlhf; memory: rlhf / trl)",
              f"{'rounds':8} {len(ratios):>10d}   wall speed-up per round: " + " ".join(f"{x:.2f}x" for x in ratios)]
    lines.append(f"{'':8} {'':>10} {'':>11}   CPU speed-up per round: "
                 + " ".join(f"{x:.2f}x" for x in cpu_ratios(rows)))
    for what, x in (("wall", v), ("CPU", vc)):
        if x["stable"]:
            lines.append(f"{what} spread +-{100 * x['spread']:.1f}% (half IQR / median, "
                         f"limit {100 * MAX_SPREAD:.0f}%): stable")
        else:
            sp = "n/a" if x["spread"] is None else f"+-{100 * x['spread']:.1f}%"
            lines.append(f"UNSTABLE {what}: spread {sp} over the limit {100 * MAX_SPREAD:.0f}% (or too few rounds): "
                         f"the machine was too noisy for the {what} speed-up to be a result; rerun with more --rounds")
    return "\n".join(lines)


def save(name: str, rows: Dict, settings: Dict, ratios: List[float]) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    load = os.getloadavg()
    with open(path, "w") as fh:
        json.dump({"settings": settings, "results": rows, "speedup_per_round": ratios, **verdict(ratios),
                   "cpu_speedup": verdict(cpu_ratios(rows)), "loadavg_at_end": load}, fh, indent=2)
    return path
