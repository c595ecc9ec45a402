"""Weight sync from every shard (rlhf.distributed.shard_sync), one launch of 5 gloo ranks: rank 4 receives, ranks
0-1 (world 2: a 1D mesh) and then ranks 0-3 (world 4: a 2D (2, 2) mesh with Shard x Shard and Replicate x Shard
placements, and an FSDP2 module) send.  Every dimension that is sharded is not divisible by its mesh size.  Each
sender's bytes must be its own blocks' (counted here from ``torch.chunk``, not from the code under test), the
receiver's tensors must equal the full tensors, and no rank sends the whole model."""
import torch
from helpers.mp import spawn

RECEIVER = 4


def chunk_of(full, mesh_shape, coord, places):
    """The block torch's Shard(d) gives mesh coordinate ``coord``: torch.chunk along d for each mesh dim, in order."""
    t = full
    for size, c, pl in zip(mesh_shape, coord, places):
        if pl is not None:
            parts = torch.chunk(t, size, dim=pl)
            t = parts[c] if c < len(parts) else t.narrow(pl, 0, 0)
    return t


def _case(rank, mesh_shape, tensors, module=None):
    """tensors: name -> (full, places per mesh dim: a tensor dim to shard, or None for Replicate)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from rlhf.distributed.shard_sync import ShardSync

    n = 1
    for s in mesh_shape:
        n *= s
    mesh = DeviceMesh("cpu", torch.arange(n).view(mesh_shape))  # every rank builds it (new_group is collective)
    senders = list(range(n))
    params, meta, expect = [], [], 0
    for name, (full, places) in tensors.items():
        meta.append((name, tuple(full.shape), full.dtype))
        if rank in senders:
            pl = [Shard(d) if d is not None else Replicate() for d in places]
            params.append((name, distribute_tensor(full, mesh, pl)))
            coord = mesh.get_coordinate()
            if all(c == 0 for c, d in zip(coord, places) if d is None):
                expect += chunk_of(full, mesh_shape, coord, places).numel() * 4
    if module is not None:  # FSDP2 (fully_shard) over a 1D mesh of all senders
        from torch.distributed.fsdp import fully_shard

        mod, flat_mesh = module, DeviceMesh("cpu", torch.arange(n))
        for name, p in mod.named_parameters():
            meta.append(("fsdp." + name, tuple(p.shape), p.dtype))
        if rank in senders:
            full = {k: v.detach().clone() for k, v in mod.named_parameters()}
            fully_shard(mod, mesh=flat_mesh)
            for name, p in mod.named_parameters():
                params.append(("fsdp." + name, p))
                expect += chunk_of(full[name], (n,), (rank,), [0]).numel() * 4
    sync = ShardSync(meta, senders, [RECEIVER], rank, bucket_bytes=300, dtype=None, device=torch.device("cpu"),
                     timeout_s=60)
    whole = sum(torch.Size(s).numel() * 4 for _, s, _ in meta)
    if rank in senders:
        sent = sync.send(params)
        assert sent == expect, f"world {n}: rank {rank} sent {sent} bytes, its own blocks are {expect}"
        assert sent < whole, f"world {n}: rank {rank} sent {sent} bytes, the whole model is {whole}"
        return sent
    if rank == RECEIVER:
        got = []
        received = sync.receive(got.extend)
        assert received == whole, f"world {n}: received {received} bytes, one copy of the model is {whole}"
        want = {name: full for name, (full, _) in tensors.items()}
        if module is not None:
            want.update({"fsdp." + k: v for k, v in module.named_parameters()})
        assert [n_ for n_, _ in got] == sorted(want, key=[m[0] for m in meta].index)
        for name, t in got:
            assert torch.equal(t, want[name]), f"world {n}: {name} assembled wrong"
        return received
    return None


def _worker(rank, world):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731  (same values on every rank)
    # world 2: ranks 0-1 send over a 1D mesh
    sent2 = _case(rank, (2,), {"a": (r(7, 5), [0]), "b": (r(13, 6), [1]), "c": (r(3, 5, 7), [0]),
                               "d": (r(11), [None])})
    # world 4: a (2, 2) mesh, TP-like and HSDP-like placements, plus FSDP2 over a 1D mesh of 4
    torch.manual_seed(1)
    mod = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.Embedding(6, 3))  # 7 and 6 rows over 4 ranks
    sent4 = _case(rank, (2, 2), {"w": (r(7, 5), [0, 1]), "e": (r(13, 6), [None, 0]), "v": (r(5,), [None, None])},
                  module=mod)
    through = _through_weight_sync(rank, world)
    adapter = _adapter_to_rollout_rank(rank, world)
    box = [None] * world
    dist.all_gather_object(box, (sent2, sent4, through, adapter))
    if rank == 0:
        print("[shard sync bytes]", box)


def _net(seed):
    torch.manual_seed(seed)  # 9 -> 7 -> 5: no dimension divisible by 4
    return torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))


def _through_weight_sync(rank, world):
    """The trainer's path: placement actor 0-3 + rollout 4, FSDP2 actor, WeightSync(from_shards=True) twice; each
    actor rank's sync_bytes is its own shard's, the engine gets the full weights."""
    from helpers.engine_standin import StandInEngine
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from rlhf.config import TopologyConfig
    from rlhf.distributed import WeightSync, build_groups, make_placement

    class Loading(StandInEngine):
        def __init__(self, model):
            self.model, self.resets = model, 0

        def load_weights(self, named):
            params = dict(self.model.named_parameters())
            for n, t in named:
                params[n].data.copy_(t)

        def reset_prefix_cache(self):
            self.resets += 1

    t = TopologyConfig()
    t.actor_num_gpus_per_node, t.vllm_num_engines = 4, 1
    plan = make_placement(t, world)
    g = build_groups(plan, rank)
    assert plan.ranks["actor"] == [0, 1, 2, 3] and plan.ranks["rollout"] == [4], plan.ranks
    model = engine = None
    whole = sum(p.numel() * 4 for p in _net(0).parameters())
    if rank < 4:
        model = _net(0)
        own = sum(torch.chunk(p.detach(), 4, dim=0)[rank].numel() * 4 if rank < len(torch.chunk(p, 4)) else 0
                  for p in model.parameters())
        fully_shard(model, mesh=DeviceMesh.from_group(g.group("actor"), "cpu"))
    else:
        engine = Loading(_net(5))
    ws = WeightSync(g, engine, bucket_mb=0.0002, from_shards=True)  # ~200 B buckets: several per sync
    for step in range(2):
        if model is not None and step:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        ws.sync(model)
        got = ws.last["sync_bytes"]
        assert ws.last["sync_GBps"] > 0 and ws.last["sync_s"] > 0, ws.last
        if rank < 4:
            assert got == own, f"actor rank {rank} sent {got} bytes through WeightSync, its shard is {own}"
        else:
            assert got == whole, f"the rollout rank received {got} bytes, the model is {whole}"
            ref = _net(0)
            for (n, p), q in zip(engine.model.named_parameters(), ref.parameters()):
                assert torch.equal(p, q + step), f"sync {step + 1}: {n} differs from the actor's"
    assert engine is None or engine.resets == 2
    return ws.last["sync_bytes"]


def test_shard_sync_sends_each_rank_its_own_blocks_at_world_2_and_4():
    spawn(_worker, 5)


def _adapter_to_rollout_rank(rank, world):
    """--lora_sync adapter to an HF engine on a rollout rank of its own: the base once (plain tensors: actor rank 0
    sends them), then each adapter version over the sync group; the engine's logits equal the actor's."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.config import TopologyConfig
    from rlhf.distributed import WeightSync, build_groups, make_placement
    from rlhf.engines.hf_engine import HFEngine

    cfg = LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=45, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    t = TopologyConfig()
    t.actor_num_gpus_per_node, t.vllm_num_engines = 4, 1
    g = build_groups(make_placement(t, world), rank)
    torch.manual_seed(0)
    actor = peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(r=3, lora_alpha=5,
                                                                       target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(9)
    engine = HFEngine(LlamaForCausalLM(cfg), None, lora_adapters=True) if rank == 4 else None
    ws = WeightSync(g, engine, bucket_mb=0.01, lora_sync="adapter", from_shards=True)
    ids = torch.tensor([[3, 7, 11, 2, 40]])
    sent = []
    for seed in (1, 2):
        with torch.no_grad():
            for n, p in actor.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + len(n))) * 0.3)
        ws.sync(actor if rank < 4 else None)
        sent.append(ws.last["sync_bytes"])
        if rank == 4:
            with torch.no_grad():
                want, got = actor(input_ids=ids).logits, engine.model(input_ids=ids).logits
            assert (want - got).abs().max() < 1e-5, f"adapter version {seed}: engine logits differ from the actor's"
    adapter = sum(p.numel() * 4 for n, p in actor.named_parameters() if "lora_" in n)
    if rank in (0, 4):
        assert sent[1] == adapter < sent[0], f"rank {rank}: second sync {sent} bytes, the adapter is {adapter}"
    return sent
