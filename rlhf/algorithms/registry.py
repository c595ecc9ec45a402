"""Name -> function registries, so trainers look algorithms up instead of branching on names."""
from __future__ import annotations

from typing import Callable


class Registry(dict):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str, **attrs) -> Callable:
        def deco(fn):
            if name in self:
                raise KeyError(f"{self.kind} {name!r} registered twice")
            for k, v in attrs.items():
                setattr(fn, k, v)
            self[name] = fn
            return fn

        return deco

    def get_fn(self, name: str):
        if name not in self:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of {', '.join(sorted(self))}")
        return self[name]


KL_ESTIMATORS = Registry("kl estimator")
ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGGREGATIONS = Registry("loss aggregation")
PREFERENCE_LOSSES = Registry("preference loss")
REWARD_MODEL_LOSSES = Registry("reward-model loss")
IS_CORRECTIONS = Registry("importance-sampling correction")
IS_GATES = Registry("importance-sampling gate statistic")
