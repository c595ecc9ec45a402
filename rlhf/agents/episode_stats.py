"""Per-episode statistics and the step's agent metrics (issue 44 item 5).

Each episode task runs with its ``EpisodeStats`` in a context variable (``episode``): the llm engine adds each
generate call's wait (``gen_s``, ``turns``), the executors the episode's wall time; tools and environments add
their own counts to ``extra`` (``current().extra["tool_calls"] += 1``): every key of ``extra`` becomes
``agent/<key>`` (its mean over the episodes) in the step's metrics.

Metrics (``agent_metrics``), over the episodes of one rollout:
  agent/turns_mean, agent/turns_max        model turns (generate calls) per episode
  agent/latency_p50, agent/latency_p99     episode wall time, seconds (nearest-rank percentiles)
  agent/gen_s, agent/env_s                 summed over episodes: time waiting for generation / everything else
                                           (environment, tools, agent code); env_frac = env_s / (gen_s + env_s)
  agent/episode_errors                     episodes ended by an exception in the agent file or a tool
  agent/occupancy_mean, agent/occupancy_max, agent/engine_steps   requests per engine step (the continuous
                                           batch's fill) and the number of steps"""
from __future__ import annotations

import contextlib
import contextvars
import math
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Sequence


@dataclass
class EpisodeStats:
    index: int = 0
    turns: int = 0
    gen_s: float = 0.0
    latency_s: float = 0.0
    error: bool = False
    extra: Dict[str, float] = field(default_factory=dict)

    @property
    def env_s(self) -> float:
        return max(0.0, self.latency_s - self.gen_s)


_CURRENT: contextvars.ContextVar[Optional[EpisodeStats]] = contextvars.ContextVar("rlhf_episode", default=None)


def current() -> Optional[EpisodeStats]:
    """The running episode's stats (None outside an episode task)."""
    return _CURRENT.get()


@contextlib.contextmanager
def episode(index: int) -> Iterator[EpisodeStats]:
    """Run the block as episode ``index``: its stats are ``current()`` inside and its wall time is recorded."""
    st = EpisodeStats(index)
    token = _CURRENT.set(st)
    t0 = time.perf_counter()
    try:
        yield st
    finally:
        st.latency_s = time.perf_counter() - t0
        _CURRENT.reset(token)


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the ceil(q/100 * n)-th smallest value (q in (0, 100])."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)] if s else 0.0


def agent_metrics(eps: Sequence[EpisodeStats], occupancy: Sequence[int] = ()) -> Dict[str, float]:
    if not eps:
        return {}
    lat = [e.latency_s for e in eps]
    gen, env = sum(e.gen_s for e in eps), sum(e.env_s for e in eps)
    m = {"agent/turns_mean": sum(e.turns for e in eps) / len(eps), "agent/turns_max": float(max(e.turns for e in eps)),
         "agent/latency_p50": percentile(lat, 50), "agent/latency_p99": percentile(lat, 99),
         "agent/gen_s": gen, "agent/env_s": env, "agent/env_frac": env / (gen + env) if gen + env > 0 else 0.0,
         "agent/episode_errors": float(sum(e.error for e in eps))}
    if occupancy:
        m.update({"agent/occupancy_mean": sum(occupancy) / len(occupancy),
                  "agent/occupancy_max": float(max(occupancy)), "agent/engine_steps": float(len(occupancy))})
    keys = sorted({k for e in eps for k in e.extra})
    m.update({f"agent/{k}": sum(float(e.extra.get(k, 0.0)) for e in eps) / len(eps) for k in keys})
    return m


def seed_for(seed: Optional[int], episode_index: int, turn: int) -> Optional[int]:
    """A request's own seed: distinct per episode and turn, fixed by them (not by which requests share a step)."""
    if seed is None:
        return None
    return (int(seed) * 1000003 + episode_index * 7919 + turn * 104729) % (2 ** 62)
