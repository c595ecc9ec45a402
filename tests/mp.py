"""Spawn N gloo ranks running a module-level function; re-raise the first failure."""
import os
import traceback

import torch.multiprocessing as mp

from conftest import free_port


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
