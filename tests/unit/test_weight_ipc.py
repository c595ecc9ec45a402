"""CUDA IPC weight hand-over (rlhf.distributed.transport ``ipc_rows`` / ``from_ipc``): the contract, checked on CPU
(the handles themselves need CUDA): which argument of torch's handle carries the device, that the receiver opens
it on its own device and leaves the rest alone, that host tensors are refused (they take ``pack``'s host bytes).
The GPU test round-trips a real handle into another process."""
import inspect

import pytest
import torch

from rlhf.distributed.transport import IPC_DEVICE_ARG, from_ipc, ipc_rows, is_ipc_row, pack, unpack


def test_ipc_handle_carries_the_senders_device_and_is_opened_on_the_receivers():
    from torch.multiprocessing import reductions

    # torch's rebuild function takes the storage's device ordinal at the position we overwrite
    assert list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)[IPC_DEVICE_ARG] == "storage_device"
    assert "rebuild_cuda_tensor" in inspect.getsource(reductions.reduce_tensor)
    with pytest.raises(ValueError, match=r"'w' on cpu.*transport.pack"):
        ipc_rows([("w", torch.zeros(2))])
    calls = []

    def rebuild(*args):  # stands in for rebuild_cuda_tensor: records what it is asked to open
        calls.append(args)
        return torch.full(tuple(args[1]), float(args[IPC_DEVICE_ARG]))

    # the argument tuple reduce_tensor builds for a CUDA tensor (torch/multiprocessing/reductions.py)
    args = (torch.Tensor, torch.Size([2, 3]), (3, 1), 0, "storage_cls", torch.float32, 3, b"handle", 24, 0, False,
            b"ref_counter", 0, b"event", True)
    row = ["model.w", (rebuild, args)]
    assert is_ipc_row(row) and not is_ipc_row(pack([("w", torch.zeros(1))])[0])
    ((name, t),) = unpack([row], device_index=1)
    assert name == "model.w" and t.shape == (2, 3)
    got = calls[0]
    assert got[IPC_DEVICE_ARG] == 1, "the handle was opened on the sender's GPU ordinal, not the receiver's"
    assert got[:IPC_DEVICE_ARG] + got[IPC_DEVICE_ARG + 1:] == args[:IPC_DEVICE_ARG] + args[IPC_DEVICE_ARG + 1:]
    assert from_ipc((rebuild, args), 0)[0, 0] == 0.0


def _open(rows, q):
    from rlhf.distributed.transport import unpack as un

    ((_, t),) = un(rows, device_index=torch.cuda.current_device())
    q.put(float(t.sum()))


@pytest.mark.gpu
def test_ipc_round_trip_into_another_process():
    import torch.multiprocessing as mp

    t = torch.arange(12, dtype=torch.float32, device="cuda").view(3, 4)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_open, args=(ipc_rows([("w", t)]), q))
    p.start()
    assert q.get(timeout=60) == float(t.sum())
    p.join(60)
