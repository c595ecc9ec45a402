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
- each side reports its peak RSS (the process's high-water mark, imports and model loading included);
- each side reports the precision and activation checkpointing it actually trains with (``Gate.info``: TRL's
  resolved ``accelerator.mixed_precision`` and ``args.gradient_checkpointing``, our parsed config); the parent
  refuses to time sides that differ from what was asked for (``check_like_with_like``).  TRL 1.16's
  GRPOConfig/DPOConfig turn gradient checkpointing on by default and set
  ``bf16 = not fp16`` when bf16 is left unset (trl/trainer/base_config.py ``_BaseConfig.__post_init__``) and
  transformers' TrainingArguments then sets ``mixed_precision = "bf16"`` (training_args.py, "Mixed Precision"),
  so left alone TRL runs bf16 autocast while our default is fp32: on a CPU that only emulates bf16 that alone made
  TRL's GRPO step ~6x slower.  Both sides are therefore told the same ``--precision`` (default fp32) and
  ``--gradient_checkpointing`` (default off).
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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
MAX_SPREAD = 0.10  # half the inter-quartile range of the per-round speed-ups, relative to their median
PRECISIONS = ("fp32", "bf16")  # --precision: fp32 everywhere, or bf16 mixed precision (fp32 master weights)


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
        self.info: Dict = {}  # what the side reports about itself with every block (e.g. "precision")

    def step(self, tokens: float) -> None:
        self.n += 1
        self.tokens += tokens
        if self.n == self.warmup or (self.n > self.warmup and (self.n - self.warmup) % self.block == 0):
            self._wait()

    def _wait(self) -> None:
        msg = {"steps": self.n - self.last, "wall_s": time.perf_counter() - self.t0,
               "cpu_s": time.process_time() - self.c0, "tokens": self.tokens,
               "peak_rss_mb": peak_rss_mb(), **self.info}
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


def need_trl(ours_only: bool) -> None:
    """A comparison needs TRL in this environment: say how to get it, or how to run without it."""
    import importlib.util

    if not ours_only and importlib.util.find_spec("trl") is None:
        raise SystemExit("TRL is not installed: pip install -e \".[bench]\" (TRL 1.16), or pass --ours_only to "
                         "time our side alone")


def trl_args(precision: str, gradient_checkpointing: bool) -> Dict:
    """The TRL config fields that pin what TRL would otherwise choose itself: ``bf16`` (TRL: ``not fp16`` when
    unset), ``fp16`` and ``gradient_checkpointing`` (TRL's default True, transformers' False)."""
    return dict(bf16=precision == "bf16", fp16=False, gradient_checkpointing=gradient_checkpointing)


def trl_resolved(trainer) -> Dict:
    """What a built TRL trainer runs with: accelerate's mixed-precision mode ("no" is fp32) and checkpointing."""
    mp = trainer.accelerator.mixed_precision
    return {"precision": {"no": "fp32"}.get(mp, mp), "gradient_checkpointing": bool(trainer.args.gradient_checkpointing)}


def rlhf_flags(precision: str, gradient_checkpointing: bool) -> List[str]:
    """Our trainers' flags for the same settings (--bf16: bf16 compute over fp32 master weights)."""
    return (["--bf16"] if precision == "bf16" else []) + (["--gradient_checkpointing"] if gradient_checkpointing
                                                          else [])


def rlhf_resolved(cfg) -> Dict:
    """What our parsed config runs with."""
    return {"precision": "bf16" if cfg.model.bf16 else "fp32",
            "gradient_checkpointing": bool(cfg.model.gradient_checkpointing)}


class Side:
    """The parent's handle on one side's process."""

    def __init__(self, script: str, which: str, args: List[str], root: str = ROOT, name: Optional[str] = None):
        """``root``: the checkout whose ``rlhf`` the side imports (bench/compare_revisions.py runs two);
        ``name``: how the parent calls it (default ``which``)."""
        self.which = name or which
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1",
                   WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONPATH=root)
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, script, "--side", which, *args], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)

    def wait_block(self) -> Dict:
        for line in self.proc.stdout:
            if line.startswith("WAIT "):
                return json.loads(line[len("WAIT "):])
        self.proc.wait()
        self.err.seek(0)
        hint = " (its trainer ran out of data: fewer --rounds or a smaller --block)" if self.proc.returncode == 0 else ""
        raise RuntimeError(f"{self.which} side exited with {self.proc.returncode} before its next block{hint}:\n"
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


def alternate(starts: Dict[str, Callable[[], Side]], rounds: int, log=None,
              check: Optional[Callable[[Dict], None]] = None) -> Tuple[Dict[str, List[Dict]], Dict]:
    """Start each side in turn (start-up and warm-up never overlap), then run ``rounds`` rounds of one block per
    side, in the order of ``starts`` on even rounds and reversed on odd ones (A B | B A | A B ...).
    ``check(warm)`` runs on the warm-up reports before the first timed block (it raises to refuse the run).
    Returns each side's timed blocks and its warm-up report."""
    log = log or (lambda m: print(m, flush=True))
    names = list(starts)
    sides: Dict[str, Side] = {}
    blocks: Dict[str, List[Dict]] = {w: [] for w in names}
    warm: Dict[str, Dict] = {}
    try:
        for which in names:
            sides[which] = starts[which]()
            warm[which] = sides[which].wait_block()
            log(f"  {which}: started, warm-up done ({warm[which]['steps']} steps, {warm[which]['wall_s']:.1f} s)")
        if check is not None:
            check(warm)
        for r in range(rounds):
            for which in (names if r % 2 == 0 else names[::-1]):
                blocks[which].append(sides[which].go())
            log(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{w} {blocks[w][-1]['wall_s'] / blocks[w][-1]['steps']:.3f} s/step "
                f"({blocks[w][-1]['cpu_s'] / blocks[w][-1]['steps']:.3f} CPU-s)" for w in names))
    finally:
        for s in sides.values():
            s.stop()
    return blocks, warm


def check_like_with_like(requested: Dict, warm: Dict[str, Dict]) -> None:
    """Refuse a comparison where a side resolved a setting other than ``requested`` (e.g. ``{"precision":
    "fp32", "gradient_checkpointing": False}``): each side's warm-up report carries what it actually runs with,
    read back from its own config after construction; a side that reports nothing is refused too."""
    wrong = {w: {k: r.get(k) for k in requested if r.get(k) != requested[k]} for w, r in warm.items()}
    wrong = {w: d for w, d in wrong.items() if d}
    if wrong:
        asked = ", ".join(f"{k}={v}" for k, v in requested.items())
        raise RuntimeError(f"asked for {asked} but the sides resolved {wrong}: the comparison would not be like "
                           "with like (ACCELERATE_MIXED_PRECISION set? a TRL default changed?); pass --precision "
                           f"{'|'.join(PRECISIONS)} and nothing that overrides it")


def run_interleaved(script: str, args: List[str], rounds: int, log=None, which: Sequence[str] = ("trl", "rlhf"),
                    same: Optional[Dict] = None) -> Tuple[Dict[str, Dict], List[float]]:
    """The sides' summaries and the per-round paired speed-ups (TRL s/step over rlhf s/step; empty when only
    one side runs, e.g. ``--ours_only``).  ``same``: the settings every side must report (``check_like_with_like``),
    checked after the warm-up, before any timed block."""
    starts = {w: (lambda w=w: Side(script, w, args)) for w in which}
    blocks, warm = alternate(starts, rounds, log, check=lambda warm: check_like_with_like(same or {}, warm))
    rows = {w: side_summary(blocks[w], warm[w]) for w in blocks}
    if not {"trl", "rlhf"} <= set(rows):
        return rows, []
    ratios = [t / o for t, o in zip(rows["trl"]["blocks_s_per_step"], rows["rlhf"]["blocks_s_per_step"])]
    return rows, ratios


def side_summary(blocks: List[Dict], warm: Dict) -> Dict:
    steps = [b["steps"] for b in blocks]
    per = [b["wall_s"] / s for b, s in zip(blocks, steps)]
    cpu = [b["cpu_s"] / s for b, s in zip(blocks, steps)]
    wall = sum(b["wall_s"] for b in blocks)
    return {"s_per_step": statistics.median(per), "tokens_per_s": sum(b["tokens"] for b in blocks) / wall,
            "cpu_s_per_step": statistics.median(cpu), "steps_timed": sum(steps), "blocks_s_per_step": per,
            "blocks_cpu_s_per_step": cpu, "precision": warm.get("precision"),
            "gradient_checkpointing": warm.get("gradient_checkpointing"),
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


def table_ours(name: str, row: Dict, settings: Dict) -> str:
    """``--ours_only``: our side's medians and its spread over the blocks (no peer, no speed-up)."""
    sp = spread(row["blocks_cpu_s_per_step"])
    return "\n".join([f"{name}, rlhf only  ({', '.join(f'{k}={x}' for k, x in settings.items())})",
                      f"{'':8} {'s/step':>10} {'cpu s/step':>11} {'tokens/s':>10} {'peak RSS MB':>12}",
                      f"{'rlhf':8} {row['s_per_step']:>10.4f} {row['cpu_s_per_step']:>11.4f} "
                      f"{row['tokens_per_s']:>10.1f} {row['peak_rss_mb']:>12.0f}",
                      f"{'blocks':8} {len(row['blocks_cpu_s_per_step']):>10d}   CPU-s per step per block: "
                      + " ".join(f"{x:.3f}" for x in row["blocks_cpu_s_per_step"])
                      + ("" if sp is None else f"   spread +-{100 * sp:.1f}%")])


def table(name: str, rows: Dict[str, Dict], settings: Dict, ratios: List[float]) -> str:
    if "trl" not in rows:
        return table_ours(name, rows["rlhf"], settings)
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
    both = {"speedup_per_round": ratios, **verdict(ratios), "cpu_speedup": verdict(cpu_ratios(rows))} if ratios else {}
    with open(path, "w") as fh:
        json.dump({"settings": settings, "results": rows, **both, "loadavg_at_end": load}, fh, indent=2)
    return path
