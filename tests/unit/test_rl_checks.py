"""The RL trainer's pieces outside the loop: the input checks before any process group (rlhf/rl/checks.py), one
eval pass (rlhf/rl/evaluate.py) and the run's state on disk (rlhf/rl/persistence.py), each on fakes, in-process."""
import contextlib
from types import SimpleNamespace as NS

import pytest
import torch

from rlhf.errors import InputError

DATA = NS(prompt_data="p.jsonl", eval_dataset=None, eval_holdout=0.2)
OPTIM = NS(num_episodes=2, max_global_steps=0)


def test_plan_steps_counts_episodes_says_leftovers_and_refuses_too_few_prompts():
    from rlhf.rl.checks import plan_steps

    per, total, notes = plan_steps(10, 3, 4, DATA, OPTIM)
    assert (per, total) == (2, 4)
    assert notes == ["[data] 10 training prompts -> 2 steps per episode of --rollout_batch_size 4 (2 prompts of each "
                     "shuffled episode are left out); 3 eval prompts"], notes
    _, _, notes = plan_steps(8, 0, 4, DATA, NS(num_episodes=1, max_global_steps=5))
    assert notes[0].endswith("0 eval prompts (eval off)") and "--max_global_steps 5" in notes[1], notes
    with pytest.raises(InputError, match=r"3 training prompts is fewer than --rollout_batch_size 4 .*"
                                         r"--rollout_batch_size 3 or fewer.*--eval_holdout 0.2 held out 1 for eval"):
        plan_steps(3, 1, 4, DATA, OPTIM)


def test_async_train_needs_rollout_ranks_of_their_own():
    from rlhf.rl.checks import check_async_placement

    check_async_placement(True, NS(separate_rollout=True))
    check_async_placement(False, NS(separate_rollout=False))
    with pytest.raises(InputError, match="--async_train needs rollout ranks of their own: set --vllm_num_engines"):
        check_async_placement(True, NS(separate_rollout=False))


class _Phases:
    def __init__(self, seen):
        self.seen = seen

    @contextlib.contextmanager
    def phase(self, name, role=None, **kw):
        self.seen.append(name)
        yield


def _evaluator(seen, logged, prompts, k=0, rank=0):
    from rlhf.batch import Batch
    from rlhf.rl.evaluate import Evaluator

    batch = Batch(sequences=torch.zeros(4, 3, dtype=torch.long), action_mask=torch.tensor([[1, 1, 0]] * 4))
    res = Batch(rewards=torch.tensor([1.0, 0.0, 0.5, 9.0]), valid=torch.tensor([True, True, True, False]),
                extra_logs={"fmt": torch.tensor([1.0, 3.0])})
    rollouts = NS(generate=lambda roles, ps, params: (seen.append(("generate", len(ps), params)), batch)[1])
    scorer = NS(score=lambda b, roles, labels: (seen.append(("score", labels)), res)[1])
    sampler = NS(params=lambda step, eval_mode: ("eval" if eval_mode else "train", step))
    logger = NS(log_generations=lambda step, rows: logged.append((step, rows)))
    return Evaluator(prompts, {"q0": "math"}, 2, k, rollouts=rollouts, sampler=sampler, scorer=scorer,
                     watchdog=_Phases(seen), scheduler=_Phases(seen), tokenizer=None, logger=logger, rank=rank)


def test_eval_pass_runs_under_its_phases_and_reduces_valid_rewards_per_source():
    from rlhf.data.formatting import PromptItem

    prompts = [PromptItem("q0", "l0", [1]), PromptItem("q1", "l1", [2])]
    seen, logged = [], []
    out = _evaluator(seen, logged, prompts).run(7, roles=None)
    assert seen == ["eval", "eval_rollout", ("generate", 2, ("eval", 7)), "eval_reward", ("score", ["l0"] * 2 + ["l1"] * 2)]
    assert out["reward"] == pytest.approx(0.5) and out["response_len"] == 2.0 and out["samples"] == 4.0, out
    assert out["reward_fmt"] == 2.0 and out["eval_math_pass1"] == pytest.approx(0.5), out
    assert "eval_default_pass2" in out and logged == [], out  # --log_val_generations 0: nothing decoded
    _evaluator(seen, logged, prompts, k=2, rank=1).run(7, roles=None)
    assert logged == [], "generations are decoded and logged on rank 0 only"
    seen.clear()
    assert _evaluator(seen, logged, []).run(7, roles=None) == {} and seen == [], "no eval prompts: eval off"


def test_persistence_restores_the_trainer_state_and_names_the_exports(tmp_path, monkeypatch):
    from rlhf import checkpoint as ckpt
    from rlhf.rl import persistence

    loaded = []
    role = NS(state_dir="actor", load_state_dict=lambda p: loaded.append(p))
    roles = NS(trained=lambda: [role], actor="A", critic="C")
    monkeypatch.setattr(ckpt, "load_trainer_state", lambda p: {"step": 5, "kl_coef": 0.3, "reward_norm": None,
                                                               "async_queue": {"drawn": {0: 4}}})
    monkeypatch.setattr(ckpt, "load_rank_state", lambda p: loaded.append(("rank", p)))
    kl, queue = NS(value=0.0), NS(restore=lambda s: loaded.append(("queue", s)))
    assert persistence.restore_run(str(tmp_path), roles, kl, None, queue) == 5 and kl.value == 0.3
    assert loaded == [str(tmp_path / "actor"), ("queue", {"drawn": {0: 4}}), ("rank", str(tmp_path))], loaded
    c = NS(save_path="out/", save_value_network=True)
    assert persistence.exports(c, roles) == [("A", "out/"), ("C", "out_critic")]
    assert persistence.exports(c, NS(actor="A", critic=None)) == [("A", "out/")]
    assert persistence.run_state(2, 0.1, None, None) == {"step": 2, "kl_coef": 0.1, "reward_norm": None,
                                                         "async_queue": None}
