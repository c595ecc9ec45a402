"""The direct weight path (vLLM in its own processes) sends an MoE actor's experts under the checkpoint's
per-expert names, as the in-process path does (issue 45): vLLM's Qwen3-MoE loader reads ``experts.{e}.gate_proj``
/ ``up_proj`` / ``down_proj`` (vllm/model_executor/models/qwen3_moe.py, ``FusedMoE.make_expert_params_mapping``).

Rank 0 is the actor (the tiny Qwen3-MoE), rank 1 an engine's driver whose one vLLM worker is the real
``vllm_worker.WorkerExtension`` over the real weight-transfer group; only the model it loads into is a recorder.
"""
from types import SimpleNamespace

import torch
from helpers.engine_standin import StandInEngine
from helpers.models import tiny_moe

from rlhf.engines import vllm_worker


class Worker(vllm_worker.WorkerExtension):
    def __init__(self):
        self.rank, self.device, self.calls = 0, torch.device("cpu"), []
        model = SimpleNamespace(load_weights=lambda named: self.calls.append([(n, t.clone()) for n, t in named]))
        self.model_runner = SimpleNamespace(get_model=lambda: model)


class DirectEngine(StandInEngine):
    """VLLMEngine's separate-mode weight surface with its one worker called in place of ``collective_rpc``."""

    direct_weights = True

    def __init__(self):
        self.worker = Worker()

    def weight_workers(self) -> int:
        return 1

    def join_weight_group(self, host, port, rank_offset, world, backend, timeout_s):
        return self.worker.rlhf_join_weight_group(host, port, rank_offset, world, backend, timeout_s)

    def receive_weights(self, pieces) -> int:
        return self.worker.rlhf_receive_weights(pieces, "direct")

    def reset_prefix_cache(self):
        pass


def _sync(rank, world, out_dir):
    import torch.distributed as dist

    from rlhf.distributed.weight_sync import WeightSync

    eng = DirectEngine() if rank == 1 else None
    groups = SimpleNamespace(plan=SimpleNamespace(sync_ranks=[0, 1], separate_rollout=True), rank=rank,
                             group={"sync": dist.group.WORLD}.get)
    ws = WeightSync(groups, eng, bucket_mb=0.004, timeout_s=30)  # ~4 KB buckets: expert stacks straddle them
    ws.sync(tiny_moe(layers=2, seed=4, expert_std=0.3) if rank == 0 else None)
    if rank == 1:
        torch.save(eng.worker.calls, f"{out_dir}/calls.pt")


def test_direct_sync_sends_moe_experts_under_checkpoint_names(tmp_path):
    from helpers.mp import spawn
    from safetensors.torch import load_file

    spawn(_sync, 2, str(tmp_path))
    calls = torch.load(tmp_path / "calls.pt")
    got = [(n, t) for call in calls for n, t in call]
    tiny_moe(layers=2, seed=4, expert_std=0.3).save_pretrained(tmp_path / "ckpt")
    want = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    names = [n for n, _ in got]
    assert sorted(names) == sorted(want), (f"names on the wire differ from the checkpoint's: extra "
                                           f"{sorted(set(names) - set(want))[:6]}, missing {sorted(set(want) - set(names))[:6]}")
    assert len(names) == len(set(names)), "a tensor was sent twice"
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names and not any(n.endswith("gate_up_proj") for n in names)
    for n, t in got:
        assert t.shape == want[n].shape and torch.equal(t, want[n]), f"{n}: the worker got other values than saved"
    for call in calls:  # every tensor of a decoder layer in one load (vLLM's reload fuses a layer at once)
        for layer in {n.split(".")[2] for n, _ in call if ".layers." in n}:
            n_in = sum(1 for n, _ in call if f".layers.{layer}." in n)
            assert n_in == sum(1 for n in want if f".layers.{layer}." in n), f"layer {layer} split across loads"
