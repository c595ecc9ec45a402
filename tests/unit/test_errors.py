"""The one error hierarchy (rlhf/errors.py): every kind is an RLHFError that keeps its builtin base, the old import
paths still name the same class, and fail-fast tells a refusal by its class, not by its name."""
import pytest

from rlhf import errors
from rlhf.distributed import failfast

BASES = {"ConfigError": ValueError, "HierarchicalError": ValueError, "InputError": ValueError,
         "DataError": ValueError, "ModelKindError": ValueError, "TopologyError": ValueError,
         "MemoryPlanError": ValueError, "CombineError": ValueError, "AgentContractError": ValueError,
         "RewardError": RuntimeError, "CheckpointError": RuntimeError, "ExportError": RuntimeError,
         "WeightTransferError": RuntimeError, "WeightSyncTimeout": RuntimeError, "RewardTimeout": Exception}
REFUSALS = {"ConfigError", "InputError", "DataError", "ModelKindError", "TopologyError", "MemoryPlanError",
            "RewardError"}
HOMES = {"ConfigError": "rlhf.config.validate", "HierarchicalError": "rlhf.config.hierarchical",
         "InputError": "rlhf.rl.checks", "DataError": "rlhf.data.loading",
         "ModelKindError": "rlhf.models.load", "TopologyError": "rlhf.distributed.placement",
         "MemoryPlanError": "rlhf.planning", "CombineError": "rlhf.tools.lora_combiner",
         "AgentContractError": "rlhf.agents.base", "RewardError": "rlhf.rewards.reward_func",
         "RewardTimeout": "rlhf.rewards.reward_func", "CheckpointError": "rlhf.checkpoint",
         "ExportError": "rlhf.checkpoint", "WeightTransferError": "rlhf.distributed.transport",
         "WeightSyncTimeout": "rlhf.distributed.weight_sync"}


def make(cls):
    return cls("flag", "msg") if cls in (errors.ConfigError, errors.ModelKindError) else cls("msg")


@pytest.mark.parametrize("name", sorted(BASES))
def test_each_kind_keeps_its_builtin_base_and_its_old_home(name):
    import importlib

    cls = getattr(errors, name)
    e = make(cls)
    assert isinstance(e, errors.RLHFError) and isinstance(e, BASES[name]), cls.__mro__
    assert failfast.is_input_error(e) == (name in REFUSALS), name
    assert getattr(importlib.import_module(HOMES[name]), name) is cls, HOMES[name]


def test_refusal_is_matched_by_class_not_by_name():
    """A user's own class that happens to be called ConfigError is a bug of theirs, not our refusal (its traceback
    stays); click's usage errors (``rlhf.config.cli.ConfigUsageError``) are refusals."""
    import click

    from rlhf.config.cli import ConfigUsageError

    class ConfigError(ValueError):
        pass

    assert not failfast.is_input_error(ConfigError("x"))
    assert failfast.is_input_error(ConfigUsageError("--x 1: use 2")) and failfast.is_input_error(click.BadParameter("x"))
    assert errors.ConfigError("seed", "m").flag == "seed"
    e = errors.AgentContractError("m", "reward", got=3)
    assert (e.field, e.kind) == ("reward", "reward:int")


def test_a_misspelt_algorithm_keyword_raises_instead_of_vanishing():
    """The estimators and policy losses no longer take ``**_``: the registry hands each the keywords it names and
    refuses one that no registered function takes (before: ``std_nrom=False`` was silently ignored)."""
    import torch

    from rlhf.algorithms import compute_advantages
    from rlhf.algorithms.registry import POLICY_LOSSES

    scores, mask = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.ones(4, 2)
    a, _ = compute_advantages("group_norm", scores, mask, group_size=2, std_norm=False, lambd=0.9, values=None)
    b, _ = compute_advantages("group_norm", scores, mask, group_size=2, std_norm=False)
    assert torch.equal(a, b), "keywords another estimator reads (lambd, values) are dropped for group_norm"
    with pytest.raises(TypeError, match="unknown keyword 'std_nrom' \\(did you mean 'std_norm'\\?\\)"):
        compute_advantages("group_norm", scores, mask, group_size=2, std_nrom=False)
    lp = torch.zeros(2, 2)
    loss, _ = POLICY_LOSSES.bound("ppo")(lp, lp, torch.ones(2, 2), mask[:2], sapo_tau_pos=2.0, clip_eps_low=0.2)
    assert float(loss) == -1.0
    with pytest.raises(TypeError, match="unknown keyword 'clip_eps_lo'"):
        POLICY_LOSSES.bound("ppo")(lp, lp, torch.ones(2, 2), mask[:2], clip_eps_lo=0.1)
