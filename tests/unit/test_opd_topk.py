"""--opd_topk k (issue 46 item 1; OpenRLHF PR #1276's --opd.topk): the top-k forward KL by hand, the fused head's
log-probs of extra ids against the full softmax (values and gradients), the teacher's top-k and the student's
log-probs at those ids against the full logits (padded and packed), the refusals, and one GRPO step in process
whose loss carries the term (by value against the same micro-batch without it) and whose gradient reaches the
actor."""
import dataclasses
import math
import os
import shutil
from collections import defaultdict

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv):
    from rlhf.config.cli import parse
    from rlhf.train_grpo import GRPO_DEFAULTS

    return parse("grpo", argv, GRPO_DEFAULTS)


def test_topk_forward_kl_at_by_hand():
    from rlhf.algorithms import DISTILLATION
    from rlhf.algorithms.distill import topk_forward_kl, topk_forward_kl_at

    assert DISTILLATION["topk_forward_kl_at"] is topk_forward_kl_at
    t = torch.tensor([[[0.5, 0.3], [0.9, 0.05]]]).log()  # (1, 2, k=2) the teacher's top-2 probabilities
    s = torch.tensor([[[0.2, 0.4], [0.6, 0.3]]]).log()   # the student's probabilities of the same ids
    got = topk_forward_kl_at(s, t)
    # sum_k p_t (log p_t - log p_s) + tail_t (log tail_t - log tail_s), tails 1 - sum, by hand
    want0 = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.4)
    want1 = 0.9 * math.log(0.9 / 0.6) + 0.05 * math.log(0.05 / 0.3) + 0.05 * math.log(0.05 / 0.1)
    assert got.shape == (1, 2) and abs(float(got[0, 0]) - want0) < 1e-6 and abs(float(got[0, 1]) - want1) < 1e-6, got
    z = torch.randn(3, 5, 11)  # the full-logit form is the same function of the gathered log-probs
    ids = torch.randint(0, 11, (3, 5, 4))
    tl = torch.log_softmax(torch.randn(3, 5, 11), -1).gather(-1, ids)
    assert torch.allclose(topk_forward_kl(z, tl, ids), topk_forward_kl_at(torch.log_softmax(z, -1).gather(-1, ids), tl))


@pytest.mark.parametrize("keep,ent", [(0, False), (1 << 30, True)])
def test_head_logprobs_at_matches_the_full_softmax(keep, ent):
    from rlhf.models.lm_head import head_logprobs_at

    torch.manual_seed(3)
    N, H, V, k, T = 7, 5, 13, 3, 1.7
    h, w, b = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True), torch.randn(V, requires_grad=True)
    lab, ids = torch.randint(0, V, (N,)), torch.randint(0, V, (N, k))
    lp, e, x = head_logprobs_at(h, w, b, lab, ids, T, 2, ent, keep)  # chunks of 2 rows: 4 chunks, one short
    gl, gx, ge = torch.randn(N), torch.randn(N, k), torch.randn(N)
    got = torch.autograd.grad((lp * gl).sum() + (x * gx).sum() + ((e * ge).sum() if ent else 0), (h, w, b))
    full = torch.log_softmax((h @ w.T + b) / T, -1)
    assert torch.allclose(x, full.gather(-1, ids), atol=1e-5), "log-probs of the extra ids differ from log_softmax"
    assert torch.allclose(lp, full.gather(-1, lab[:, None])[:, 0], atol=1e-5)
    ref = (full.gather(-1, lab[:, None])[:, 0] * gl).sum() + (full.gather(-1, ids) * gx).sum()
    if ent:
        ref = ref + (-(full.exp() * full).sum(-1) * ge).sum()
    want = torch.autograd.grad(ref, (h, w, b))
    for name, g, r in zip("hwb", got, want):
        assert torch.allclose(g, r, atol=1e-5), f"gradient of {name}: {(g - r).abs().max()}"


@pytest.mark.parametrize("packing", [False, True])
def test_teacher_topk_and_student_at_ids_match_the_full_logits(packing):
    from rlhf.models.forward import action_logprobs
    from rlhf.models.topk_forward import action_logprobs_at, response_topk
    from tests.helpers.models import tiny_llama

    m = tiny_llama().float()
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, 128, (3, 9), generator=g)
    att = torch.ones_like(seq)
    att[0, :2], att[1, -2:] = 0, 0  # a short prompt, a short response
    am = att[:, -4:].clone()
    lab, top, ids = response_topk(m, seq, att, am, 5, 1.3, 2, packing)
    with torch.no_grad():
        full = torch.log_softmax(m(input_ids=seq, attention_mask=att, position_ids=(att.cumsum(1) - 1).clamp(min=0))
                                 .logits[:, -5:-1].float() / 1.3, -1)
    want_top, want_ids = full.topk(5, -1)
    on = am.bool()
    assert torch.equal(ids[on], want_ids[on]) and torch.allclose(top[on], want_top[on], atol=1e-5)
    assert float(top[~on].abs().sum()) == 0.0 and int(ids[~on].abs().sum()) == 0, "padding must read 0"
    sampled = action_logprobs(m, seq, att, 4, 1.3, 2)[0]
    assert torch.allclose(lab[on], sampled[on], atol=1e-5)
    lp, ent, at = action_logprobs_at(m, seq, att, am, ids, 1.3, 3, packing, with_entropy=True)
    assert torch.allclose(at[on], want_top[on], atol=1e-5) and torch.allclose(lp[on], sampled[on], atol=1e-5)
    at[on].sum().backward()
    assert float(m.lm_head.weight.grad.abs().sum()) > 0 and float(m.model.layers[0].mlp.up_proj.weight.grad.abs()
                                                                   .sum()) > 0, "no gradient through the top-k ids"


def test_opd_topk_refused_where_it_cannot_run():
    from rlhf.config.teacher_checks import check_topk
    from rlhf.errors import ConfigError

    base = ["--teacher_pretrain", "/nonexistent", "--remote_rm_url", "r.py"]
    for extra, says in ((["--opd_topk", "-1"], "k must be >= 0"),
                        (["--opd_topk", "4", "--teacher_url", "http://h:8000"], "local --teacher_pretrain"),
                        (["--opd_topk", "4", "--tp_size", "2"], "--tp_size 1")):
        cfg = _parse(base + extra)
        with pytest.raises(ConfigError, match="opd_topk") as e:
            check_topk(cfg, "grpo")
        assert says in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="kd_coef"):
        check_topk(_parse(base + ["--opd_topk", "4"]), "sft")
    check_topk(_parse(base + ["--opd_topk", "4"]), "grpo")  # runs


def _teacher(tmp_path) -> str:
    """The tiny kit with its LM head moved: a teacher whose top-k differs from the student's."""
    from transformers import AutoModelForCausalLM

    from rlhf.models.load import resolve_pretrain

    path = str(tmp_path / "teacher")
    shutil.copytree(resolve_pretrain(None), path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        w = model.get_output_embeddings().weight
        w.add_(torch.randn(w.shape, generator=g) * 8 * w.std())
    model.save_pretrained(path)
    return path


def test_grpo_step_with_opd_topk_in_process(monkeypatch, tmp_path):
    from rlhf.algorithms import DISTILLATION, aggregate
    from rlhf.rl import trainer as rl_trainer
    from rlhf.roles.actor import Actor

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    seen, checks = [], []
    reduce = rl_trainer.RLTrainer.reduce_metrics
    monkeypatch.setattr(rl_trainer.RLTrainer, "reduce_metrics", lambda self, m: seen.append(dict(m)) or reduce(self, m))
    micro_loss = Actor._micro_loss

    def check(self, mb, mr, tot, kl_coef, n_real, step, logs):
        out = micro_loss(self, mb, mr, tot, kl_coef, n_real, step, logs)
        if mr.real:
            # the same micro-batch as --opd_topk 0 gives it (no top-k fields), at the same parameters
            plain = micro_loss(self, dataclasses.replace(mb, teacher_topk_ids=None, teacher_topk_logprobs=None), mr,
                               tot, kl_coef, n_real, defaultdict(float), defaultdict(list))[0]
            model = self.engine.model
            R, att = mb.action_mask.size(1), mb.attention_mask
            logits = model(input_ids=mb.sequences, attention_mask=att,
                           position_ids=(att.cumsum(1) - 1).clamp(min=0)).logits[:, -R - 1:-1]  # full logits
            kl = DISTILLATION["topk_forward_kl"](logits, mb.teacher_topk_logprobs, mb.teacher_topk_ids)
            want = 0.5 * aggregate(kl, mb.action_mask.float(), self.algo.loss_agg_mode, 5.0, tot)
            head = model.get_output_embeddings().weight
            g_term = torch.autograd.grad(out[0] - plain, head, retain_graph=True)[0]
            g_want = torch.autograd.grad(want, head)[0]
            checks.append((float(out[0] - plain), float(want), float((g_term - g_want).abs().max()),
                           float(g_want.abs().max()), mb))
        return out

    monkeypatch.setattr(Actor, "_micro_loss", check)
    cfg = _parse(["--teacher_pretrain", _teacher(tmp_path), "--opd_topk", "4", "--opd_coef", "0.5",
                  "--rollout_engine", "hf", "--max_global_steps", "1", "--rollout_batch_size", "3",
                  "--n_samples_per_prompt", "2", "--train_batch_size", "6", "--micro_train_batch_size", "3",
                  "--micro_rollout_batch_size", "6", "--generate_max_len", "5", "--temperature", "1.0",
                  "--remote_rm_url", os.path.join(ROOT, "tests", "helpers", "varied_scores.py"),
                  "--save_path", str(tmp_path / "m"), "--log_dir", str(tmp_path / "logs"), "--no_progress_bar"])
    trainer = rl_trainer.run_rl(cfg, "grpo")
    names = [s.name for s in trainer.stages]
    # one teacher forward (its top-k stage stands in for the declared one) before the update
    assert trainer.step == 1 and names.count("teacher") == 1 and names.index("teacher") < names.index("actor_update")
    assert type(trainer.stages[names.index("teacher")]).__name__ == "TeacherTopkStage", names
    assert len(checks) == 2, f"expected 2 real micro-batches, got {len(checks)}"
    for diff, want, g_err, g_size, _ in checks:
        # the loss is the --opd_topk 0 loss plus 0.5 * the top-k KL from the full logits; its gradient reaches the head
        assert want > 1e-3 and abs(diff - want) < 1e-5 * max(1.0, want), (diff, want)
        assert g_size > 1e-4 and g_err < 1e-5 * max(1.0, g_size), (g_err, g_size)
    mb = checks[0][4]
    with torch.no_grad():  # the recorded ids are the teacher's top 4 (its full logits)
        att = mb.attention_mask
        t = trainer.roles.teacher.engine.model(input_ids=mb.sequences, attention_mask=att,
                                               position_ids=(att.cumsum(1) - 1).clamp(min=0)).logits[:, -6:-1]
    full = torch.log_softmax(t.float(), -1)
    top, ids = full.topk(4, -1)
    on = mb.action_mask.bool()
    sampled = full.gather(-1, mb.sequences[:, -5:, None])[..., 0]  # and its log-probs of the sampled tokens
    assert torch.allclose(sampled[on], mb.teacher_logprobs[on], atol=1e-5)
    assert torch.equal(ids[on], mb.teacher_topk_ids[on]) and torch.allclose(top[on], mb.teacher_topk_logprobs[on],
                                                                            atol=1e-5)
    assert seen[0]["opd/topk_kl"] > 1e-3 and "time_teacher" in seen[0] and "opd/reverse_kl" in seen[0], seen[0]
