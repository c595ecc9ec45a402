"""Name -> function registries, so trainers look algorithms up instead of branching on names.

Where a registry's functions take keywords (advantage estimators, policy losses) the trainer passes every keyword
any of them may read, and ``call`` / ``bound`` hand each function the keywords its signature names.  A keyword no
registered function names is a misspelling, refused with ``TypeError`` (a function's own ``**_`` would swallow it
silently).
"""
from __future__ import annotations

import difflib
import inspect
from typing import Callable, FrozenSet


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

    def keywords(self) -> FrozenSet[str]:
        """Every parameter name some registered function takes (the keywords a caller may pass)."""
        return frozenset(p for fn in self.values() for p in inspect.signature(fn).parameters)

    def call(self, name: str, *args, **kwargs):
        """``self[name](*args, **{k: v for k in kwargs if the function names k})``; an unknown keyword raises."""
        return self.bound(name)(*args, **kwargs)

    def bound(self, name: str) -> Callable:
        """``self[name]`` taking the registry's keywords: those its signature lacks are dropped, unknown ones
        raise ``TypeError`` (with the nearest known name)."""
        fn, known = self.get_fn(name), self.keywords()
        params = inspect.signature(fn).parameters

        def run(*args, **kwargs):
            for k in kwargs:
                if k not in known:
                    near = difflib.get_close_matches(k, sorted(known), n=1)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    raise TypeError(f"{self.kind} {name!r}: unknown keyword {k!r}{hint}; known: {', '.join(sorted(known))}")
            return fn(*args, **{k: v for k, v in kwargs.items() if k in params})

        return run


KL_ESTIMATORS = Registry("kl estimator")
ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
LOSS_AGGREGATIONS = Registry("loss aggregation")
PREFERENCE_LOSSES = Registry("preference loss")
REWARD_MODEL_LOSSES = Registry("reward-model loss")
IS_CORRECTIONS = Registry("importance-sampling correction")
IS_GATES = Registry("importance-sampling gate statistic")
DISTILLATION = Registry("distillation term")  # rlhf.algorithms.distill
