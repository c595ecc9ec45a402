"""A reward call with a deadline (``call_with_deadline``): on the main thread a real-time signal ends it, else it
runs on a worker thread that is abandoned at the deadline; sync or ``async def`` functions alike.
"""
from __future__ import annotations

import asyncio
import inspect
import signal
import threading
from typing import Callable, Dict, Optional

from rlhf.errors import RewardTimeout


class _DeadlinePassed(BaseException):
    """Raised inside the reward function by the deadline signal; a BaseException, so a reward function's own
    ``except Exception`` does not swallow it (as KeyboardInterrupt)."""


# The signal that ends a reward call on the main thread at its deadline: a real-time signal nothing else here uses
# (SIGALRM stays the reward function's own; the trainers take USR1, TERM, INT, HUP).  Its handler is installed once
# and never removed, so a signal still in flight after a call returned finds a handler that does nothing.
_DEADLINE_SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") and hasattr(signal, "pthread_kill") else None


_ARMED: Dict[str, object] = {"call": None}


_HANDLER_STATE = {"installed": False, "refused": None}


def _deadline_handler(signum, frame):
    if _ARMED["call"] is not None:
        raise _DeadlinePassed()


def main_thread_deadline_unavailable() -> Optional[str]:
    """None if a reward call can run on this thread under the signal deadline, else why not (it then runs on a
    worker thread, where ``signal.signal`` / ``signal.alarm`` handlers cannot be set)."""
    if _DEADLINE_SIGNAL is None:
        return "this platform has no real-time signals (signal.SIGRTMIN) or signal.pthread_kill"
    if threading.current_thread() is not threading.main_thread():
        return f"the reward call came from thread {threading.current_thread().name!r}, not the main thread"
    try:
        asyncio.get_running_loop()
        return "the reward call came from inside a running asyncio event loop"
    except RuntimeError:
        pass
    if not _HANDLER_STATE["installed"]:
        if _HANDLER_STATE["refused"] is None:
            current = signal.getsignal(_DEADLINE_SIGNAL)
            if current not in (signal.SIG_DFL, None):
                _HANDLER_STATE["refused"] = f"signal {_DEADLINE_SIGNAL} already has a handler ({current!r})"
            else:
                signal.signal(_DEADLINE_SIGNAL, _deadline_handler)
                _HANDLER_STATE["installed"] = True
        if not _HANDLER_STATE["installed"]:
            return _HANDLER_STATE["refused"]
    return None


def _run(fn: Callable, args: tuple, kwargs: dict):
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return out


def call_with_deadline(fn: Callable, args: tuple, kwargs: dict, timeout_s: float):
    """``fn(*args, **kwargs)`` (awaited when it returns an awaitable), given ``timeout_s`` seconds.

    Called from the main thread (the trainers' case), fn runs right there, so a reward function may use
    ``signal.signal`` / ``signal.alarm`` (math_verify's timeouts, sandbox helpers) as in a plain script and as under
    OpenRLHF's Ray tasks; at the deadline a timer thread sends the main thread a real-time signal
    (``_DEADLINE_SIGNAL``, re-sent every second until fn gives up) whose handler raises inside fn: blocking calls
    (sleep, socket reads, subprocess waits) are interrupted, pure Python loops stop at the next bytecode; only a C
    extension that never returns to Python outlasts it (then the watchdog's --watchdog_timeout_s ends the job).

    From any other thread (or inside a running event loop), fn runs in a daemon thread instead and is given up on
    at the deadline (the thread is left behind; Python cannot kill it); a reward function that sets a signal
    handler fails there with Python's "signal only works in main thread", which RewardSource turns into a message
    naming the cause (``main_thread_deadline_unavailable``).
    """
    unlimited = not (timeout_s and timeout_s > 0)
    if main_thread_deadline_unavailable() is None:
        done = threading.Event()
        main = threading.main_thread().ident

        def timer():
            if done.wait(timeout_s):
                return
            while not done.is_set():
                signal.pthread_kill(main, _DEADLINE_SIGNAL)
                done.wait(1.0)

        outer = _ARMED["call"]  # a reward call made from inside another keeps the outer one armed afterwards
        _ARMED["call"] = fn
        if not unlimited:
            threading.Thread(target=timer, name="reward_deadline", daemon=True).start()
        try:
            try:
                out = _run(fn, args, kwargs)
            finally:
                _ARMED["call"] = outer
        except _DeadlinePassed:  # also one that lands in the finally above, as fn returned at its deadline
            _ARMED["call"] = outer
            done.set()
            raise RewardTimeout() from None
        except BaseException:
            done.set()
            raise
        done.set()
        return out

    box: Dict[str, object] = {}
    done = threading.Event()

    def work():
        try:
            box["out"] = _run(fn, args, kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = e
        finally:
            done.set()

    threading.Thread(target=work, name="reward_func", daemon=True).start()
    if not done.wait(None if unlimited else timeout_s):
        raise RewardTimeout()
    if "err" in box:
        raise box["err"]
    return box["out"]


async def _await(aw):
    return await aw
