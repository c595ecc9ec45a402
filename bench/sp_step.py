"""Sequence parallelism on CPU: one packed SFT or actor training step (forward + backward) with and without SP.

    python bench/sp_step.py                       # 2048- and 8192-token rows, SFT and actor steps
    python bench/sp_step.py --tokens 2048 --modes sft --steps 3

For each row length T and mode, N=1 runs in one process on the whole row and N=2 in two gloo processes of one
sequence-parallel group (rlhf.distributed.sequence_parallel: each rank holds T/2 tokens, attention by
all-to-all over heads).  One thread per process (N=2 uses both cores, N=1 one: the wall-time ratio includes that;
a 2-thread N=1 is erratic on a shared machine).  Per setting: median wall seconds per step after a warm-up step,
process CPU seconds summed over the ranks (the work, including the all-to-alls), and the activation memory of the
step on the larger rank (peak RSS minus RSS before the step).  SP's purpose is the memory per rank of long rows.

The model is a random Llama (hidden 256, 4 layers, 8 heads, 4 KV heads, FFN 1024, vocabulary 8192: the attention
and MLP dominate, not the head); the row packs samples of 512 tokens (128 prompt + 384 response, loss on the
response).  Not a test: it reports numbers (bench/results/sp_step.json).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _batch(tokens: int):
    """A packed row of 512-token samples (128 prompt, 384 response): SFT dict and actor (seq, att, act) form."""
    import torch

    g = torch.Generator().manual_seed(1)
    n = max(1, tokens // 512)
    P, R = 128, 384
    seq = torch.randint(3, 8192, (n, P + R), generator=g)
    att = torch.ones_like(seq)
    act = torch.ones((n, R), dtype=torch.long)
    ids = seq.reshape(1, -1)
    pos = torch.arange(P + R).repeat(n).unsqueeze(0)
    lm = torch.cat([torch.zeros(P), torch.ones(R)]).repeat(n).unsqueeze(0).long()
    lm[0, 0::P + R] = 0
    return {"input_ids": ids, "position_ids": pos, "loss_mask": lm}, (seq, att, act)


def _worker(rank: int, world: int, port: int, tokens: int, mode: str, steps: int, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from rlhf.algorithms.preference import sft_token_loss
    from rlhf.distributed import comm
    from rlhf.distributed.sequence_parallel import SP, attach
    from rlhf.models.forward import packed_action_logprobs
    from rlhf.supervised.tasks import token_logprobs

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model()
    model.train()
    if world > 1:
        attach(model, SP(world, rank, comm.world_group()))
    batch, (seq, att, act) = _batch(tokens)

    def step():
        if mode == "sft":
            loss = sft_token_loss(token_logprobs(model, batch, 1024), batch["loss_mask"][:, 1:])
        else:
            lp, ent = packed_action_logprobs(model, seq, att, act, 1.0, 1024, with_entropy=True)
            loss = -(lp * act).sum() / act.sum() - 0.01 * (ent * act).sum() / act.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    times, mem, cpu = [], [], []
    for _ in range(steps):
        before = _rss_mb()
        comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        cpu.append(time.process_time() - c0)
        comm.barrier()
        times.append(time.perf_counter() - t0)
        mem.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 - before)
    q.put((rank, statistics.median(times), max(mem), statistics.median(cpu)))
    dist.destroy_process_group()


def run(tokens: int, mode: str, world: int, steps: int) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, port, tokens, mode, steps, q), nprocs=world, start_method="spawn")
    res = [q.get() for _ in range(world)]
    return {"s_per_step": max(r[1] for r in res), "step_mem_mb": max(r[2] for r in res),
            "cpu_s_per_step_all_ranks": sum(r[3] for r in res)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--modes", nargs="+", default=["sft", "actor"], choices=["sft", "actor"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "sp_step.json"))
    a = p.parse_args(argv)
    rows = []
    for t in a.tokens:
        for mode in a.modes:
            one, two = run(t, mode, 1, a.steps), run(t, mode, 2, a.steps)
            row = {"tokens": t, "mode": mode, "n1": one, "n2": two,
                   "time_ratio_n2_over_n1": round(two["s_per_step"] / one["s_per_step"], 3),
                   "cpu_ratio_n2_over_n1": round(two["cpu_s_per_step_all_ranks"] / one["cpu_s_per_step_all_ranks"], 3),
                   "mem_ratio_n2_over_n1": round(two["step_mem_mb"] / max(one["step_mem_mb"], 1e-9), 3)}
            rows.append(row)
            print(f"{t:>6} tokens {mode:>5}: N=1 {one['s_per_step']:.2f} s/step {one['step_mem_mb']:.0f} MB | "
                  f"N=2 {two['s_per_step']:.2f} s/step {two['step_mem_mb']:.0f} MB per rank | time x"
                  f"{row['time_ratio_n2_over_n1']}, CPU time (all ranks) x{row['cpu_ratio_n2_over_n1']}, step memory "
                  f"x{row['mem_ratio_n2_over_n1']}", flush=True)
    load = os.getloadavg()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"rows": rows, "loadavg": load, "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}, fh,
                  indent=1)
    print(f"load average {load[0]:.1f}; written {a.out}")


if __name__ == "__main__":
    main()
