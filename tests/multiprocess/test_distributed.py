"""Multi-process (gloo) checks of groups, weight sync, exchange, phases, and the FSDP2 engine."""
import os

import pytest
import torch
from helpers.engine_standin import StandInEngine
from helpers.mp import spawn, train_side_by_side

from rlhf.config import TopologyConfig


def _topo(**kw):
    t = TopologyConfig()
    for k, v in kw.items():
        setattr(t, k, v)
    return t


class RecordingEngine(StandInEngine):
    def __init__(self, model):
        self.model = model
        self.loads = 0
        self.resets = 0

    def load_weights(self, named):
        params = dict(self.model.named_parameters())
        for n, t in named:
            params[n].data.copy_(t)
            self.loads += 1

    def reset_prefix_cache(self):
        self.resets += 1


def _net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _topology_worker(rank, world, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from rlhf.distributed import (
        Ledger,
        PhaseScheduler,
        WeightSync,
        build_groups,
        gather_max,
        gather_rows,
        make_placement,
        shard_rows,
    )

    # --- separate roles: actor 0-1, ref 2, rollout 3 ---
    plan = make_placement(_topo(actor_num_gpus_per_node=2, ref_num_gpus_per_node=1, vllm_num_engines=1), world)
    g = build_groups(plan, rank)
    expect = {"actor": [0, 1], "ref": [2], "rollout": [3]}
    for role, ranks in expect.items():
        grp = g.group(role)
        assert (grp is not None) == (rank in ranks)
        if grp is not None:
            assert dist.get_process_group_ranks(grp) == ranks
    assert (g.group("sync") is not None) == (rank in (0, 3))
    # weight sync by bucketed broadcast from actor rank 0 to the rollout rank only
    engine = None
    model = None
    if rank in (0, 1):
        model = _net(0)
        mesh = DeviceMesh.from_group(g.group("actor"), "cpu")
        fully_shard(model, mesh=mesh)
    if rank in (2, 3):
        engine = RecordingEngine(_net(123))
    before = [p.clone() for p in engine.model.parameters()] if engine else None
    ws = WeightSync(g, engine if rank == 3 else None, bucket_mb=0.0005)  # tiny buckets: several broadcasts
    if rank in (0, 1, 3):
        ws.sync(model)
    dist.barrier()
    ref = _net(0)
    if rank == 3:
        for p, q in zip(engine.model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
        assert engine.loads == 4 and engine.resets == 1
    if rank == 2:  # the ref rank received nothing
        for p, q in zip(engine.model.parameters(), before):
            assert torch.equal(p, q)
    # --- shard -> gather with fewer rows than ranks (rank 3 holds none) and widths known only after computing ---
    n = 3
    sl = shard_rows(n, rank, world)
    local = torch.full((sl.stop - sl.start, 1 + rank), float(rank + 1)) if sl.stop > sl.start else None
    (w,) = gather_max([0 if local is None else local.size(1)])
    y = gather_rows(local, sl, n, w)
    assert w == 3 and y.tolist() == [[1, 0, 0], [2, 2, 0], [3, 3, 3]], y
    # --- colocated: phase protocol keeps one heavy role awake per rank ---
    plan = make_placement(_topo(colocate_all_models=True), world)
    g = build_groups(plan, rank)
    assert g.group("actor") is dist.group.WORLD and plan.engine_ranks == [[0], [1], [2], [3]]

    from helpers.vllm_fake import FakeDevice, SleepModeLLM

    from rlhf.engines.vllm_memory import EngineMemory

    class Role:
        """A role with vLLM's sleep contract: the engine's EngineMemory over the fake of tests/helpers/vllm_fake.py, which
        raises where vLLM fails (a tag mapped twice, a wake on PyTorch's cached blocks, a partial sleep)."""

        def __init__(self):
            self.device = FakeDevice()
            self.memory = EngineMemory(SleepModeLLM(self.device), level=2, enabled=True,
                                       empty_cache=self.device.empty_cache)

        @property
        def awake(self):
            return self.memory.state != "asleep"

        @property
        def parts(self):
            return set(self.device.mapped)

        def sleep(self):
            self.memory.sleep()

        def wake(self, tags=None):
            self.device.hold_cached(80)  # whatever ran before left PyTorch's cache full
            self.memory.wake(tags)

        def memory_state(self):
            return self.memory.state

    roles = {r: Role() for r in ("actor", "ref", "reward", "rollout")}
    sched = PhaseScheduler(rank, roles, ledger=Ledger(rank))
    sched.put_all_to_sleep()
    for _ in range(2):
        for phase, role in (("rollout", "rollout"), ("reward", "reward"), ("ref", "ref"), ("actor", "actor"),
                            ("actor_train", "actor")):
            with sched.phase(phase, role=role):
                assert roles[role].awake and roles[role].parts == {"weights", "kv_cache"}
                assert sum(r.awake for r in roles.values()) == 1
        with sched.phase("sync", role="rollout", share="actor", tags=["weights"]):
            assert roles["rollout"].awake and roles["actor"].awake and not roles["ref"].awake
            assert roles["rollout"].parts == {"weights"}  # the KV cache stays asleep while weights load
    assert sched.ledger.max_awake(allowed_pairs=[("actor", "rollout")]) == 1
    begins = [e[3] for e in sched.ledger.events if e[2] == "begin"]
    assert begins[:6] == ["rollout", "reward", "ref", "actor", "actor_train", "sync"]
    torch.save(sched.ledger.events, os.path.join(out_dir, f"ledger_{rank}.pt"))


def test_topology_groups_sync_exchange_phases(tmp_path):
    spawn(_topology_worker, 4, str(tmp_path))
    ledgers = [torch.load(tmp_path / f"ledger_{r}.pt", weights_only=False) for r in range(4)]
    assert all(len(led) == len(ledgers[0]) for led in ledgers)


def test_weight_sync_timeout_message():
    from rlhf.distributed.weight_sync import WeightSyncTimeout, _wait

    class Stuck:
        def wait(self, timeout):
            raise RuntimeError("Timed out waiting 1000ms for recv")

    with pytest.raises(WeightSyncTimeout, match="did not join"):
        _wait(Stuck(), 1.0, "bucket of 3 tensors")


def test_bad_topology_fails_before_process_group(tiny_kit, monkeypatch):
    import torch.distributed as dist

    from rlhf.config import parse
    from rlhf.distributed import TopologyError
    from rlhf.rl.trainer import RLTrainer

    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = parse("grpo", ["--pretrain", tiny_kit, "--colocate_all_models", "--vllm_num_engines", "3",
                         "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
                         "--rollout_batch_size", "4", "--train_batch_size", "8"])
    with pytest.raises(TopologyError, match="must equal the actor ranks 4"):
        RLTrainer(cfg, "grpo")
    assert not dist.is_initialized()


def _fsdp_worker(rank, world, kit, out_dir):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlhf.checkpoint import save_hf
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    torch.manual_seed(0)
    ids = torch.randint(3, 100, (4, 12))

    def loss_of(model, x):
        out = model(input_ids=x, labels=x)
        return out.loss

    spec = EngineSpec(lr=1e-2, train_batch_size=4, micro_batch_size=1, total_steps=10, warmup_ratio=0.0,
                      scheduler="constant")
    eng = FSDP2Engine(AutoModelForCausalLM.from_pretrained(kit), spec)
    assert eng.accum_steps == 2
    ref = train_side_by_side(eng, lambda **kw: eng.model(**kw), kit, ids, rank)
    full = eng.full_state_dict()
    if rank == 0:
        worst = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items() if k in full)
        assert worst < 2e-5, worst
    # rank 1 builds on the meta device and receives its shards and buffers from rank 0: same model
    from rlhf.models.load import load_causal_lm

    fresh = FSDP2Engine(load_causal_lm(kit), spec)
    meta = FSDP2Engine(load_causal_lm(kit, on_meta=rank != 0), spec, load_on_first=True)
    assert not any(p.is_meta for p in meta.model.parameters())
    assert all(not b.is_meta for b in meta.model.buffers())
    with torch.no_grad():
        pos = torch.arange(12).expand(2, 12)
        assert torch.equal(meta.model(input_ids=ids[:2], position_ids=pos).logits,
                           fresh.model(input_ids=ids[:2], position_ids=pos).logits)
    # the critic (backbone + value head) takes the same path
    import copy

    from rlhf.models.critic import CriticModel

    critic = CriticModel.from_pretrained(kit, on_meta=rank != 0)
    plain = copy.deepcopy(critic) if rank == 0 else None
    ceng = FSDP2Engine(critic, spec, load_on_first=True)
    att = torch.ones(2, 12, dtype=torch.long)
    with torch.no_grad():
        values = ceng.model(ids[:2], att, 5)
        if rank == 0:
            assert torch.allclose(values, plain(ids[:2], att, 5), atol=1e-6)
    # offload / reload keeps parameters bit-identical
    local = [p.to_local().clone() for p in eng.model.parameters()]
    eng.sleep()
    eng.wake()
    assert all(torch.equal(a, p.to_local()) for a, p in zip(local, eng.model.parameters()))
    # checkpoint -> fresh engine -> identical next step
    ck = os.path.join(out_dir, "ck")
    eng.save_checkpoint(ck)
    dist.barrier()
    eng2 = FSDP2Engine(AutoModelForCausalLM.from_pretrained(kit), spec)
    eng2.load_checkpoint(ck)
    losses = []
    for e in (eng, eng2):
        mine = ids[rank * 2:(rank + 1) * 2]
        ls = []
        for i in range(2):
            loss = loss_of(e.model, mine[i:i + 1])
            ls.append(loss.item())
            e.backward(loss, i)
        e.step()
        ls.append(loss_of(e.model, mine[:1]).item())
        losses.append(ls)
    assert losses[0] == losses[1], losses
    # HF export reloads with the same logits
    full = eng.full_state_dict()
    x = ids[:2]
    with torch.no_grad():
        logits = eng.model(input_ids=x).logits
    if rank == 0:
        save_hf(full, eng.model, None, os.path.join(out_dir, "hf"))
    dist.barrier()
    re = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "hf"))
    with torch.no_grad():
        assert torch.allclose(re(input_ids=x).logits, logits, atol=1e-5)
    # load memory, accumulation memory, --bf16 precision, fused head on sharded weights (tests/helpers/fsdp_checks.py)
    from helpers.fsdp_checks import run_all

    run_all(rank, world, kit, out_dir)


def test_fsdp2_engine_matches_single_process_and_checkpoints(tiny_kit, tmp_path):
    spawn(_fsdp_worker, 2, tiny_kit, str(tmp_path))


def test_half_written_checkpoint_ignored(tmp_path):
    from rlhf.checkpoint import list_checkpoints, save_checkpoint

    save_checkpoint(str(tmp_path), 2, lambda d: None, {"step": 2})
    (tmp_path / ".tmp-global_step_4").mkdir()          # crash mid-save
    (tmp_path / "global_step_6").mkdir()               # renamed but no trainer state (foreign dir)
    assert list_checkpoints(str(tmp_path))[-1][1].endswith("global_step_2")
    for s in (3, 5, 7, 9):
        save_checkpoint(str(tmp_path), s, lambda d: None, {"step": s}, max_keep=2)
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("global_step") and
                   (p / "trainer_state.json").exists())
    assert names == ["global_step_7", "global_step_9"]


def test_weight_sync_merges_lora_under_engine_names(tiny_kit):
    import copy

    from rlhf.distributed.weight_sync import WeightSync, param_meta
    from rlhf.models.load import load_causal_lm

    peft_model = load_causal_lm(tiny_kit, lora_rank=4, lora_alpha=8)
    torch.manual_seed(3)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            p.data.normal_()  # peft starts B at 0; make the merge matter
    merged = copy.deepcopy(peft_model).merge_and_unload()
    engine = RecordingEngine(load_causal_lm(tiny_kit))

    class Plain:
        class plan:
            separate_rollout = False

    meta = param_meta(peft_model)
    assert [m[0] for m in meta] == [n for n, _ in engine.model.named_parameters()]
    WeightSync(Plain, engine, bucket_mb=0.01).sync(peft_model)
    for (n, p), (n2, q) in zip(engine.model.named_parameters(), merged.named_parameters()):
        assert n == n2 and torch.allclose(p, q, atol=1e-6), n
