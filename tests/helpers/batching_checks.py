"""Token-budget micro-batches (--use_dynamic_batch) and --adam_offload on 2 gloo ranks, run inside
tests/multiprocess/test_distributed.py's FSDP2 launch (tests/helpers/fsdp_checks.py ``run_all``).

* dynamic batching: one PPO actor step and one critic step on a batch of skewed lengths give the same loss and the
  same gradient as fixed-size micro-batches (1e-5), padded and packed; the plan has uneven micro-batch counts, so
  a rank runs a dummy forward, and the padding waste falls;
* --adam_offload (FSDP2 CPUOffloadPolicy): the sharded parameters, their gradients and AdamW's state are host
  tensors, the pin-memory flag is the one torch sets for this device, and the step equals the one without offload.
"""
from __future__ import annotations

import torch


def skewed_experience(P: int = 6, R: int = 12, seed: int = 0):
    """A Batch of 8 rows with left-padded prompts and right-padded responses: one row fills the whole width
    (6 + 12 = 18 tokens), the other seven hold 2-3 tokens each (19 together); random advantages / log-probs.
    Under an 18-token budget the long row is a rank's only row while the other rank needs two micro-batches."""
    from rlhf.batch import Batch

    g = torch.Generator().manual_seed(seed)
    shapes = [(P, R), (1, 2), (2, 1), (1, 2), (2, 1), (1, 2), (1, 1), (1, 1)]
    n = len(shapes)
    seq = torch.randint(3, 90, (n, P + R), generator=g)
    att = torch.zeros(n, P + R, dtype=torch.long)
    am = torch.zeros(n, R, dtype=torch.long)
    for i, (p, r) in enumerate(shapes):
        att[i, P - p:P + r] = 1
        am[i, :r] = 1
    seq = torch.where(att.bool(), seq, torch.zeros_like(seq))
    f = lambda: torch.randn(n, R, generator=g) * am  # noqa: E731
    return Batch(sequences=seq, attention_mask=att, action_mask=am, rollout_logprobs=f() - 2.0, old_logprobs=f() - 2.0,
                 ref_logprobs=f() - 2.0, values=f(), advantages=f(), returns=f(), scores=torch.zeros(n), prompt_len=P)


def update_role(cls, cfg, engine, dp_rank: int, dp_size: int):
    """An Actor or Critic over ``engine`` at data-parallel coordinates (dp_rank, dp_size), as build_roles makes it
    (rlhf.roles.base.model_role): for tests that drive one ``update``."""
    from rlhf.config.batching_checks import dynamic_budgets
    from rlhf.distributed.mesh import RoleMesh
    from rlhf.distributed.sequence_parallel import SP
    from rlhf.roles.update_batches import update_settings

    m = getattr(engine, "mesh", None)  # test code: stand-in engines have none
    sp = m.sp if m is not None else SP()
    mesh = RoleMesh(cls.__name__.lower(), list(range(dp_size * sp.size)), dp_rank * sp.size + sp.rank,
                    {"dp": dp_size, "sp": sp.size}, group=m.group if m is not None else None, sp=sp)
    settings = update_settings(cfg.optim, cfg.model, cfg.rollout, cfg.data.generate_max_len, dynamic_budgets(cfg)[0])
    role = cls(cls.__name__.lower(), mesh, cfg.algorithm, settings)
    role.engine = engine
    return role


def _config(packing: bool, dynamic: bool, budget: int):
    from rlhf.config.schema import TrainConfig

    cfg = TrainConfig()
    cfg.optim.train_batch_size, cfg.optim.micro_train_batch_size = 8, 2
    cfg.optim.use_dynamic_batch, cfg.optim.train_max_tokens_per_gpu = dynamic, budget
    cfg.model.packing_samples = packing
    cfg.algorithm.use_kl_loss, cfg.algorithm.kl_estimator = True, "k3"
    cfg.algorithm.entropy_loss_coef = 0.01
    cfg.data.generate_max_len = 12
    return cfg


def _grads_of_one_step(train, eng) -> tuple:
    """(the step's metrics, the full gradient of every parameter): ``eng.step`` captures and zeroes them instead
    of stepping, so the next call starts from the same weights."""
    got = {}

    def capture():
        got["g"] = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                    for p in eng.model.parameters() if p.grad is not None]
        eng.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": 0.0, "lr": 0.0}

    eng.step = capture
    try:
        out = train()
    finally:
        del eng.step
    return out, got["g"]


def _mean_over_ranks(v: float, world: int) -> float:
    import torch.distributed as dist

    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world


def check_dynamic_batch_equals_fixed(rank, world, kit):
    from rlhf.algorithms.seqlen_balancing import plan_step
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.critic import CriticModel
    from rlhf.models.load import load_causal_lm
    from rlhf.roles.actor import Actor
    from rlhf.roles.critic import Critic
    from rlhf.roles.update_batches import row_items

    exp = skewed_experience()
    budget = 18
    for packed in (False, True):
        _, micro = plan_step(row_items(exp.attention_mask, exp.action_mask), world, budget, packed)
        assert any(m is None for ms in micro for m in ms), \
            f"packed={packed}: the skewed batch should give one rank fewer micro-batches (a dummy forward): {micro}"
    spec = EngineSpec(lr=1e-3, train_batch_size=8, micro_batch_size=2, total_steps=2)
    eng = FSDP2Engine(load_causal_lm(kit), spec)
    for packed in (False, True):
        res = {}
        for dynamic in (False, True):
            cfg = _config(packed, dynamic, budget)
            res[dynamic] = _grads_of_one_step(lambda: update_role(Actor, cfg, eng, rank, world).update(exp, 0.1, 3),
                                              eng)
        (fixed, gf), (dyn, gd) = res[False], res[True]
        for k in ("policy_loss", "kl_loss", "entropy"):  # each rank logs its share x world: the mean is the value
            f, d = _mean_over_ranks(fixed[k], world), _mean_over_ranks(dyn[k], world)
            assert abs(f - d) < 1e-5, f"packed={packed}: {k} {d} with token budgets, {f} fixed"
        gap = max((a - b).abs().max().item() for a, b in zip(gf, gd))
        assert len(gf) == len(gd) and gap < 1e-5, f"packed={packed}: gradients differ by {gap} (token budgets vs fixed)"
        if not packed:
            assert dyn["padding_frac"] < fixed["padding_frac"], \
                f"token budgets should waste less on padding: {dyn['padding_frac']} vs {fixed['padding_frac']}"
    ceng = FSDP2Engine(CriticModel.from_pretrained(kit), spec)
    res = {}
    for dynamic in (False, True):
        cfg = _config(False, dynamic, budget)
        res[dynamic] = _grads_of_one_step(lambda: update_role(Critic, cfg, ceng, rank, world).update(exp, 0.0, 3),
                                          ceng)
    (fixed, gf), (dyn, gd) = res[False], res[True]
    f, d = _mean_over_ranks(fixed["value_loss"], world), _mean_over_ranks(dyn["value_loss"], world)
    assert abs(f - d) < 1e-5, f"critic value_loss {d} with token budgets, {f} fixed"
    gap = max((a - b).abs().max().item() for a, b in zip(gf, gd))
    assert gap < 1e-5, f"critic gradients differ by {gap} (token budgets vs fixed)"


def check_adam_offload(rank, world, kit):
    from torch.distributed.fsdp import FSDPModule

    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.load import load_causal_lm

    torch.manual_seed(1)
    ids = torch.randint(3, 100, (4, 10))
    params = {}
    for off in (False, True):
        spec = EngineSpec(lr=1e-2, train_batch_size=4, micro_batch_size=1, total_steps=2, adam_offload=off,
                          warmup_ratio=0.0, scheduler="constant")
        eng = FSDP2Engine(load_causal_lm(kit), spec)
        for step in range(2):
            for i in range(2):
                x = ids[2 * rank + i:2 * rank + i + 1]
                eng.backward(eng.model(input_ids=x, labels=x).loss, i)
            eng.step()
        fsdp = [m for m in eng.model.modules() if isinstance(m, FSDPModule)]
        groups = [m._get_fsdp_state()._fsdp_param_group for m in fsdp]
        flags = {(fp.offload_to_cpu, fp.pin_memory) for g in groups if g is not None for fp in g.fsdp_params}
        assert flags == {(off, False)}, f"adam_offload={off}: FSDP params' (offload_to_cpu, pin_memory) {flags}; " \
                                        f"want offload {off}, no pinning on a CPU-only machine"
        if off:
            devs = {p.to_local().device.type for p in eng.model.parameters()}
            state = {v.device.type for s in eng.optimizer.state.values() for v in s.values() if torch.is_tensor(v)}
            assert devs == {"cpu"} and state == {"cpu"}, f"--adam_offload: shards on {devs}, AdamW state on {state}"
            assert all(not p.to_local().is_pinned() for p in eng.model.parameters()), "pinned without an accelerator"
        params[off] = [p.full_tensor().clone() for p in eng.model.parameters()]
    gap = max((a - b).abs().max().item() for a, b in zip(params[False], params[True]))
    assert gap < 1e-6, f"--adam_offload changes the step: parameters differ by {gap}"


def run_all(rank, world, kit):
    check_dynamic_batch_equals_fixed(rank, world, kit)
    check_adam_offload(rank, world, kit)


def check_deepspeed_token_budgets(rank, world, kit, stage):
    """DeepSpeed with token budgets: the micro-batch count varies (here 2 on one rank, 1 + a dummy on the other),
    so DeepSpeed accumulates with accumulation 1 and the engine steps once.  One PPO actor step equals the fixed-size step: the same
    loss and gradient norm (1e-5), and the parameters moved once (AdamW moves each by at most ~lr per step)."""
    from transformers import AutoModelForCausalLM

    from rlhf.engines.deepspeed_engine import DeepSpeedEngine
    from rlhf.engines.train import EngineSpec
    from rlhf.roles.actor import Actor

    exp = skewed_experience()
    lr = 1e-3
    res, params = {}, {}
    for dynamic in (False, True):
        spec = EngineSpec(lr=lr, train_batch_size=8, micro_batch_size=2, total_steps=2, zero_stage=stage,
                          warmup_ratio=0.0, scheduler="constant", dynamic_batch=dynamic)
        eng = DeepSpeedEngine(AutoModelForCausalLM.from_pretrained(kit), spec)
        before = eng.full_state_dict()  # a collective: every rank calls it, rank 0 gets the tensors
        before = {k: v.clone() for k, v in before.items()} if rank == 0 else None
        res[dynamic] = update_role(Actor, _config(False, dynamic, 18), eng, rank, world).update(exp, 0.1, 3)
        after = eng.full_state_dict()
        if rank == 0:
            params[dynamic] = {k: after[k] - before[k] for k in before}
    for k in ("policy_loss", "kl_loss"):
        f, d = _mean_over_ranks(res[False][k], world), _mean_over_ranks(res[True][k], world)
        assert abs(f - d) < 1e-5, f"deepspeed stage {stage}: {k} {d} with token budgets, {f} fixed"
    gf, gd = res[False]["grad_norm"], res[True]["grad_norm"]
    assert abs(gf - gd) <= 1e-5 * max(gf, 1.0), f"deepspeed stage {stage}: grad norm {gd} with token budgets, {gf} fixed"
    if rank == 0:
        moved = max(v.abs().max().item() for v in params[True].values())
        assert 0 < moved < 1.5 * lr, f"deepspeed stage {stage}: token budgets moved a parameter by {moved} (lr {lr})"


def check_deepspeed_accumulates(rank, world, kit, stage):
    """Two micro-batches through ``engine.model`` (``ds.module``, as the trainers run them) accumulate: the step's
    gradient norm is that of the mean loss over every rank's rows, computed in one plain process.  (Under ZeRO-3
    with DeepSpeed 0.19 the second micro-batch used to overwrite the first: 2.05 for 3.20.)"""
    from transformers import AutoModelForCausalLM

    from rlhf.engines.deepspeed_engine import DeepSpeedEngine
    from rlhf.engines.train import EngineSpec

    torch.manual_seed(0)
    ids = torch.randint(3, 100, (2 * world, 10))
    plain = AutoModelForCausalLM.from_pretrained(kit)
    sum(plain(input_ids=ids[j:j + 1], labels=ids[j:j + 1]).loss for j in range(ids.size(0))).div(ids.size(0)).backward()
    want = torch.norm(torch.stack([p.grad.norm() for p in plain.parameters() if p.grad is not None])).item()
    for dynamic in (False, True):
        spec = EngineSpec(lr=1e-3, train_batch_size=2 * world, micro_batch_size=1, total_steps=2, zero_stage=stage,
                          warmup_ratio=0.0, scheduler="constant", dynamic_batch=dynamic)
        eng = DeepSpeedEngine(AutoModelForCausalLM.from_pretrained(kit), spec)
        for i in range(2):
            x = ids[2 * rank + i:2 * rank + i + 1]
            eng.backward(eng.model(input_ids=x, labels=x).loss, i, last=i == 1 if dynamic else None)
        got = eng.step()["grad_norm"]
        assert abs(got - want) < 1e-5 * want, \
            f"deepspeed stage {stage} (token budgets {dynamic}): grad norm {got} over 2 micro-batches, want {want}"
