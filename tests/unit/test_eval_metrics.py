"""RL eval and diagnostics metrics: pass@1 / pass@n (OpenRLHF's eval keys), is_filter_ratio (OpenRLHF 0.11.2's IS
filter share), the cadence of the rollout-vs-trainer log-prob gap on on-policy steps, the eval generations log
(generations.jsonl and wandb's eval/generations table), and one in-process GRPO run that produces them all."""
import contextlib
import glob
import json
import math
import os

import pytest
import torch

from rlhf.algorithms.eval_metrics import pass_at_n
from rlhf.algorithms.is_filter import is_filter_ratio

NAN = float("nan")


# ---- pass@n ---------------------------------------------------------------------------------------------------------
def test_pass_at_n_by_source_hand_computed():
    # 3 prompts x 3 samples, sources a, b, a; the second sample of prompt 2 is an invalid reward
    r = torch.tensor([1., 0., 0.,  0., 0., 0.,  1., NAN, 1.])
    got = pass_at_n(r, 3, ["a", "b", "a"])
    # a: pass1 = mean(1/3, 1) = 2/3, pass3 = mean(max 1, max 1) = 1;  b: 0 and 0
    assert got == pytest.approx({"eval_a_pass1": 2 / 3, "eval_a_pass3": 1.0, "eval_b_pass1": 0.0,
                                 "eval_b_pass3": 0.0}), got
    # non-binary rewards are averaged / maxed as they are (OpenRLHF: chunk.mean(), chunk.max())
    got = pass_at_n(torch.tensor([0.5, -1.0, 2.0, 0.0]), 2)
    assert got == pytest.approx({"eval_default_pass1": (-0.25 + 1.0) / 2, "eval_default_pass2": (0.5 + 2.0) / 2})
    # an explicit valid mask; a source with no valid sample is NaN (not a 0 that was never measured)
    got = pass_at_n(torch.tensor([1., 1., 0., 1.]), 2, ["x", "y"], valid=torch.tensor([False, False, True, True]))
    assert math.isnan(got["eval_x_pass1"]) and math.isnan(got["eval_x_pass2"])
    assert got["eval_y_pass1"] == 0.5 and got["eval_y_pass2"] == 1.0
    # n = 1: pass1 only (pass{n} would be the same key)
    assert pass_at_n(torch.tensor([1., 0., 1.]), 1) == pytest.approx({"eval_default_pass1": 2 / 3})
    with pytest.raises(ValueError, match="groups of --eval_n_samples_per_prompt 2"):
        pass_at_n(torch.ones(3), 2)
    with pytest.raises(ValueError, match="1 data sources for 2 prompts"):
        pass_at_n(torch.ones(4), 2, ["a"])


# ---- is_filter_ratio ------------------------------------------------------------------------------------------------
def test_is_filter_ratio_hand_computed():
    # IS weights w = exp(old - rollout): row 0 [1, 10, 0.1], row 1 [2, 0.4, (masked) 100], row 2 empty
    w = torch.tensor([[1.0, 10.0, 0.1], [2.0, 0.4, 100.0], [3.0, 3.0, 3.0]])
    rollout = torch.full((3, 3), -1.0)
    old = rollout + w.log()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    # token level, band [0.5, 5]: 10 and 0.1 in row 0, 0.4 in row 1 -> 3 of 5 tokens (masked ones not counted)
    for kind in ("icepop", "tis"):  # mask drops them, clip clamps them: both count (OpenRLHF's `filtered`)
        assert is_filter_ratio(old, rollout, mask, kind, 0.5, 5.0) == pytest.approx(3 / 5), kind
    # seq level: geometric means row 0 = (1*10*0.1)^(1/3) = 1, row 1 = (2*0.4)^(1/2) = 0.894; row 2 has no token
    assert is_filter_ratio(old, rollout, mask, "seq-mask-tis", 0.5, 5.0) == 0.0
    assert is_filter_ratio(old, rollout, mask, "seq-mask-tis", 0.95, 5.0) == pytest.approx(1 / 2), \
        "row 1 (0.894 < 0.95) is dropped; the empty row 2 must not count as a kept sequence"
    # tv gating: p = rollout prob 0.5, q = trainer prob [0.5, 0.6, 0.52] -> |p - q| = [0, 0.1, 0.02]
    p_roll = torch.log(torch.full((1, 3), 0.5))
    p_old = torch.log(torch.tensor([[0.5, 0.6, 0.52]]))
    ones = torch.ones(1, 3)
    assert is_filter_ratio(p_old, p_roll, ones, "icepop", 0.0, 0.05, gating="tv") == pytest.approx(1 / 3)
    # seq level: mean tv 0.04 -> kept under 0.05, dropped under 0.03
    assert is_filter_ratio(p_old, p_roll, ones, "seq-mask-tis", 0.0, 0.05, gating="tv") == 0.0
    assert is_filter_ratio(p_old, p_roll, ones, "seq-mask-tis", 0.0, 0.03, gating="tv") == 1.0
    assert is_filter_ratio(old, rollout, torch.zeros(3, 3), "icepop") is None  # nothing to count
    with pytest.raises(ValueError, match="--is_correction_type 'gspo'"):
        is_filter_ratio(old, rollout, mask, "gspo")


# ---- rollout_logprob_gap on on-policy steps ---------------------------------------------------------------------------
def _grpo_cfg(*extra):
    from rlhf.config import parse
    from rlhf.train_grpo import GRPO_DEFAULTS

    return parse("grpo", ["--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--train_batch_size", "4",
                          "--micro_train_batch_size", "2", *extra], GRPO_DEFAULTS)


class _FakeTrainer:
    """What logprob_gap_stage reads: the config, the phase scheduler, the actor role's log-prob forward."""

    def __init__(self, cfg, logprobs):
        self.cfg, self.phases, self.forwards = cfg, [], 0
        trainer = self

        class Actor:
            def logprobs(self, batch, temperature, micro, chunk, packing):
                trainer.forwards += 1
                return logprobs

        class Roles:
            actor = Actor()

        self.roles = Roles()

    @property
    def scheduler(self):
        trainer = self

        class Scheduler:
            @contextlib.contextmanager
            def phase(self, name, role=None, share=None, tags=None):
                trainer.phases.append((name, role))
                yield

        return Scheduler()


def test_logprob_gap_measured_on_the_first_and_every_nth_step_without_touching_training():
    import click

    from rlhf.batch import Batch
    from rlhf.rl.advantage_stage import needs_old_logprobs
    from rlhf.rl.components import Forwards, gap_due, measures_gap_only, on_policy_single_update
    from rlhf.rl.stages import LogprobGapStage

    def gap_only(c) -> bool:  # build_stages' decision from the config's groups
        old = needs_old_logprobs(c.algorithm, on_policy_single_update(c.rollout, c.optim, c.algorithm))
        return measures_gap_only(c.logging.logprob_gap_interval, old)

    cfg = _grpo_cfg("--logprob_gap_interval", "3")
    # 0-based steps 0 (first), 2, 5 (1-based 3, 6: the ones --logging_steps 3 logs)
    assert [s for s in range(8) if gap_due(cfg.logging.logprob_gap_interval, s)] == [0, 2, 5]
    assert not any(gap_due(_grpo_cfg("--logprob_gap_interval", "0").logging.logprob_gap_interval, s)
                   for s in range(8))
    assert gap_only(cfg), "on-policy single update: the old log-prob forward is skipped, the gap stage runs"
    for off in (("--max_epochs", "2"), ("--enable_is_correction",), ("--logprob_gap_interval", "0")):
        assert not gap_only(_grpo_cfg(*off)), off  # measured every step, or never
    for flag in ("--logprob_gap_interval", "--log_val_generations"):
        with pytest.raises(click.UsageError, match=f"{flag} must be >= 0 \\(0 = off\\), got -1; e.g. {flag} 10"):
            _grpo_cfg(flag, "-1")
    stage = LogprobGapStage
    assert stage.role is None, "a stage role would wake the actor on every step; the stage opens its phase when due"

    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    trainer_lp = torch.tensor([[-1.1, -2.0, -2.7], [-0.5, -0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rows = dict(sequences=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5, dtype=torch.long),
                action_mask=mask, rollout_logprobs=rollout, prompt_len=2)
    tr = _FakeTrainer(cfg, trainer_lp)
    stage = LogprobGapStage(Forwards.from_config(cfg.rollout, cfg.model, None), tr.scheduler, cfg.logging.logprob_gap_interval)
    for step in range(3):
        st = Batch(step=step, prompts=[], n_samples=2, **rows)
        stage.run(st, tr.roles)
        if step in (0, 2):
            # |diff| on the 5 action tokens: 0.1, 0, 0.3, 0, 0.2 -> 0.6 / 5
            assert st.metrics["rollout_logprob_gap"] == pytest.approx(0.12), step
        else:
            assert "rollout_logprob_gap" not in st.metrics, "an unmeasured step must not log a gap"
        assert st.old_logprobs is None, "the measurement must not feed the update (old log-probs stay unset)"
    assert tr.forwards == 2 and tr.phases == [("logprob_gap", "actor")] * 2


# ---- generations log ------------------------------------------------------------------------------------------------
def test_generations_jsonl_wandb_table_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    from rlhf.utils.logging import MetricsLogger

    lg = MetricsLogger(0, str(tmp_path), total_steps=4, use_wandb="True", progress_bar=False)
    rows = lambda s: [{"prompt": f"{s}+1=", "response": f"{s + 1}", "label": str(s + 1), "reward": 1.0},  # noqa: E731
                      {"prompt": f"{s}+2=", "response": "x", "label": str(s + 2), "reward": None}]
    lg.log(2, {"reward": 0.5}, prefix="eval")
    lg.log_generations(2, rows(2))
    lg.log_generations(4, rows(4))
    lg.close()
    with open(tmp_path / "generations.jsonl") as fh:
        got = [json.loads(line) for line in fh]
    assert got == [{"step": s, **r} for s in (2, 4) for r in rows(s)], got
    # wandb (offline run) wrote one table file per eval; the second holds both evals' rows (wandb issue 2981)
    tables = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "table" / "eval" /
                                  "generations_*.table.json")), key=os.path.getmtime)
    assert len(tables) == 2, tables
    with open(tables[-1]) as fh:
        t = json.load(fh)
    assert t["columns"] == ["step", "prompt", "response", "label", "reward"]
    assert t["data"] == [[s, r["prompt"], r["response"], r["label"], r["reward"]] for s in (2, 4) for r in rows(s)]
    # resuming from step 2's checkpoint drops the samples of the eval at step 4 (it runs again)
    again = MetricsLogger(0, str(tmp_path), total_steps=4, progress_bar=False)
    again.resume_at(2)
    again.close()
    with open(tmp_path / "generations.jsonl") as fh:
        assert [json.loads(line)["step"] for line in fh] == [2, 2]


# ---- the trainer, in process, one rank --------------------------------------------------------------------------------
def test_grpo_eval_pass_at_n_generations_and_gap_in_process(tiny_kit, tmp_path):
    """3 on-policy GRPO steps (the old log-prob forward skipped), --logprob_gap_interval 2: the gap on steps 1 and 2
    only; the final eval samples 2 per prompt of a 2-prompt eval set whose first row names its datasource."""
    from helpers.net import free_port

    from rlhf.config import parse
    from rlhf.rl.trainer import run_rl
    from rlhf.train_grpo import GRPO_DEFAULTS
    from rlhf.utils.logging import read_metrics

    d = os.path.join(tiny_kit, "data")
    with open(os.path.join(d, "prompts_eval.jsonl")) as fh:
        ev = [json.loads(line) for line in fh][:2]
    ev[0]["datasource"] = "math"
    with open(tmp_path / "eval.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in ev)
    os.environ.update(MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    cfg = parse("grpo", ["--pretrain", tiny_kit, "--prompt_data", f"{d}/prompts_train.jsonl", "--eval_dataset",
                         str(tmp_path / "eval.jsonl"), "--remote_rm_url", "builtin:arithmetic",
                         "--n_samples_per_prompt", "2", "--rollout_batch_size", "2", "--train_batch_size", "4",
                         "--micro_train_batch_size", "2", "--generate_max_len", "4", "--max_global_steps", "3",
                         "--eval_steps", "-1", "--eval_n_samples_per_prompt", "2", "--eval_temperature", "1.0",
                         "--log_val_generations", "3", "--logprob_gap_interval", "2", "--log_dir",
                         str(tmp_path / "logs"), "--save_path", str(tmp_path / "m"), "--no_progress_bar"],
                GRPO_DEFAULTS)
    run_rl(cfg, "grpo")
    rows = read_metrics(str(tmp_path / "logs" / "metrics.jsonl"))
    train = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all("time_old_logprobs" not in r for r in train), "on-policy: the old log-prob stage should not run"
    assert [("rollout_logprob_gap" in r) for r in train] == [True, True, False]
    assert all(r["rollout_logprob_gap"] < 1e-4 for r in train[:2]), "HF engine and trainer disagree on-policy"
    (e,) = [r for r in rows if r["split"] == "eval"]
    assert e["samples"] == 4.0
    for ds in ("math", "default"):
        p1, p2 = e[f"eval_{ds}_pass1"], e[f"eval_{ds}_pass2"]
        assert 0.0 <= p1 <= p2 <= 1.0 and p1 in (0.0, 0.5, 1.0), (ds, p1, p2)
    with open(tmp_path / "logs" / "generations.jsonl") as fh:
        gen = [json.loads(line) for line in fh]
    assert len(gen) == 3 and {g["step"] for g in gen} == {3}, gen
    prompts = {r["input"] for r in ev}
    for g in gen:
        assert g["prompt"] in prompts and g["label"] in {str(r["label"]) for r in ev}, g
        assert g["reward"] in (0.0, 1.0), g
