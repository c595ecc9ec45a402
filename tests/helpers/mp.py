"""Spawn N gloo ranks running a module-level function; re-raise the first failure."""
import os
import traceback

import torch.multiprocessing as mp

from helpers.net import free_port


def _entry(rank, world, port, fn, args, errq):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world: int, *args):
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    try:
        mp.start_processes(_entry, args=(world, free_port(), fn, args, errq), nprocs=world, start_method="spawn")
    except Exception as e:
        msgs = []
        while not errq.empty():
            r, tb = errq.get()
            msgs.append(f"--- rank {r} ---\n{tb}")
        raise AssertionError("\n".join(msgs) or str(e)) from None


def train_side_by_side(engine, forward, kit, ids, rank, steps=2, lr=1e-2):
    """``steps`` accumulated steps of ``engine`` on this rank's half of ``ids`` (one row per micro-batch) and of a
    plain single-process AdamW model on all rows; returns the plain model for comparison."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(kit)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    half = ids.size(0) // 2
    for _ in range(steps):
        mine = ids[rank * half:(rank + 1) * half]
        for i in range(half):
            x = mine[i:i + 1]
            engine.backward(forward(input_ids=x, labels=x).loss, i)
        engine.step()
        opt.zero_grad()
        sum(ref(input_ids=ids[j:j + 1], labels=ids[j:j + 1]).loss for j in range(ids.size(0))).div(ids.size(0)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    return ref
