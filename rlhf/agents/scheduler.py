"""Per-episode generation: every episode is an asyncio task, each of its ``generate`` calls one request to a
continuously batched engine (``RolloutEngine.step_requests``), driven by one scheduler coroutine per engine and
event loop.

The loop (vLLM's ``LLM._run_engine`` turned inside out, vllm/entrypoints/common/offline.py: add requests, then
``step`` while any is unfinished; here requests arrive while it steps):

    while running or pending:  admit every pending request  ->  one engine step  ->  resolve the finished ones
                               ->  yield once to the event loop (episodes whose request finished run their
                                   environment step and may submit their next request before the next step)

A request submitted while others run joins at the next step; none waits for another episode's turn or tool.
The engine step runs on the loop's thread: environment coroutines that wait (``asyncio.sleep``, network I/O)
keep waiting in wall-clock time meanwhile, and resume between steps.  Colocated TP > 1 engines broadcast each
step's admitted and aborted requests from their first rank inside ``step_requests`` (``VLLMEngine``), so the
scheduler runs on the first rank only, as the agent does (``RolloutRole.run_agent``).

An engine error fails every request then running with ``EngineStepError`` (the executors end the run with it);
a request the engine refuses fails alone (``RequestRefused``: its episode fails); a cancelled episode's request is
aborted at the next step.  ``occupancy``: the number of requests each step ran."""
from __future__ import annotations

import asyncio
import itertools
import time
import weakref
from typing import Dict, List, Tuple

from rlhf.engines.requests import Completion, Request
from rlhf.engines.rollout import SamplingParams


class RequestRefused(ValueError):
    """The engine refused this request (e.g. its prompt is over max_model_len): its episode fails alone."""


class EngineStepError(RuntimeError):
    """An engine step raised: every request it ran fails with this, and the executors let it end the run (the
    engine's state is unknown: fail-fast, not a failed episode)."""


_SCHEDULERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dict[int, RequestScheduler]] = \
    weakref.WeakKeyDictionary()


class RequestScheduler:
    """The one coroutine that steps ``engine`` for every request made on this event loop."""

    def __init__(self, engine):
        self.engine = engine
        self.pending: List[Tuple[Request, asyncio.Future]] = []
        self.running: Dict[str, asyncio.Future] = {}
        self.aborts: List[str] = []
        self.occupancy: List[int] = []   # requests run by each step
        self.step_s = 0.0                # time inside the engine's steps
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task = None

    async def generate(self, prompt_ids, params: SamplingParams, images=None) -> Completion:
        req = Request(f"req-{next(self._ids)}", list(prompt_ids), params, images)
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((req, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            self._drop(req.request_id)
            raise

    def _drop(self, rid: str) -> None:
        self.pending = [(r, f) for r, f in self.pending if r.request_id != rid]
        if self.running.pop(rid, None) is not None:
            self.aborts.append(rid)

    async def _loop(self) -> None:
        while True:
            if not (self.pending or self.running or self.aborts):
                self._wake.clear()
                await self._wake.wait()
                await asyncio.sleep(0)  # requests made in this loop turn join the same step
            self.step()
            await asyncio.sleep(0)

    def step(self) -> None:
        """Admit the pending requests, run one engine step, resolve the requests that finished in it."""
        admit, self.pending = self.pending, []
        aborts, self.aborts = self.aborts, []
        for r, f in admit:
            self.running[r.request_id] = f
        t0 = time.perf_counter()
        try:
            res = self.engine.step_requests([r for r, _ in admit], aborts)
        except Exception as e:  # the engine's state is unknown: every running request fails with the error
            err = EngineStepError(f"the rollout engine's step failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._fail_all(err)
            return
        finally:
            self.step_s += time.perf_counter() - t0
        self.occupancy.append(res.running)
        for c in res.finished:
            fut = self.running.pop(c.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(c)
        for rid, why in res.failed:
            fut = self.running.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(RequestRefused(why))

    def _fail_all(self, err: Exception) -> None:
        running, self.running = self.running, {}
        try:
            self.engine.step_requests([], list(running))  # free what the engine still holds of them
        except Exception:  # noqa: BLE001  (the first error is the one reported)
            pass
        for fut in running.values():
            if not fut.done():
                fut.set_exception(err)

    def close(self) -> None:
        """Stop the coroutine (requests still waiting are cancelled)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for fut in list(self.running.values()) + [f for _, f in self.pending]:
            fut.cancel()
        if self.running:
            self.engine.step_requests([], list(self.running))
        self.running, self.pending = {}, []


def scheduler_for(engine) -> RequestScheduler:
    """The scheduler of ``engine`` on the running event loop (one per engine and loop: two would step the same
    running batch and take each other's completions)."""
    loop = asyncio.get_running_loop()
    per_loop = _SCHEDULERS.setdefault(loop, {})
    s = per_loop.get(id(engine))
    if s is None or s.engine is not engine:
        s = per_loop[id(engine)] = RequestScheduler(engine)
    return s


def close_scheduler(engine):
    """Stop ``engine``'s scheduler on the running loop, if any (the end of an executor's run); returns it (its
    ``occupancy`` and ``step_s`` stay readable) or None."""
    s = _SCHEDULERS.get(asyncio.get_running_loop(), {}).pop(id(engine), None)
    if s is not None:
        s.close()
    return s
