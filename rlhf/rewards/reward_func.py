"""Reward functions: a local ``reward_func.py`` or an HTTP reward server, behind one checked call.

API (OpenRLHF's): ``reward_func(queries, prompts, labels, **kwargs) -> {"rewards", "scores", "extra_logs"}``,
sync or ``async def``.  ``queries`` are prompt + response texts.

Per-sample semantics: OpenRLHF calls a reward function with one query at a time (openrlhf/utils/agent.py
``SingleTurnAgentExecutor._fetch_rewards_via_func``: ``batch_size = 1``), so each reward depends on its own query
only, and an ``extra_logs`` value is one number.  Here it is called once per batch (lists of n): ``rewards`` and
``scores`` must have one value per query (for any function written for OpenRLHF, the values it would give one query
at a time); an ``extra_logs`` entry with one value (a number, a 0-d tensor, a one-element list) is the batch's
value, logged for each of its rows: for a mean over the batch (OpenRLHF's examples/python/math_reward_func.py
``math_accuracy``) that logs what OpenRLHF's mean over per-sample calls logs.  A reward file may import
``openrlhf.utils``'s ``extract_boxed_answer`` / ``grade_answer`` (OpenRLHF's code, served while it loads:
rlhf.agents.openrlhf_agent ``openrlhf_names``).
"""
from __future__ import annotations

import traceback
from typing import Callable, Dict, List, Optional

import torch

from rlhf.rewards.deadline import RewardTimeout, call_with_deadline, main_thread_deadline_unavailable
from rlhf.rewards.remote import http_reward_func, sharded_http_reward_func
from rlhf.rewards.result import RewardError, check_result
from rlhf.rewards.reward_file import load_reward_func


class RewardSource:
    """Calls the function / server, validates, and masks NaN rewards (counted, first case logged once)."""

    def __init__(self, fn: Callable, where: str, timeout_s: float = 120.0, log=print):
        self.fn, self.where, self.timeout_s, self.log = fn, where, timeout_s, log
        self.invalid_total = 0
        self._logged_nan = False

    def __call__(self, queries: List[str], prompts: List[str], labels: List, **kw) -> Dict:
        n = len(queries)
        try:
            out = call_with_deadline(self.fn, (queries, prompts, labels), kw, self.timeout_s)
        except RewardError:
            raise
        except RewardTimeout:
            raise RewardError(f"{self.where}: reward_func did not return within {self.timeout_s:g}s for a batch of "
                              f"{n} queries (first: {queries[0]!r}); make it faster or raise --reward_timeout_s") from None
        except Exception as e:
            tb = traceback.format_exc()
            if isinstance(e, ValueError) and "signal only works in main thread" in str(e):
                why = main_thread_deadline_unavailable()
                where = (f"this call ran on a worker thread because {why}. Call the reward source from the main "
                         f"thread, or" if why else
                         "it was set from a thread the reward function (or a library it calls) started. Set it on "
                         "the calling thread, or")
                raise RewardError(
                    f"{self.where}: reward_func set a signal handler (signal.signal / signal.alarm), which Python "
                    f"allows only on the main thread, and {where} use a timeout that works on any thread (a "
                    f"subprocess with a timeout, concurrent.futures, math_verify's timeout_seconds=None)\n{tb}") from e
            raise RewardError(f"{self.where}: reward_func raised {type(e).__name__}: {e}\n"
                              f"first query of the batch: {queries[0]!r}\n{tb}") from e
        res = check_result(out, n, self.where)
        bad = ~torch.isfinite(res["rewards"])
        res["valid"] = ~bad
        if bad.any():
            self.invalid_total += int(bad.sum())
            if not self._logged_nan:
                i = int(bad.nonzero()[0])
                self.log(f"[reward] {self.where} returned a non-finite reward for query {queries[i]!r}; such samples "
                         f"are excluded from the loss and counted in reward/invalid")
                self._logged_nan = True
            res["rewards"] = torch.where(bad, torch.zeros_like(res["rewards"]), res["rewards"])
            res["scores"] = torch.where(torch.isfinite(res["scores"]), res["scores"], torch.zeros_like(res["scores"]))
        return res


def make_reward_source(spec: Optional[str], timeout_s: float = 120.0, log=print, retries: int = 2) -> Optional[RewardSource]:
    """``--remote_rm_url``: a reward_func.py path, builtin:arithmetic, or one or more http(s) URLs (comma separated:
    each batch is split across the servers, ``sharded_http_reward_func``).

    A comma list with anything but URLs is refused: OpenRLHF loads the first ``.py`` and silently ignores the rest
    (openrlhf/utils/agent.py ``SingleTurnAgentExecutor.__init__``), so ``a.py,b.py`` would train on ``a.py`` alone.
    """
    if not spec:
        return None
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise RewardError(f"--remote_rm_url {spec!r} names no reward source")
    urls = [p for p in parts if p.startswith(("http://", "https://"))]
    if len(parts) > 1 and len(urls) < len(parts):
        others = [p for p in parts if p not in urls]
        raise RewardError(
            f"--remote_rm_url {spec}: a comma list must be http(s) reward servers only (each batch is split across "
            f"them, as OpenRLHF does); {others} {'is' if len(others) == 1 else 'are'} not. OpenRLHF would use only "
            f"the first entry and silently ignore the rest; to combine reward functions, write one reward_func.py "
            f"that calls them (e.g. returns the sum of their rewards) and give that file alone")
    if urls:
        # the client keeps its own deadline; the outer one only backs it up
        fn = http_reward_func(urls[0], timeout_s, retries) if len(urls) == 1 else \
            sharded_http_reward_func(urls, timeout_s, retries)
        return RewardSource(fn, ",".join(urls), timeout_s + 5.0, log)
    if parts[0] == "builtin:arithmetic":
        return builtin_reward_source(log)
    return RewardSource(load_reward_func(parts[0]), parts[0], timeout_s, log)


def builtin_reward_source(log=print) -> RewardSource:
    from rlhf.data.arithmetic import arithmetic_reward

    return RewardSource(arithmetic_reward, "builtin:arithmetic", log=log)
