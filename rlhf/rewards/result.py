"""What a reward call must return, checked (``check_result``): ``rewards`` and ``scores`` with one value per query,
``extra_logs`` with one value per query or one for the batch; ``RewardError``, which names the source and a fix.
"""
from __future__ import annotations

from typing import Dict

import torch

from rlhf.errors import RewardError


def _as_tensor(x, n: int, what: str, where: str) -> torch.Tensor:
    """x as a flat float32 tensor of n values, detached: a reward computed with autograd on (a reward model's
    output outside ``no_grad``) would otherwise carry its graph into the advantages, and the actor's second
    backward would fail with "Trying to backward through the graph a second time" (issue 27 item 5)."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
    try:
        t = torch.as_tensor(x, dtype=torch.float32).flatten()
    except Exception as e:
        raise RewardError(f"{where}: '{what}' is not a list/tensor of numbers: {type(x).__name__}") from e
    if t.numel() != n:
        raise RewardError(f"{where}: '{what}' has {t.numel()} values for a batch of {n}")
    return t


def check_result(out, n: int, where: str) -> Dict:
    if not isinstance(out, dict) or "rewards" not in out:
        got = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise RewardError(f"{where}: reward_func must return a dict with 'rewards' (and optional 'scores', "
                          f"'extra_logs'); got {got}")
    rewards = _as_tensor(out["rewards"], n, "rewards", where)
    scores = _as_tensor(out.get("scores", rewards), n, "scores", where)
    extra = {k: _extra_log(v, n, k, where) for k, v in (out.get("extra_logs") or {}).items()}
    return {"rewards": rewards, "scores": scores, "extra_logs": extra}


def _extra_log(v, n: int, key: str, where: str) -> torch.Tensor:
    """An ``extra_logs`` value as n per-row values: n values as given; one value (a number, a 0-d or one-element
    tensor or list: what OpenRLHF's per-sample calls return, e.g. math_reward_func.py's ``math_accuracy``) is the
    batch's value, repeated for each row."""
    if isinstance(v, torch.Tensor):
        v = v.detach()
    if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1) or \
            (isinstance(v, (list, tuple)) and len(v) == 1):
        one = _as_tensor(v, 1, f"extra_logs[{key}]", where)
        return one.expand(n).clone()
    try:
        return _as_tensor(v, n, f"extra_logs[{key}]", where)
    except RewardError as e:
        raise RewardError(f"{e}: give one value per query, or one value for the batch") from None
