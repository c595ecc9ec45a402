"""Padding waste of the PPO/GRPO update's micro-batches, fixed size vs token budgets (--use_dynamic_batch).

    python bench/padding_waste.py [--rows 512 --world 8 --train_batch_size 128 --micro 4 --budget 16384]

Builds a batch of left-padded prompts and right-padded responses with skewed lengths (prompts uniform in
[64, 512], responses log-normal with median 300 capped at 2048, like long-CoT rollouts), then runs the update's
own micro-batch formation (rlhf.roles.update_batches ``_minibatches`` / ``micro_batch`` / ``padding_counts``, the
code that logs ``padding_frac``) on every rank of ``--world`` and prints, per mode: the padding waste
(1 - real tokens / token slots computed), the forwards per optimizer step (the most any rank runs), and the
ranks' token imbalance (max rank tokens / mean rank tokens, per step).  No model runs: CPU seconds.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def skewed_batch(rows: int, P: int, R: int, seed: int):
    from rlhf.batch import Batch

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(64, P + 1, (rows,), generator=g)
    rlen = (torch.randn(rows, generator=g) * 0.8 + torch.log(torch.tensor(300.0))).exp().clamp(8, R).long()
    att = torch.zeros(rows, P + R, dtype=torch.long)
    am = torch.zeros(rows, R, dtype=torch.long)
    for i in range(rows):
        att[i, P - int(plen[i]):P + int(rlen[i])] = 1
        am[i, :int(rlen[i])] = 1
    z = torch.zeros(rows, R)
    return Batch(sequences=att.clone(), attention_mask=att, action_mask=am, rollout_logprobs=z, advantages=z, returns=z,
                 scores=torch.zeros(rows), prompt_len=P)


def measure(exp, world: int, tbs: int, micro: int, budget: int, mode: str) -> dict:
    from rlhf.roles.update_batches import TokenBudget, _minibatches, micro_batch, padding_counts, row_items

    packed = mode == "packed"
    dyn = None if mode == "fixed" else TokenBudget(row_items(exp.attention_mask, exp.action_mask), budget, packed)
    real = slots = 0.0
    forwards, imbalance = [], []
    n = exp.sequences.size(0)
    per_rank = [list(_minibatches(n, r, world, tbs, micro, 7, dyn)) for r in range(world)]
    for step in range(len(per_rank[0])):
        toks = []
        for r in range(world):
            mbs = per_rank[r][step]
            t = 0.0
            for mr in mbs:
                a, b = padding_counts(micro_batch(exp, mr, dyn), packed, mr.real)
                real, slots, t = real + a, slots + b, t + a
            toks.append(t)
        forwards.append(max(len(per_rank[r][step]) for r in range(world)))
        imbalance.append(max(toks) / (sum(toks) / world))
    return {"padding_waste": 1 - real / slots, "forwards_per_step": sum(forwards) / len(forwards),
            "rank_token_imbalance": sum(imbalance) / len(imbalance)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--train_batch_size", type=int, default=128)
    p.add_argument("--micro", type=int, default=4, help="--micro_train_batch_size of the fixed mode")
    p.add_argument("--budget", type=int, default=16384, help="--train_max_tokens_per_gpu of the token-budget modes")
    p.add_argument("--prompt_max_len", type=int, default=512)
    p.add_argument("--generate_max_len", type=int, default=2048)
    a = p.parse_args(argv)
    exp = skewed_batch(a.rows, a.prompt_max_len, a.generate_max_len, 0)
    for mode in ("fixed", "padded", "packed"):
        m = measure(exp, a.world, a.train_batch_size, a.micro, a.budget, mode)
        label = {"fixed": f"fixed --micro_train_batch_size {a.micro}",
                 "padded": f"--use_dynamic_batch --train_max_tokens_per_gpu {a.budget}",
                 "packed": f"--use_dynamic_batch --train_max_tokens_per_gpu {a.budget} --packing_samples"}[mode]
        print(f"{label:70s} padding waste {m['padding_waste']:.3f}  forwards/step {m['forwards_per_step']:.2f}  "
              f"rank token imbalance {m['rank_token_imbalance']:.3f}")


if __name__ == "__main__":
    main()
