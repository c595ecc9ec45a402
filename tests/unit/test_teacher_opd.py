"""The teacher role and on-policy distillation (issue 46 item 1): the per-token reward by hand, the top-k and KD
terms by hand, the placement (colocated / own ranks), the vocabulary check before any process group, OpenRLHF
PR #1276's dotted names, the memory planner, and one GRPO step with OPD in process."""
import math
import os

import pytest
import torch

from rlhf.distributed.placement import job_role_needs, make_placement

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv):
    from rlhf.config.cli import parse
    from rlhf.train_grpo import GRPO_DEFAULTS

    return parse("grpo", argv, GRPO_DEFAULTS)


def test_opd_reward_by_hand():
    from rlhf.algorithms import DISTILLATION, opd_token_reward, reverse_kl_per_token

    s = torch.tensor([[-0.25, -1.5, -3.0, -0.7, -2.2], [-0.01, -4.0, -0.3, -9.0, -1.1], [-2.0, -2.0, -2.0, -2.0, -2.0]])
    t = torch.tensor([[-0.5, -1.0, -2.75, -5.0, -0.2], [-0.02, -3.5, -0.9, -0.1, -0.1], [-1.0, -3.0, -2.0, -2.5, -7.0]])
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    got = DISTILLATION["opd_reward"](s, t, m)
    assert DISTILLATION["opd_reward"] is opd_token_reward
    # r = -(s - t) = t - s on the mask, by hand
    want = [[-0.25, 0.5, 0.25, 0.0, 0.0], [-0.01, 0.5, -0.6, 8.9, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0]]
    for i in range(3):
        for j in range(5):
            assert abs(float(got[i, j]) - want[i][j]) < 1e-6, (i, j, float(got[i, j]), want[i][j])
    kl = -11.29 / 9  # 9 masked tokens, sum of (s - t) = -(0.5 + 9.79 + 1.0)
    assert abs(reverse_kl_per_token(s, t, m) - kl) < 1e-6


def test_topk_forward_kl_and_kd_by_hand():
    from rlhf.algorithms import kd_forward_kl, topk_forward_kl

    zs = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]])  # one position, V = 5
    zt = torch.tensor([[0.0, 3.0, -2.0, 1.0, 0.0]])
    ps = [math.exp(z) / sum(math.exp(v) for v in zs[0].tolist()) for z in zs[0].tolist()]
    pt = [math.exp(z) / sum(math.exp(v) for v in zt[0].tolist()) for z in zt[0].tolist()]
    top = [1, 3]  # the teacher's two largest
    kl = sum(pt[v] * (math.log(pt[v]) - math.log(ps[v])) for v in top)
    tt, ts = 1 - pt[1] - pt[3], 1 - ps[1] - ps[3]
    kl += tt * (math.log(tt) - math.log(ts))
    lt = torch.log_softmax(zt, -1)
    got = topk_forward_kl(zs, lt[:, top], torch.tensor([top]))
    assert abs(float(got[0]) - kl) < 1e-6, (float(got[0]), kl)
    # with every token "top", the tail is empty and this is the full forward KL; the KD loss averages it on the mask
    full = sum(pt[v] * (math.log(pt[v]) - math.log(ps[v])) for v in range(5))
    assert abs(float(kd_forward_kl(zs[None], zt[None], torch.ones(1, 1))) - full) < 1e-6
    z2 = torch.stack([zs, zt], 1)  # (1, 2, V): the second position (student == teacher) has KL 0
    assert abs(float(kd_forward_kl(z2, torch.stack([zt, zt], 1), torch.ones(1, 2))) - full / 2) < 1e-6


def test_teacher_placement_colocated_and_own_ranks():
    base = ["--teacher_pretrain", "t", "--remote_rm_url", "r.py", "--n_samples_per_prompt", "2",
            "--train_batch_size", "16"]
    cfg = _parse(base)
    assert cfg.teacher.teacher_pretrain == "t" and not hasattr(cfg.model, "teacher_pretrain")
    plan = make_placement(cfg.topology, 2, **job_role_needs(cfg))
    assert plan.ranks["teacher"] == plan.ranks["actor"] == [0, 1], plan.ranks
    cfg = _parse(base + ["--teacher_num_gpus_per_node", "1"])
    plan = make_placement(cfg.topology, 3, **job_role_needs(cfg))
    assert plan.ranks["actor"] == [0, 1] and plan.ranks["teacher"] == [2], plan.ranks
    # behind a server no rank holds it
    cfg = _parse(base + ["--teacher_url", "http://h:1"])
    assert make_placement(cfg.topology, 2, **job_role_needs(cfg)).ranks["teacher"] == []
    cfg.teacher.teacher_pretrain = cfg.teacher.teacher_url = None
    assert make_placement(cfg.topology, 2, **job_role_needs(cfg)).ranks["teacher"] == []


def test_openrlhf_pr1276_dotted_names():
    cfg = _parse(["--teacher.model_name_or_path", "tdir", "--opd.topk", "3", "--teacher.num_gpus_per_node", "2",
                  "--remote_rm_url", "r.py"])
    assert (cfg.teacher.teacher_pretrain, cfg.teacher.opd_topk, cfg.topology.teacher_num_gpus_per_node) == \
        ("tdir", 3, 2)


def _other_vocab_kit(tmp_path):
    """The tiny kit's model config with its tokenizer plus two tokens (another vocabulary, one size larger)."""
    import shutil

    from rlhf.models.load import load_tokenizer, resolve_pretrain

    kit = resolve_pretrain(None)
    d = tmp_path / "teacher"
    d.mkdir()
    shutil.copy(os.path.join(kit, "config.json"), d / "config.json")
    tok = load_tokenizer(kit)
    tok.add_tokens(["<|teacher_a|>", "<|teacher_b|>"])
    tok.save_pretrained(str(d))
    return kit, str(d)


def test_mismatched_vocabulary_refused_before_any_process_group(tmp_path):
    import torch.distributed as dist

    from rlhf.config.preflight import preflight
    from rlhf.errors import ConfigError

    kit, teacher = _other_vocab_kit(tmp_path)
    cfg = _parse(["--teacher_pretrain", teacher, "--remote_rm_url", "builtin:arithmetic",
                  "--save_path", str(tmp_path / "m")])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, "grpo", 1)
    msg = str(e.value)
    assert e.value.flag == "teacher_pretrain" and "tokens" in msg and "token id" in msg and teacher in msg, msg
    assert not dist.is_initialized()
    cfg.teacher.teacher_pretrain = kit  # the same tokenizer passes
    from rlhf.config.teacher_checks import check_teacher

    check_teacher(cfg, "grpo")
    cfg.teacher.opd_topk = 2
    check_teacher(cfg, "grpo")  # the top-k term runs in RL (tests/unit/test_opd_topk.py); SFT has --kd_coef
    with pytest.raises(ConfigError, match="opd_topk 0"):
        check_teacher(cfg, "sft")
    cfg.teacher.opd_topk, cfg.teacher.teacher_url, cfg.rollout.temperature = 0, "http://h:1", 0.7
    with pytest.raises(ConfigError, match="temperature 1.0"):  # vLLM's prompt log-probs are at temperature 1
        check_teacher(cfg, "grpo")
    with pytest.raises(ConfigError, match="teacher_pretrain"):  # SFT distills from a local teacher only
        check_teacher(cfg, "sft")


def test_the_memory_planner_plans_the_teachers_forward():
    from rlhf.config.schema import TopologyConfig
    from rlhf.planning.dims import ModelDims
    from rlhf.planning.memory import Job, plan_memory

    dims = ModelDims(hidden=8, layers=3, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=50, tied=False)
    big = ModelDims(hidden=64, layers=5, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=50, tied=False)
    placement = make_placement(TopologyConfig(), 1, need_ref=True, need_teacher=True)
    small = plan_memory(Job(kind="rl", rollout_engine="hf"), {"actor": dims}, placement, on_cuda=False)
    planned = [s.name for s in small.groups[0].stages]
    assert planned.index("ref") < planned.index("teacher") < planned.index("actor_update"), planned
    # a larger teacher's dimensions (from its --teacher_pretrain config) make its forward the larger one
    plan = plan_memory(Job(kind="rl", rollout_engine="hf"), {"actor": dims, "teacher": big}, placement, on_cuda=False)
    by = {s.name: s.total for s in plan.groups[0].stages}
    assert by["teacher"] > {s.name: s.total for s in small.groups[0].stages}["teacher"], by
    # the teacher's dimensions come from --teacher_pretrain (the teacher flag group), not the model group's
    from rlhf.distributed.placement import flag_groups
    from rlhf.models.load import resolve_pretrain
    from rlhf.planning import role_dims

    cfg = _parse(["--teacher_pretrain", resolve_pretrain(None), "--remote_rm_url", "r.py"])
    assert "teacher" in role_dims(cfg.model, **flag_groups(cfg)) and "teacher" not in role_dims(cfg.model)


def test_grpo_step_with_opd_in_process(monkeypatch, tmp_path):
    from rlhf.models.load import resolve_pretrain
    from rlhf.rl import trainer as rl_trainer
    from rlhf.rl.opd import OPDStage

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    seen, checks = [], []
    reduce = rl_trainer.RLTrainer.reduce_metrics
    monkeypatch.setattr(rl_trainer.RLTrainer, "reduce_metrics", lambda self, m: seen.append(dict(m)) or reduce(self, m))
    run = OPDStage.run

    def check(self, batch, roles):  # the stage adds coef * -(behaviour - teacher) on the mask to the advantages
        before = batch.advantages.clone()
        run(self, batch, roles)
        m = batch.action_mask.float()
        want = before + 0.5 * -(batch.rollout_logprobs - batch.teacher_logprobs) * m
        checks.append(float((batch.advantages - want).abs().max()))

    monkeypatch.setattr(OPDStage, "run", check)
    cfg = _parse(["--teacher_pretrain", resolve_pretrain(None), "--opd_coef", "0.5", "--rollout_engine", "hf",
                  "--max_global_steps", "1", "--rollout_batch_size", "3", "--n_samples_per_prompt", "2",
                  "--train_batch_size", "6", "--micro_train_batch_size", "3", "--micro_rollout_batch_size",
                  "6", "--generate_max_len", "5", "--temperature", "1.0",
                  "--remote_rm_url", os.path.join(ROOT, "tests", "helpers", "varied_scores.py"),
                  "--save_path", str(tmp_path / "m"), "--log_dir", str(tmp_path / "logs"), "--no_progress_bar"])
    trainer = rl_trainer.run_rl(cfg, "grpo")
    names = [s.name for s in trainer.stages]
    assert trainer.step == 1 and names.index("teacher") < names.index("advantages") < names.index("opd"), names
    assert checks == [0.0] or checks[0] < 1e-6, checks
    # the teacher is the starting policy, sampled at temperature 1: the reverse KL per token is ~0
    assert "time_teacher" in seen[0] and abs(seen[0]["opd/reverse_kl"]) < 1e-3, seen[0]


def test_opd_stage_adds_or_replaces_the_advantages():
    from rlhf.batch import Batch
    from rlhf.rl.opd import OPDStage

    def batch():
        return Batch(step=0, prompts=[], n_samples=1, advantages=torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]]),
                     rollout_logprobs=torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]]),
                     teacher_logprobs=torch.tensor([[-1.5, -1.0, -3.0], [-0.5, -1.25, 0.0]]),
                     action_mask=torch.tensor([[1, 1, 0], [1, 1, 0]]))

    b = batch()
    OPDStage(2.0, False).run(b, None)  # A + 2 * (t - s) on the mask
    assert torch.allclose(b.advantages, torch.tensor([[-0.5, 2.5, 0.5], [-1.0, -3.0, 0.0]])), b.advantages
    assert abs(b.metrics["opd/reverse_kl"] - (0.5 - 1.0 + 0.0 + 1.0) / 4) < 1e-6, b.metrics
    b = batch()
    OPDStage(2.0, True).run(b, None)  # --opd_only: the OPD term alone
    assert torch.allclose(b.advantages, torch.tensor([[-1.0, 2.0, 0.0], [0.0, -2.0, 0.0]])), b.advantages
