"""OpenRLHF parity across ranks: a step split into micro-batches and data-parallel ranks has the loss and gradient
of one full-batch computation."""

import torch
from helpers.mp import spawn

from rlhf.config import TrainConfig

# ---- 2 ranks x 2 micro-batches == one full batch: L = sum over ranks and micro-batches of sum(l m) / N_step ----------
# OpenRLHF: openrlhf/models/utils.py masked_mean, openrlhf/trainer/ray/ppo_actor.py (accumulation)

def _two_rank_worker(rank, world, kit):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlhf.algorithms import aggregate, compute_kl
    from rlhf.algorithms.policy_loss import ppo_clip_loss
    from rlhf.batch import Batch
    from rlhf.config.batching_checks import dynamic_budgets
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.forward import action_logprobs
    from rlhf.roles.actor import Actor
    from rlhf.roles.update_batches import step_totals, update_settings

    # the count is one collective that every rank runs, also with an empty shard
    tot = step_totals([torch.ones(2, 3)] if rank == 0 else [], None)
    assert (tot.tokens, tot.seqs) == (6.0, 2.0), tot

    torch.manual_seed(0)
    B, P, R = 8, 3, 5
    vocab = AutoModelForCausalLM.from_pretrained(kit).config.vocab_size
    seqs = torch.randint(3, vocab, (B, P + R))
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])      # uneven responses: micro-batches differ in tokens
    amask = (torch.arange(R)[None] < lengths[:, None]).long()
    attn = torch.cat([torch.ones(B, P, dtype=torch.long), amask], 1)
    adv = torch.randn(B, R) * amask
    plain = AutoModelForCausalLM.from_pretrained(kit)
    with torch.no_grad():
        lp0, _ = action_logprobs(plain, seqs, attn, R)
    old = (lp0 + 0.3 * torch.randn(B, R)) * amask        # ratios away from 1: clipping happens
    ref = (lp0 - 0.2 * torch.randn(B, R)) * amask
    exp = Batch(sequences=seqs, attention_mask=attn, action_mask=amask, rollout_logprobs=old.clone(), old_logprobs=old,
                ref_logprobs=ref, advantages=adv, returns=adv, scores=torch.zeros(B), prompt_len=P)

    cfg = TrainConfig()
    cfg.optim.train_batch_size, cfg.optim.micro_train_batch_size, cfg.optim.max_epochs = 8, 2, 1
    cfg.data.generate_max_len = R
    a = cfg.algorithm
    a.use_kl_loss, a.kl_estimator, a.entropy_loss_coef, a.clip_eps_low, a.clip_eps_high = True, "k3", 0.01, 0.2, 0.2
    eng = FSDP2Engine(AutoModelForCausalLM.from_pretrained(kit),
                      EngineSpec(lr=0.0, train_batch_size=8, micro_batch_size=2, total_steps=10, warmup_ratio=0.0))
    assert eng.accum_steps == 2
    captured = {}
    real_step = eng.step

    def step():
        captured["g"] = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                         for n, p in eng.model.named_parameters()}
        return real_step()

    eng.step = step
    for mode in ("token-mean", "seq-mean-token-mean"):
        a.loss_agg_mode = mode
        settings = update_settings(cfg.optim, cfg.model, cfg.rollout, cfg.data.generate_max_len, dynamic_budgets(cfg)[0])
        actor = Actor("actor", eng.mesh, cfg.algorithm, settings)
        actor.engine = eng
        logs = actor.update(exp, kl_coef=0.1, step=0)
        every = [None] * world
        dist.all_gather_object(every, logs["policy_loss"])
        step_loss = sum(every) / world                     # what rl_trainer logs (mean over ranks)
        # one full-batch computation on one process
        plain.zero_grad()
        lp, ent = action_logprobs(plain, seqs, attn, R, with_entropy=True, entropy_grad=True)
        m = amask.float()
        pl, _ = ppo_clip_loss(lp, old, adv, m, agg_mode=mode, norm_const=float(R))
        total = (pl - 0.01 * aggregate(ent, m, "token-mean")
                 + 0.1 * aggregate(compute_kl("k3", lp, ref, m), m, mode, float(R)))
        total.backward()
        assert abs(step_loss - float(pl)) < 1e-5, (mode, step_loss, float(pl))
        worst = max(float((captured["g"][n] - p.grad).abs().max()) for n, p in plain.named_parameters())
        scale = max(float(p.grad.abs().max()) for p in plain.parameters())
        assert worst < 1e-5 * max(1.0, scale), (mode, worst, scale)
        if mode == "token-mean":  # the old per-micro-batch mean differs here by far more than the tolerance
            per_mb = []
            for rows in ([0, 1], [2, 3], [4, 5], [6, 7]):
                per_mb.append(ppo_clip_loss(lp[rows], old[rows], adv[rows], m[rows], agg_mode=mode)[0])
            assert abs(float(sum(per_mb) / 4) - float(pl)) > 1e-3


def test_two_ranks_two_micro_batches_equal_one_full_batch(tiny_kit):
    spawn(_two_rank_worker, 2, tiny_kit)
