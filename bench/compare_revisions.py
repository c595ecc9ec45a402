"""Old vs new: our side of a bench, from two checkouts, interleaved in one run.

    git worktree add /tmp/base <base commit>            # or any copy of the old tree
    python bench/compare_revisions.py /tmp/base . --bench grpo --rounds 8 -- --size medium
    python bench/compare_revisions.py /tmp/base . --bench dpo --rounds 8 -- --size medium

Each checkout runs its own ``bench/<bench>_vs_trl.py --side rlhf`` (so its own ``rlhf``, on PYTHONPATH=checkout)
in a process of its own that stays alive; after each side's warm-up (one after the other) they run one block at a
time in the order A B | B A | A B ... for ``--rounds`` rounds (bench/common.py ``alternate``, the protocol of the
TRL comparisons), so a slow spell of the shared machine hits both revisions of a round.  Both use the same kit
(built once, by A, in ``--kit_dir``).  The arguments after ``--`` go to both benches unchanged (only flags both
revisions know).

Printed: per revision the median over blocks of CPU-seconds per step (process user + sys; with one thread the work
done, robust to other tenants) and of wall seconds per step; the per-round paired ratio B/A in CPU time, its median,
a distribution-free 90% interval for that median (order statistics), the spread (half the inter-quartile range over
the median), min and max; and the reading against ``--limit`` (default 3%, issue 43's budget): "within" when the
interval lies inside 1 +- limit, "outside" when it lies wholly beyond, else "unclear".  Two copies of one commit
read 0.968 (interval 0.94-1.01) at load 9-14 on 2 cores over 8 GRPO medium rounds: under load, processes differ by
a few per cent on their own, so quote a reading, not a bare median.  The effect follows the start order, not
the code: with the roles swapped (B started first) the same two copies read 0.960 the other way round, i.e. the
process started second ran at ~0.96x the first's CPU time.  So by default the whole comparison runs twice, A
started first then B started first, and ``cancel_order`` combines the two (geometric mean; those three runs give
1.002, interval 0.95-1.05); ``--one_order`` runs only the first.  Exit status 1 with ``--check`` unless
"within".  Writes bench/results/compare_<bench>_<label>.json.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

import click

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, Side, alternate, side_summary, spread  # noqa: E402

BENCHES = {"grpo": "grpo_vs_trl.py", "dpo": "dpo_vs_trl.py"}


def paired_ratios(a: List[Dict], b: List[Dict], key: str = "cpu_s") -> List[float]:
    """Per round: B's ``key`` per step over A's (blocks of one round are paired by index)."""
    return [(y[key] / y["steps"]) / (x[key] / x["steps"]) for x, y in zip(a, b)]


def median_interval(xs: List[float], level: float = 0.9) -> Optional[Tuple[float, float]]:
    """A distribution-free interval for the median: the order statistics x(k), x(n+1-k) with the largest k such
    that P(Binomial(n, 1/2) < k) <= (1 - level) / 2, i.e. coverage >= ``level`` (None when n is too small)."""
    n, xs = len(xs), sorted(xs)
    tail, k = 0.0, 0
    while k < n and tail + math.comb(n, k) / 2 ** n <= (1 - level) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    return None if k == 0 else (xs[k - 1], xs[n - k])


def read_interval(ci, limit: float) -> str:
    """"within" (the interval inside 1 +- limit), "outside" (wholly beyond it), else "unclear"."""
    if ci is not None and 1 - limit <= ci[0] and ci[1] <= 1 + limit:
        return "within"
    if ci is not None and (ci[0] > 1 + limit or ci[1] < 1 - limit):
        return "outside"
    return "unclear"


def verdict(ratios: List[float], limit: float) -> Dict:
    """Median B/A, spread, range, its 90% interval, and the reading: "within" (the interval inside 1 +- limit),
    "outside" (the interval wholly beyond it), else "unclear" (more rounds, or a quieter machine, needed)."""
    med, ci = statistics.median(ratios), median_interval(ratios)
    reading = read_interval(ci, limit)
    return {"ratio": med, "spread": spread(ratios), "interval_90": ci, "min": min(ratios), "max": max(ratios),
            "reading": reading, "limit": limit}


def cancel_order(v1: Dict, v2: Dict, limit: float) -> Dict:
    """B/A with the start-order effect cancelled.  ``v1``: B/A with A started first, r1 = t * s; ``v2``: with B
    started first, r2 = t / s (s: the second-started process's own speed factor; 0.96 measured here, see the module
    docstring).  So t = sqrt(r1 * r2) and s = sqrt(r1 / r2); t's interval is sqrt(lo1 * lo2) .. sqrt(hi1 * hi2)
    from the two 90% intervals (both hold with >= 81%), read against ``limit`` as in ``verdict``."""
    t, s = math.sqrt(v1["ratio"] * v2["ratio"]), math.sqrt(v1["ratio"] / v2["ratio"])
    ci = None
    if v1["interval_90"] is not None and v2["interval_90"] is not None:
        ci = tuple(math.sqrt(x * y) for x, y in zip(v1["interval_90"], v2["interval_90"]))
    reading = read_interval(ci, limit)
    return {"ratio": t, "second_started_factor": s, "interval": ci, "reading": reading, "limit": limit}


def same_reported(warm: Dict[str, Dict]) -> None:
    """Refuse when both revisions report a setting (e.g. precision) and the values differ."""
    a, b = warm["A"], warm["B"]
    differ = {k: (a[k], b[k]) for k in ("precision", "gradient_checkpointing") if k in a and k in b and a[k] != b[k]}
    if differ:
        raise RuntimeError(f"the two revisions resolved different settings {differ}: pass the same flags to both")


def report(rows: Dict[str, Dict], v: Dict, roots: Dict[str, str], bench: str, args: List[str]) -> str:
    lines = [f"{bench} bench, rlhf side only, {' '.join(args)}",
             f"{'':4} {'CPU-s/step':>11} {'s/step':>9} {'peak RSS MB':>12}  checkout"]
    for k in ("A", "B"):
        r = rows[k]
        lines.append(f"{k:4} {r['cpu_s_per_step']:>11.4f} {r['s_per_step']:>9.4f} {r['peak_rss_mb']:>12.0f}  {roots[k]}")
    sp = "n/a" if v["spread"] is None else f"+-{100 * v['spread']:.1f}%"
    ci = "n/a" if v["interval_90"] is None else "{:.4f}-{:.4f}".format(*v["interval_90"])
    lines += [f"B/A CPU time per step: {v['ratio']:.4f} (90% interval of the median {ci}, spread {sp}, "
              f"min {v['min']:.4f}, max {v['max']:.4f}, {len(rows['A']['blocks_cpu_s_per_step'])} rounds)",
              f"reading: {v['reading']}"
              + {"within": " the", "outside": " the"}.get(v["reading"], ": the interval straddles the")
              + f" +-{100 * v['limit']:.0f}% budget"
              + (" (rerun with more --rounds, or on a quieter machine)" if v["reading"] == "unclear" else "")]
    return "\n".join(lines)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("a_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("b_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--bench", type=click.Choice(sorted(BENCHES)), default="grpo")
@click.option("--rounds", default=8, help="rounds of one block per revision, alternating which goes first")
@click.option("--limit", default=0.03, help="the budget for |B/A - 1| (0.03: within 3%)")
@click.option("--kit_dir", default=None, help="the kit both revisions use [a fresh temporary folder]")
@click.option("--check", is_flag=True, help="exit 1 unless the reading is 'within'")
@click.option("--one_order", is_flag=True, help="start A first only (half the time; keeps the start-order effect)")
def main(a_dir, b_dir, bench_args, bench, rounds, limit, kit_dir, check, one_order):
    roots = {"A": os.path.abspath(a_dir), "B": os.path.abspath(b_dir)}
    args = [*bench_args, "--rounds", str(rounds), "--kit_dir", kit_dir or tempfile.mkdtemp(prefix="rlhf-kit-")]
    runs = []
    for order in (("A", "B"),) if one_order else (("A", "B"), ("B", "A")):  # which revision's process starts first
        starts = {k: (lambda k=k: Side(os.path.join(roots[k], "bench", BENCHES[bench]), "rlhf", args,
                                       root=roots[k], name=k)) for k in order}
        blocks, warm = alternate(starts, rounds, check=same_reported)
        rows = {k: side_summary(blocks[k], warm[k]) for k in roots}
        v = verdict(paired_ratios(blocks["A"], blocks["B"]), limit)
        print(f"started first: {order[0]}\n" + report(rows, v, roots, bench, list(bench_args)), flush=True)
        runs.append({"started_first": order[0], "rows": rows, "cpu_ratio_b_over_a": v,
                     "wall_ratio_b_over_a": verdict(paired_ratios(blocks["A"], blocks["B"], "wall_s"), limit)})
    final = runs[0]["cpu_ratio_b_over_a"]
    if len(runs) == 2:
        final = cancel_order(runs[0]["cpu_ratio_b_over_a"], runs[1]["cpu_ratio_b_over_a"], limit)
        lo, hi = final["interval"] or (float("nan"),) * 2
        print(f"both orders: B/A CPU time per step {final['ratio']:.4f} (interval {lo:.4f}-{hi:.4f}; the "
              f"second-started process ran at {final['second_started_factor']:.3f}x the first's CPU time)\n"
              f"reading: {final['reading']}" + {"within": " the", "outside": " the"}.get(
                  final["reading"], ": the interval straddles the") + f" +-{100 * limit:.0f}% budget")
    os.makedirs(RESULTS, exist_ok=True)
    label = "_".join(a.lstrip("-") for a in bench_args) or "default"
    path = os.path.join(RESULTS, f"compare_{bench}_{label}.json")
    with open(path, "w") as fh:
        json.dump({"roots": roots, "bench_args": list(bench_args), "runs": runs, "final": final,
                   "loadavg_at_end": os.getloadavg()}, fh, indent=2)
    print("wrote", path)
    if check and final["reading"] != "within":
        sys.exit(1)

if __name__ == "__main__":
    main()
