"""Shared pieces of the side-by-side benchmarks: the kit, the task, timing, the table."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def kit(path: str, arch: str = "qwen2", layers: int = 2, hidden: int = 64) -> str:
    from rlhf.tools.make_tiny import make_tiny

    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny(path, arch=arch, layers=layers, hidden=hidden)
    return path


def run_side(script: str, which: str, args: List[str]) -> Dict:
    """Run one side in a fresh process (same threads, same machine) and read its JSON result."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), HF_HUB_OFFLINE="1",
               WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, script, "--side", which, *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{which} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def run_rounds(script: str, args: List[str], rounds: int) -> Tuple[Dict[str, Dict], List[float]]:
    """Run both sides ``rounds`` times, alternating which goes first, so that a slow spell of a shared
    machine hits both.  Returns each side's medians over rounds and the per-round (paired) speed-ups."""
    per: Dict[str, List[Dict]] = {"trl": [], "rlhf": []}
    for r in range(rounds):
        for side in (("trl", "rlhf") if r % 2 == 0 else ("rlhf", "trl")):
            per[side].append(run_side(script, side, args))
    out = {}
    for side, res in per.items():
        out[side] = {"s_per_step": statistics.median(x["s_per_step"] for x in res),
                     "tokens_per_s": statistics.median(x["tokens_per_s"] for x in res),
                     "steps_timed": sum(x["steps_timed"] for x in res),
                     "rounds_s_per_step": [x["s_per_step"] for x in res]}
    return out, [t["s_per_step"] / o["s_per_step"] for t, o in zip(per["trl"], per["rlhf"])]


def summarize(step_times: List[float], tokens: List[float], warmup: int) -> Dict:
    st, tk = step_times[warmup:], tokens[warmup:]
    return {"s_per_step": statistics.median(st), "tokens_per_s": sum(tk) / sum(st), "steps_timed": len(st)}


def table(name: str, rows: Dict[str, Dict], settings: Dict, ratios: List[float]) -> str:
    ours, peer = rows["rlhf"], rows["trl"]
    lines = [f"{name}  ({', '.join(f'{k}={v}' for k, v in settings.items())})",
             f"{'':8} {'s/step':>10} {'tokens/s':>12}",
             f"{'trl':8} {peer['s_per_step']:>10.4f} {peer['tokens_per_s']:>12.1f}",
             f"{'rlhf':8} {ours['s_per_step']:>10.4f} {ours['tokens_per_s']:>12.1f}",
             f"{'ratio':8} {peer['s_per_step'] / ours['s_per_step']:>9.2f}x {ours['tokens_per_s'] / peer['tokens_per_s']:>11.2f}x"
             "   (rlhf speed-up over trl)"]
    lines.append(f"{'rounds':8} {len(ratios):>10d}   paired speed-up per round: "
                 + " ".join(f"{x:.2f}x" for x in ratios))
    return "\n".join(lines)


def save(name: str, rows: Dict, settings: Dict, ratios: List[float]) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    ratio = rows["trl"]["s_per_step"] / rows["rlhf"]["s_per_step"]
    with open(path, "w") as fh:
        json.dump({"settings": settings, "results": rows, "speedup_s_per_step": ratio, "speedup_per_round": ratios},
                  fh, indent=2)
    return path
