"""Sequence parallelism (Ulysses, --ring_attn_size) on 2 gloo ranks (one launch): loss and every gradient with N=2
equal to N=1 for SFT, DPO, a GRPO/PPO actor step and a critic step.  The pure pieces, the flag's checks and the
placement's SP groups: tests/unit/test_sequence_parallel_layout.py."""
import copy

import torch
from helpers.mp import spawn
from helpers.tasks import make_task

TOL = 1e-5


# ---- 2 gloo ranks: N=2 equals N=1 -------------------------------------------------------------------------------
def _rollout(vocab, seed=0):
    """A padded rollout batch: left-padded prompts (slot 6), right-padded responses (slot 5); sample 2 has a long
    prompt and a 1-token response, so one SP slice of its rows holds no response token."""
    g = torch.Generator().manual_seed(seed)
    P, R = 6, 5
    plens, rlens = [3, 6, 6], [5, 2, 1]
    B = len(plens)
    seq = torch.zeros((B, P + R), dtype=torch.long)
    att = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(plens, rlens)):
        seq[i, P - p:P + r] = torch.randint(3, vocab, (p + r,), generator=g)
        att[i, P - p:P + r] = 1
    act = att[:, P:].clone()
    return seq, att, act


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_sp_equal(what, ref_loss, ref_grads, sp_loss, sp_model, world):
    """Loss identical on every SP rank and equal to N=1; the SP ranks' gradients sum to N x the N=1 gradient
    (each rank gets N x its slice's share from the sum's backward; the engines then average over all ranks)."""
    from rlhf.distributed import comm

    assert abs(float(sp_loss) - float(ref_loss)) < TOL, f"{what}: loss {float(sp_loss)} != N=1 {float(ref_loss)}"
    got = _grads(sp_model)
    assert set(got) == set(ref_grads), f"{what}: parameters with gradients differ: {set(got) ^ set(ref_grads)}"
    for n, g in got.items():
        comm.all_reduce(g)
        g /= world
        err = float((g - ref_grads[n]).abs().max())
        assert err < TOL, f"{what}: gradient of {n} differs from N=1 by {err}"


def _core_checks(rank, world, kit):
    """Model-level: each forward of rlhf.models.forward with SP against the same forward on the whole row."""
    from transformers import AutoModelForCausalLM

    from rlhf.algorithms.preference import dpo_loss, sft_token_loss
    from rlhf.data.formatting import collate_packed
    from rlhf.distributed import comm
    from rlhf.distributed.sequence_parallel import SP, attach
    from rlhf.models.critic import CriticModel
    from rlhf.models.forward import packed_action_logprobs
    from rlhf.supervised.tasks import token_logprobs

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(kit, attn_implementation="sdpa", dtype=torch.float32)
    vocab = base.config.vocab_size
    seq, att, act = _rollout(vocab)
    w = torch.randn(act.shape, generator=torch.Generator().manual_seed(1))

    def sp_copy(m):
        return attach(copy.deepcopy(m), SP(world, rank, comm.world_group()))

    # actor: log-probs and entropy of the response tokens, fused head and plain head, with/without checkpointing
    for fused, ckpt in ((True, False), (False, False), (True, True)):
        ref = copy.deepcopy(base)
        if ckpt:
            ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ref.train()
        sp = sp_copy(ref)

        def loss_of(m):
            lp, ent = packed_action_logprobs(m, seq, att, act, 0.7, 64, with_entropy=True, fused=fused)
            return (lp * w * act).sum() + 0.1 * (ent * act).sum()

        lr = loss_of(ref)
        lr.backward()
        ls = loss_of(sp)
        ls.backward()
        _assert_sp_equal(f"actor fused={fused} ckpt={ckpt}", lr, _grads(ref), ls, sp, world)

    # SFT and DPO: packed [chosen..., rejected...] rows with a loss mask on the responses
    g = torch.Generator().manual_seed(2)
    samples = []
    for n_p, n_r in ((4, 5), (7, 2), (3, 6), (5, 3)):
        ids = torch.randint(3, vocab, (n_p + n_r,), generator=g).tolist()
        samples.append((ids, [0] * n_p + [1] * n_r))
    batch = collate_packed(samples)
    lm = batch["loss_mask"].clone()
    lm[0, 1:][batch["segment_ids"][0, 1:] != batch["segment_ids"][0, :-1]] = 0
    batch["loss_mask"] = lm
    ref, sp = copy.deepcopy(base), sp_copy(base)
    lr = sft_token_loss(token_logprobs(ref, batch, 64), batch["loss_mask"][:, 1:])
    lr.backward()
    ls = sft_token_loss(token_logprobs(sp, batch, 64), batch["loss_mask"][:, 1:])
    ls.backward()
    _assert_sp_equal("sft", lr, _grads(ref), ls, sp, world)

    def dpo_of(m):
        lp = token_logprobs(m, batch, 64)
        mask = batch["loss_mask"][:, 1:].float()
        seg = batch["segment_ids"][0, 1:]
        sums = torch.zeros(4).index_add(0, seg, (lp * mask)[0])
        losses, _, _ = dpo_loss("sigmoid", sums[:2], sums[2:], sums[:2].detach() * 0.9, sums[2:].detach() * 1.1,
                                0.1, 0.0)
        return losses.mean()

    ref, sp = copy.deepcopy(base), sp_copy(base)
    lr = dpo_of(ref)
    lr.backward()
    ls = dpo_of(sp)
    ls.backward()
    _assert_sp_equal("dpo", lr, _grads(ref), ls, sp, world)

    # critic: padded forward at N=1 (CriticModel's own path), packed slices at N=2
    from transformers import AutoModel

    torch.manual_seed(3)
    crit = CriticModel(AutoModel.from_pretrained(kit, attn_implementation="sdpa", dtype=torch.float32),
                       base.config.hidden_size)
    csp = sp_copy(crit)
    tgt = torch.randn(act.shape, generator=torch.Generator().manual_seed(4))
    lr = (((crit(seq, att, act.size(1)) - tgt) ** 2) * act).sum()
    lr.backward()
    ls = (((csp(seq, att, act.size(1)) - tgt) ** 2) * act).sum()
    ls.backward()
    _assert_sp_equal("critic", lr, _grads(crit), ls, csp, world)


class _GradTap:
    """Records the full gradients an engine steps with (FSDP2 shards gathered; a collective on every rank)."""

    def __init__(self, engine):
        self.grads, self._step = [], engine.step

        def step():
            full = {}
            for n, p in engine.model.named_parameters():
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    full[n] = g.detach().clone()
            self.grads.append(full)
            return self._step()

        engine.step = step


def _assert_same_steps(what, a, b):
    assert len(a) == len(b) > 0, f"{what}: {len(a)} optimizer steps at N=1, {len(b)} at N=2"
    for k, (ga, gb) in enumerate(zip(a, b)):
        assert set(ga) == set(gb), f"{what}: step {k}: parameters with gradients differ"
        for n in ga:
            err = float((ga[n] - gb[n]).abs().max())
            assert err < TOL, f"{what}: step {k}: gradient of {n} at N=2 differs from N=1 by {err}"


def _engine(cfg, model, sp_size, rank, world, lr=1e-3):
    from rlhf.distributed import comm
    from rlhf.distributed.mesh import RoleMesh
    from rlhf.distributed.sequence_parallel import SP, attach
    from rlhf.engines.train import spec_from_config
    from rlhf.engines.train_registry import make_engine

    mesh = RoleMesh("actor", list(range(world)), rank, {"dp": world // sp_size, "sp": sp_size},
                    group=comm.world_group(), sp=SP(sp_size, rank % sp_size, comm.world_group()))
    eng = make_engine("fsdp2", model, spec_from_config(cfg.model, cfg.optim, cfg.topology, lr, 4), mesh=mesh)
    if sp_size > 1:
        attach(eng.model, mesh.sp)
    return eng, _GradTap(eng)


def _engine_checks(rank, world, kit):
    """Trainer-level on FSDP2 over both ranks: N=1 is 2 data-parallel ranks, N=2 one SP group; the optimizer
    steps' full gradients (after FSDP2's reduce-scatter) and the logged losses must agree."""
    from helpers.batching_checks import update_role
    from transformers import AutoModel, AutoModelForCausalLM

    from rlhf.batch import Batch
    from rlhf.config import parse
    from rlhf.distributed.sequence_parallel import dp_coords
    from rlhf.models.critic import CriticModel
    from rlhf.roles.actor import Actor
    from rlhf.roles.critic import Critic
    from rlhf.supervised.tasks import DPOTask, SFTTask

    def lm():
        return AutoModelForCausalLM.from_pretrained(kit, attn_implementation="sdpa", dtype=torch.float32)

    # GRPO/PPO actor (clipped ratio, k3 KL loss, entropy bonus) and critic: 4 rows, 2 micro-batches of 1 per step
    seq, att, act = _rollout(lm().config.vocab_size, seed=5)
    seq, att, act = torch.cat([seq, seq.flip(0)[:1]]), torch.cat([att, att.flip(0)[:1]]), torch.cat([act, act.flip(0)[:1]])
    g = torch.Generator().manual_seed(6)
    old = -torch.rand(act.shape, generator=g) * act
    exp = Batch(sequences=seq, attention_mask=att, action_mask=act, rollout_logprobs=old, old_logprobs=old,
                ref_logprobs=old + 0.05 * torch.randn(act.shape, generator=g) * act,
                values=torch.randn(act.shape, generator=g) * act, advantages=torch.randn(act.shape, generator=g) * act,
                returns=torch.randn(act.shape, generator=g) * act, scores=torch.zeros(4))
    rl = ["--pretrain", kit, "--packing_samples", "--train_batch_size", "4", "--micro_train_batch_size", "1",
          "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--use_kl_loss", "--init_kl_coef", "0.01",
          "--entropy_loss_coef", "0.01", "--advantage_estimator", "gae"]
    out = {}
    for n in (1, 2):
        cfg = parse("ppo", rl + ["--ring_attn_size", str(n)])
        dp, dps, _ = dp_coords(rank, world, n)
        torch.manual_seed(0)
        eng, tap = _engine(cfg, lm(), n, rank, world)
        met = update_role(Actor, cfg, eng, dp, dps).update(exp, 0.01, step=3)
        torch.manual_seed(0)
        ceng, ctap = _engine(cfg, CriticModel(AutoModel.from_pretrained(kit, attn_implementation="sdpa",
                                                                        dtype=torch.float32), 64), n, rank, world)
        cmet = update_role(Critic, cfg, ceng, dp, dps).update(exp, 0.0, step=3)
        out[n] = (tap.grads, met, ctap.grads, cmet)
    _assert_same_steps("actor step", out[1][0], out[2][0])
    _assert_same_steps("critic step", out[1][2], out[2][2])
    from rlhf.distributed import comm

    def mean_over_ranks(v):  # what the trainer logs: every rank's value averaged (each rank holds its share x DP)
        t = torch.tensor([float(v)], dtype=torch.float64)
        return float(comm.all_reduce(t)) / world

    for i, k in ((1, "policy_loss"), (1, "kl_loss"), (1, "entropy"), (3, "value_loss")):
        a, b = mean_over_ranks(out[1][i][k]), mean_over_ranks(out[2][i][k])
        assert abs(a - b) < TOL, f"logged {k}: N=1 {a} vs N=2 {b}"

    # SFT and DPO through their tasks, rows split as SupervisedTrainer.batches_for does (DP coordinates)
    from rlhf.distributed import shard_rows

    g = torch.Generator().manual_seed(7)

    def pair(n_p, n_r):
        ids = torch.randint(3, 200, (n_p + n_r,), generator=g).tolist()
        return ids, [0] * n_p + [1] * n_r

    sft_rows = [pair(3 + i, 2 + (i * 3) % 5) for i in range(4)]
    dpo_rows = [(pair(4, 2 + i), pair(4, 5 - i), (-3.0 - i, -4.0 + i)) for i in range(4)]
    for kind, task_cls, rows in (("sft", SFTTask, sft_rows), ("dpo", DPOTask, dpo_rows)):
        grads = {}
        for n in (1, 2):
            cfg = parse(kind, ["--pretrain", kit, "--packing_samples", "--train_batch_size", "4",
                               "--micro_train_batch_size", "1", "--ring_attn_size", str(n)])
            task = make_task(task_cls, cfg, None)
            task.ref = None  # DPO: the rows carry reference log-probs
            dp, dps, _ = dp_coords(rank, world, n)
            torch.manual_seed(0)
            eng, tap = _engine(cfg, lm(), n, rank, world)
            mine = rows[shard_rows(4, dp, dps)]
            for i, r in enumerate(mine):
                loss, _ = task.loss(eng.model, [r])
                eng.backward(loss, i)
            eng.step()
            grads[n] = tap.grads
        _assert_same_steps(f"{kind} step", grads[1], grads[2])


def _reward_check(rank, world, kit):
    """PPO's reward role: the reward model's scores at each sequence's last token, N=2 vs N=1 (no gradient)."""
    from rlhf.distributed import comm
    from rlhf.distributed.sequence_parallel import SP, attach
    from rlhf.models.load import load_reward_model
    from rlhf.rewards.reward_model import score_sequences

    rm, stats = load_reward_model(f"{kit}/reward", False, False)
    seq, att, _ = _rollout(rm.config.vocab_size, seed=8)
    want = score_sequences(rm, seq, att, stats)
    got = score_sequences(attach(copy.deepcopy(rm), SP(world, rank, comm.world_group())), seq, att, stats)
    err = float((got - want).abs().max())
    assert err < TOL, f"reward scores at N=2 differ from N=1 by {err}: {got} vs {want}"


class _StandInFlash:
    """A stand-in ``flash_attn`` package (causal attention by torch sdpa, per varlen sample) found by transformers'
    real lookup: ``lazy_import_flash_attention("flash_attention_2")`` imports ``flash_attn`` when
    ``is_flash_attn_2_available()`` (transformers/modeling_flash_attention_utils.py ``_lazy_imports``).  Records
    the varlen calls' arguments; refuses the dense entry point (a packed row must take the varlen path)."""

    def __init__(self):
        import types

        from transformers import modeling_flash_attention_utils as mfu

        self.mfu, self.calls, self.saved = mfu, [], {}
        pkg = types.ModuleType("flash_attn")
        pkg.__version__ = "2.8.3"
        pkg.flash_attn_varlen_func = self.varlen
        pkg.flash_attn_func = self.dense
        pkg.flash_attn_with_kvcache = self.dense
        pad = types.ModuleType("flash_attn.bert_padding")
        pad.pad_input, pad.unpad_input = mfu._pad_input, mfu._unpad_input
        self.modules = {"flash_attn": pkg, "flash_attn.bert_padding": pad}

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
               softmax_scale=None, causal=False):
        self.calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), cu_q=cu_seqlens_q.tolist(),
                               cu_k=cu_seqlens_k.tolist(), max_q=int(max_seqlen_q), causal=causal))
        out, cu = [], cu_seqlens_q.tolist()
        for a, b in zip(cu, cu[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out.append(torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=causal, scale=softmax_scale, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(out)

    def dense(self, *a, **k):
        raise AssertionError("the stand-in flash kernel's dense entry point was called for a packed row")

    def __enter__(self):
        import sys

        for name, mod in self.modules.items():
            self.saved[name] = sys.modules.get(name)
            sys.modules[name] = mod
        self.saved["avail"], self.saved["loaded"] = self.mfu.is_flash_attn_2_available, self.mfu._loaded_implementation
        self.mfu.is_flash_attn_2_available, self.mfu._loaded_implementation = (lambda: True), None
        return self

    def __exit__(self, *exc):
        import sys

        for name in self.modules:
            if self.saved[name] is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = self.saved[name]
        self.mfu.is_flash_attn_2_available, self.mfu._loaded_implementation = self.saved["avail"], self.saved["loaded"]


def _flash_check(rank, world, kit):
    """--ring_attn_size with flash attention: the Ulysses path keeps ``flash_attention_2`` (transformers'
    flash_attention_forward loads the kernel by ``config._attn_implementation``: transformers/integrations/
    flash_attention.py, modeling_flash_attention_utils.py ``lazy_import_flash_attention``; a renamed implementation
    is looked up as a hub kernel and fails) and reaches the kernel with the full row's varlen arguments: the
    gathered sequence, this rank's head group, cu_seqlens at the packed samples' starts (veRL all-gathers the
    position ids for the same reason: verl/models/transformers/monkey_patch.py ``_ulysses_flash_attention_forward``).
    Log-probs equal the unsplit sdpa model's."""
    from transformers import AutoModelForCausalLM

    from rlhf.distributed import comm
    from rlhf.distributed.sequence_parallel import SP, attach, pad_packed, segments
    from rlhf.models.forward import pack, packed_action_logprobs

    base = AutoModelForCausalLM.from_pretrained(kit, attn_implementation="sdpa", dtype=torch.float32)
    seq, att, act = _rollout(base.config.vocab_size, seed=9)
    with torch.no_grad():
        want = packed_action_logprobs(base, seq, att, act, 1.0, 64)
    flash = copy.deepcopy(base)
    flash.config._attn_implementation = "flash_attention_2"
    with _StandInFlash() as kernel, torch.no_grad():
        attach(flash, SP(world, rank, comm.world_group()))
        got = packed_action_logprobs(flash, seq, att, act, 1.0, 64)
    assert flash.config._attn_implementation == "flash_attention_2", \
        f"attach renamed the attention implementation to {flash.config._attn_implementation!r}"
    cfg = base.config
    layers, heads, kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    assert len(kernel.calls) == layers, f"stand-in flash kernel called {len(kernel.calls)} times, want {layers}"
    ids, pos, _ = pack(seq, att)
    _, pos = pad_packed(ids, pos, world)
    T = pos.size(1)
    cu = [a for a, _ in segments(pos)] + [T]
    for c in kernel.calls:
        assert c["q"][:2] == (T, heads // world) and c["k"][:2] == (T, kv // world), \
            f"varlen call on q {c['q']} k {c['k']}: want the whole row ({T} tokens) and {heads // world} heads"
        assert c["cu_q"] == cu and c["cu_k"] == cu, f"cu_seqlens {c['cu_q']}, want the packed samples' {cu}"
        assert c["max_q"] == max(b - a for a, b in zip(cu, cu[1:])) and c["causal"], f"varlen call {c}"
    err = float((got - want).abs().max())
    assert err < TOL, f"log-probs through the stand-in flash kernel at N={world} differ from sdpa N=1 by {err}"


def _sp_worker(rank, world, kit):
    _flash_check(rank, world, kit)
    _core_checks(rank, world, kit)
    _reward_check(rank, world, kit)
    _engine_checks(rank, world, kit)


def test_sp2_equals_sp1_on_two_gloo_ranks(tiny_kit):
    spawn(_sp_worker, 2, tiny_kit)
