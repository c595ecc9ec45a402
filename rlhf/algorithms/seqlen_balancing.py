"""Token-budget micro-batches (``--use_dynamic_batch``): pure functions over sequence lengths.

What OpenRLHF does (openrlhf/utils/seqlen_balancing.py, itself copied from veRL's
verl/utils/seqlen_balancing.py; used by openrlhf/trainer/ppo_utils/replay_buffer.py ``setup_dynamic_batch`` and
experience_maker.py ``split_rollout_samples``), and what is mirrored here:

* ``karmarkar_karp``: the largest differencing method (Karmarkar-Karp) splits items into k sets of near-equal
  length sums; OpenRLHF's ``get_seqlen_balanced_partitions(lengths, k, equal_size)``.
* ``min_micro_batches``: the fewest micro-batches whose token sums stay within the budget, by first fit;
  OpenRLHF's ``get_minimum_num_micro_batch_size``.  A sequence longer than the budget gets a micro-batch of its
  own there (first fit opens a bin for it that nothing else fits into), and here too: it is never refused, and
  ``plan_step`` counts such micro-batches (``OVER_BUDGET``, logged as ``over_budget_micro_batches``) and says so
  once per process.
* per optimizer step, OpenRLHF takes the largest such count over the DP ranks (``all_reduce(max)``) and splits
  each rank's rows into exactly that many balanced micro-batches (``get_seqlen_balanced_partitions(...,
  equal_size=False)``), so every rank runs the same number of forwards.

Where this differs, and why:

* first fit runs over the lengths sorted longest first (first-fit decreasing: never more bins than first fit in
  the given order, and independent of the row order);
* a balanced split may still put more than the budget into one micro-batch (balance is not a bin-packing
  guarantee); ``token_micro_batches`` then tries one more micro-batch, until every one fits;
* ranks: the step's rows are first split over the DP ranks by Karmarkar-Karp on the lengths (``equal_size=False``,
  so ranks get near-equal token sums; OpenRLHF's experience maker does the same split over its actor groups);
* the count every rank runs is computed, not reduced: every rank holds the same rows (the batch is gathered to
  every rank before training, and the supervised data is the same file on every rank), so each rank computes
  every rank's plan and takes the maximum; a rank with fewer micro-batches than that runs dummy forwards;
* padded (not ``--packing_samples``) micro-batches cost rows x padded width, not the sum of lengths: they are
  formed by ``padded_micro_batches`` (lengths sorted, a micro-batch closed when rows x width would pass the
  budget), so similar lengths share a micro-batch and little is padding. OpenRLHF counts the sum of lengths on
  both paths and advises packing.

Loss normalisation is not touched here: the trainers divide by the step's global token / sequence counts
(rlhf.roles.update_batches.step_totals), whatever the micro-batches, so token budgets change the FLOPs, not the
loss.  (OpenRLHF's dynamic path computes the same global counts: ``dynamic_batch_num_tokens``.)
"""
from __future__ import annotations

import heapq
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


def karmarkar_karp(lengths: Sequence[int], k: int, equal_size: bool = False) -> List[List[int]]:
    """Indices of ``lengths`` in k sets whose sums are near-equal (largest differencing method).

    Each state is k sets sorted by sum, largest first; its spread is max sum - min sum.  Start with one state per
    item (equal_size: one per k consecutive items of the sorted lengths, one item in each set), then repeatedly
    merge the two states of largest spread, pairing the largest set of one with the smallest of the other.
    equal_size=True needs len(lengths) % k == 0 and gives every set len/k items.  Sets may be empty when
    len(lengths) < k.  Each returned set is sorted; the sets come largest sum first."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(lengths)
    if equal_size and n % k:
        raise ValueError(f"equal_size: {n} items do not split into {k} sets of equal size")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    heap: list = []
    tie = 0

    def push(sets):
        nonlocal tie
        sets.sort(key=lambda s: (-s[0], -len(s[1]), s[1]))
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), tie, sets))
        tie += 1

    if equal_size:
        for s in range(0, n, k):
            push([[lengths[i], [i]] for i in order[s:s + k]])
    else:
        for i in order:
            push([[lengths[i], [i]]] + [[0, []] for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        push([[sa[0] + sb[0], sa[1] + sb[1]] for sa, sb in zip(a, reversed(b))])
    return [sorted(s[1]) for s in heap[0][2]]


def min_micro_batches(lengths: Sequence[int], budget: int) -> int:
    """The number of bins of capacity ``budget`` first fit needs for ``lengths`` taken longest first
    (OpenRLHF ``get_minimum_num_micro_batch_size``, there in the given order).  0 for no lengths.  A length over
    the budget takes a bin of its own (nothing fits beside it), as there."""
    bins: List[int] = []
    for n in sorted(lengths, reverse=True):
        for j, used in enumerate(bins):
            if used + n <= budget:
                bins[j] = used + n
                break
        else:
            bins.append(n)
    return len(bins)


def token_micro_batches(lengths: Sequence[int], budget: int, count: int) -> List[List[int]]:
    """At least ``count`` micro-batches (index lists) of near-equal token sums, each within ``budget`` tokens
    (packed rows: a micro-batch costs the sum of its lengths), or a single over-budget item alone.  Karmarkar-Karp
    into ``count`` sets; one more set while some set of two or more items is over budget.  Sets are empty only when
    there are fewer items than ``count``."""
    k = max(count, 1)
    while True:
        parts = karmarkar_karp(lengths, k)
        if all(len(p) <= 1 or sum(lengths[i] for i in p) <= budget for p in parts) or k >= len(lengths):
            return parts
        k += 1


@dataclass(frozen=True)
class Item:
    """One training sample as the micro-batcher sees it: ``left`` / ``right`` widths (a left-padded prompt and a
    right-padded response; 0 and the length for right-padded SFT rows), ``rows`` the tensor rows it takes
    (2 for a chosen/rejected pair, each padded to left + right) and ``tokens`` its real tokens (what a packed
    row holds; default left + right)."""
    left: int
    right: int
    rows: int = 1
    tokens: int = -1

    def __post_init__(self):
        if self.tokens < 0:
            object.__setattr__(self, "tokens", self.left + self.right)


def padded_cost(items: Sequence[Item]) -> int:
    """Token slots a padded micro-batch computes: (sum of rows) x (max left + max right)."""
    if not items:
        return 0
    return sum(it.rows for it in items) * (max(it.left for it in items) + max(it.right for it in items))


def padded_micro_batches(items: Sequence[Item], budget: int, count: int) -> List[List[int]]:
    """At least ``count`` padded micro-batches (index lists), each within ``budget`` token slots
    (``padded_cost``): items sorted longest first are cut into runs, a run closed when the next item would take
    its padded cost past the budget (an item over the budget alone is a run of its own: nothing joins it); then,
    while there are fewer than ``count`` runs, the costliest run of two or more items is halved.  Empty lists pad
    the result to ``count`` when there are fewer items than that."""
    order = sorted(range(len(items)), key=lambda i: (-(items[i].left + items[i].right), -items[i].rows, i))
    runs: List[List[int]] = []
    for i in order:
        if runs and padded_cost([items[j] for j in runs[-1]] + [items[i]]) <= budget:
            runs[-1].append(i)
        else:
            runs.append([i])
    while len(runs) < count:
        splittable = [r for r in runs if len(r) > 1]
        if not splittable:
            break
        big = max(splittable, key=lambda r: padded_cost([items[j] for j in r]))
        at = runs.index(big)
        runs[at:at + 1] = [big[:len(big) // 2], big[len(big) // 2:]]
    return [sorted(r) for r in runs] + [[] for _ in range(count - len(runs))]


def micro_count(items: Sequence[Item], budget: int, packed: bool) -> int:
    """The fewest micro-batches one rank's items need under the budget (packed: first-fit decreasing on token
    sums; padded: the sorted runs of ``padded_micro_batches``)."""
    if not items:
        return 0
    if packed:
        return min_micro_batches([it.tokens for it in items], budget)
    return len(padded_micro_batches(items, budget, 0))


def split_micro(items: Sequence[Item], budget: int, count: int, packed: bool) -> List[List[int]]:
    if packed:
        return token_micro_batches([it.tokens for it in items], budget, count)
    return padded_micro_batches(items, budget, count)


def plan_step(items: Sequence[Item], world: int, budget: int, packed: bool
              ) -> Tuple[List[List[int]], List[List[Optional[List[int]]]]]:
    """One optimizer step's rows over ``world`` DP ranks and their micro-batches.

    Returns (ranks, micro): ranks[r] the item indices of rank r (Karmarkar-Karp on token counts: near-equal token
    sums per rank); micro[r] rank r's micro-batches as lists of item indices, the *same number on every rank*
    (the largest any rank needs); ``None`` where a rank has no rows left for a micro-batch (it runs a dummy
    forward).  A pure function of the items: every rank computes the same plan."""
    ranks = karmarkar_karp([it.tokens for it in items], world)
    k = max([micro_count([items[i] for i in rows], budget, packed) for rows in ranks] + [1])
    while True:  # packed: a rank whose balanced split ran over budget took more sets; all ranks follow it
        splits = [split_micro([items[i] for i in rows], budget, k, packed) for rows in ranks]
        if all(len(s) == k for s in splits):
            break
        k = max(len(s) for s in splits)
    micro: List[List[Optional[List[int]]]] = []
    for rows, split in zip(ranks, splits):
        mbs: List[Optional[List[int]]] = [[rows[j] for j in part] or None for part in split]
        # the real micro-batches first, dummies last
        micro.append([m for m in mbs if m is not None] + [m for m in mbs if m is None])
    _count_over_budget(items, micro, budget, packed)
    return ranks, micro


class OverBudget:
    """Micro-batches planned over the token budget (each one over-budget sequence alone: OpenRLHF's first fit
    gives it a bin of its own), summed over every rank's plan since the last ``take``."""
    count = 0
    warned = False

    @classmethod
    def take(cls) -> int:
        n, cls.count = cls.count, 0
        return n


OVER_BUDGET = OverBudget


def micro_cost(items: Sequence[Item], packed: bool) -> int:
    """Tokens a micro-batch of ``items`` costs: their sum packed, rows x padded width padded."""
    return sum(it.tokens for it in items) if packed else padded_cost(items)


def _count_over_budget(items, micro, budget: int, packed: bool) -> None:
    over = [micro_cost([items[i] for i in m], packed) for parts in micro for m in parts if m is not None]
    over = [c for c in over if c > budget]
    if not over:
        return
    OverBudget.count += len(over)
    if not OverBudget.warned:
        OverBudget.warned = True
        warnings.warn(f"{len(over)} micro-batch(es) of one sequence over the token budget ({max(over)} > {budget} "
                      f"tokens per micro-batch; --train_max_tokens_per_gpu / --rollout_max_tokens_per_gpu x "
                      f"--ring_attn_size): each runs alone, as OpenRLHF does; counted in the metric "
                      f"over_budget_micro_batches (raise the budget if such a forward runs out of memory)",
                      UserWarning, stacklevel=3)
