"""try/teacher-2: a frozen teacher declared in the role table (one declaration, the flag, the Batch field), computing
the sampled tokens' log-probs."""
import os

from rlhf.distributed.placement import make_placement, role_needs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_teacher_sits_on_the_actors_ranks():
    from rlhf.config.cli import parse
    from rlhf.train_grpo import GRPO_DEFAULTS

    cfg = parse("grpo", ["--teacher_pretrain", "t", "--remote_rm_url", "r.py", "--n_samples_per_prompt", "2",
                         "--train_batch_size", "16"],
                GRPO_DEFAULTS)
    plan = make_placement(cfg.topology, 2, **role_needs(cfg.algorithm, cfg.model))
    assert plan.ranks["teacher"] == plan.ranks["actor"] == [0, 1]
    cfg.model.teacher_pretrain = None
    assert make_placement(cfg.topology, 2, **role_needs(cfg.algorithm, cfg.model)).ranks["teacher"] == []


def test_grpo_step_records_teacher_logprobs(monkeypatch, tmp_path):
    from rlhf.config.cli import parse
    from rlhf.models.load import resolve_pretrain
    from rlhf.rl import trainer as rl_trainer
    from rlhf.rl.stages import DeclaredForwardStage
    from rlhf.train_grpo import GRPO_DEFAULTS

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    seen, gaps = [], []
    reduce = rl_trainer.RLTrainer.reduce_metrics
    monkeypatch.setattr(rl_trainer.RLTrainer, "reduce_metrics", lambda self, m: seen.append(dict(m)) or reduce(self, m))
    run = DeclaredForwardStage.run

    def record_gap(self, batch, roles):  # sum_t m_t (log pi_rollout(a_t) - log p_teacher(a_t)) / sum_t m_t
        run(self, batch, roles)
        m = batch.action_mask.float()
        gaps.append(float(((batch.rollout_logprobs - batch.teacher_logprobs) * m).sum() / m.sum().clamp(min=1.0)))

    monkeypatch.setattr(DeclaredForwardStage, "run", record_gap)
    cfg = parse("grpo", ["--teacher_pretrain", resolve_pretrain(None), "--rollout_engine", "hf",
                         "--max_global_steps", "1", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
                         "--train_batch_size", "4", "--micro_train_batch_size", "4", "--micro_rollout_batch_size",
                         "4", "--generate_max_len", "4", "--temperature", "1.0",
                         "--remote_rm_url", os.path.join(ROOT, "tests", "helpers", "varied_scores.py"),
                         "--save_path", str(tmp_path / "m"), "--log_dir", str(tmp_path / "logs"),
                         "--no_progress_bar"], GRPO_DEFAULTS)
    trainer = rl_trainer.run_rl(cfg, "grpo")
    assert trainer.step == 1 and [s.name for s in trainer.stages].count("teacher") == 1
    # the teacher is the starting policy and the rollout samples from it at temperature 1: the gap is ~0
    assert "time_teacher" in seen[0] and len(gaps) == 1 and abs(gaps[0]) < 1e-3, (gaps, seen[0])


def test_the_memory_planner_plans_the_teachers_forward():
    from rlhf.config.schema import TopologyConfig
    from rlhf.planning.dims import ModelDims
    from rlhf.planning.memory import Job, plan_memory

    dims = ModelDims(hidden=8, layers=3, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=50, tied=False)
    placement = make_placement(TopologyConfig(), 1, need_ref=True, need_teacher=True)
    plan = plan_memory(Job(kind="rl", rollout_engine="hf"), {"actor": dims}, placement, on_cuda=False)
    planned = [s.name for s in plan.groups[0].stages]
    assert planned.index("ref") < planned.index("teacher") < planned.index("actor_update"), planned
