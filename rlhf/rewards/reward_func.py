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

import asyncio
import http.client
import importlib.util
import inspect
import json
import os
import signal
import socket
import threading
import time
import traceback
import urllib.error
import urllib.request
from typing import Callable, Dict, List, Optional

import torch

from rlhf.errors import RewardError, RewardTimeout


def resolve_reward_path(path: str) -> str:
    """``--remote_rm_url path.py`` as an absolute path: ``~`` expanded, a relative path joined to the job's working
    directory (where torchrun was started; slurm/common.sh starts there from $SLURM_SUBMIT_DIR), once, at load: the
    module's ``__file__`` and every later message name that file even if something changes the directory after."""
    return os.path.abspath(os.path.expanduser(path))


def load_reward_func(path: str) -> Callable:
    """Import ``reward_func`` from a file and check its signature before any training starts.  The file may import
    ``openrlhf.utils`` (served while it loads, see the module docstring)."""
    from rlhf.agents.openrlhf_agent import openrlhf_names

    given, path = path, resolve_reward_path(path)
    if not os.path.isfile(path):
        where = "" if os.path.isabs(os.path.expanduser(given)) else \
            f" (a relative path resolves against the job's working directory {os.getcwd()})"
        raise RewardError(f"--remote_rm_url {given}: no such file {path}{where}; give a reward_func.py path or an "
                          f"http(s) URL")
    spec = importlib.util.spec_from_file_location(f"rlhf_user_reward_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        with openrlhf_names():
            spec.loader.exec_module(mod)
    except Exception as e:
        hint = ""
        if isinstance(e, ImportError) and "openrlhf" in str(e):
            hint = (" (rlhf serves openrlhf.utils.agent and openrlhf.utils' extract_boxed_answer, grade_answer and "
                    "math_utils; for other openrlhf modules install openrlhf)")
        if isinstance(e, ModuleNotFoundError) and e.name == "pylatexenc":
            hint = " (OpenRLHF's math_utils needs it: pip install pylatexenc, or pip install 'rlhf[math]')"
        raise RewardError(f"importing {path} failed: {type(e).__name__}: {e}{hint}") from e
    fn = getattr(mod, "reward_func", None)
    if fn is None or not callable(fn):
        raise RewardError(f"{path} defines no callable reward_func(queries, prompts, labels, **kwargs)")
    check_signature(fn, path)
    return fn


def check_signature(fn: Callable, where: str) -> None:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_var = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 3 and not has_var:
        raise RewardError(f"{where}: reward_func{sig} must accept (queries, prompts, labels, **kwargs)")
    required = [p for p in positional[3:] if p.default is p.empty]
    if required:
        raise RewardError(f"{where}: reward_func{sig} has extra required arguments {[p.name for p in required]}")


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


API_KEY_ENV = "RLHF_RM_API_KEY"


def http_reward_func(url: str, timeout_s: float = 120.0, retries: int = 2, api_key: Optional[str] = None) -> Callable:
    """A reward_func that POSTs ``{"query": [...], "prompts": [...], "labels": [...]}`` as JSON to url.

    The body is OpenRLHF's (openrlhf/utils/remote_rm_utils.py ``remote_rm_fn``: ``{"query": queries, "prompts":
    prompts, "labels": labels}``; its serve_rm reads ``query``), so a reward server written for OpenRLHF works
    unchanged; the answer's ``rewards`` (and optional ``scores``, ``extra_logs``) are read as OpenRLHF's are.

    One deadline (``timeout_s``, --reward_timeout_s) covers every try; a connection error, a timeout, an answer cut
    off mid-body (``http.client.IncompleteRead``, or a 2xx body that is not whole JSON) or a 5xx is tried again up to
    ``retries`` more times (--remote_rm_retries) while time is left; a 4xx is final.  When no try succeeds, one
    line says how many tries, the last failure and what to do.

    ``api_key`` (default: the environment variable RLHF_RM_API_KEY, read at each call) is sent as
    ``Authorization: Bearer <key>``, what ``rlhf.serve_rm --api_key`` checks; no key, no header.
    """
    def call(queries, prompts, labels, **kwargs):
        body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}).encode()
        headers = {"Content-Type": "application/json"}
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        deadline = time.monotonic() + timeout_s
        what = f"the reward server's answer to POST {url} ({len(queries)} queries, {len(body)} bytes)"
        last, tries = "no try made", 0
        for attempt in range(retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            tries += 1
            req = urllib.request.Request(url, data=body, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=left) as resp:
                    return _read_answer(resp)
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if 400 <= e.code < 500:
                    hint = ""
                    if e.code == 401:
                        hint = (f" (set {API_KEY_ENV} to the server's --api_key; it is "
                                f"{'set but differs' if key else 'not set'} here)")
                    raise RewardError(f"reward server {url} rejected the request ({e.code}): {detail}{hint}") from None
                last = f"HTTP {e.code}: {detail}"
            except urllib.error.URLError as e:
                reason = e.reason
                if isinstance(reason, (TimeoutError, socket.timeout)):
                    last = f"no answer within {left:.3g}s"
                elif isinstance(reason, ConnectionRefusedError):
                    last = "connection refused (is the server running? python -m rlhf.serve_rm ...)"
                else:
                    last = f"{type(reason).__name__}: {reason}"
            except TimeoutError:
                last = f"no answer within {left:.3g}s"
            except http.client.IncompleteRead as e:  # the answer cut off: tried again like a reset connection
                got = len(e.partial)
                last = (f"the answer was cut off after {got} of {got + e.expected} bytes (IncompleteRead: the "
                        f"server or a proxy closed the connection mid-answer)" if e.expected is not None else
                        f"the answer was cut off after {got} bytes (IncompleteRead)")
            except _Truncated as e:
                last = str(e)
            except (http.client.HTTPException, ConnectionError, OSError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            pause = min(2 ** attempt * 0.5, 5, max(0.0, deadline - time.monotonic()))
            if attempt < retries and pause > 0:
                time.sleep(pause)
        fix = (" (the server closed the connection mid-answer: see its log for why; a proxy may cap the answer's "
               "size)" if "IncompleteRead" in last else "")
        raise RewardError(f"waited {timeout_s:g}s (--reward_timeout_s) for {what}: {tries} tries "
                          f"(--remote_rm_retries {retries}), last: {last}{fix}")

    return call


class _Truncated(Exception):
    """A 2xx answer whose body is not whole JSON (cut off without a Content-Length to tell)."""


def _read_answer(resp) -> dict:
    data = resp.read()
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _Truncated(f"the answer ({len(data)} bytes, HTTP {resp.status}) is not whole JSON ({e}): cut off, or "
                         f"not a reward server; starts {data[:80]!r}") from None


def sharded_http_reward_func(urls: List[str], timeout_s: float = 120.0, retries: int = 2,
                             api_key: Optional[str] = None) -> Callable:
    """Several reward servers: the batch is split into contiguous chunks of ceil(n / k) queries, chunk i goes to
    server i, all in parallel, and the answers are joined in order: OpenRLHF's semantics for a comma list of URLs
    (openrlhf/utils/remote_rm_utils.py ``RemoteRewardModel.get_rewards`` in 0.9, openrlhf/utils/agent.py
    ``SingleTurnAgentExecutor._fetch_rewards_via_http`` in 0.10-0.11: ``batch_size = (n + num_servers - 1) //
    num_servers``, server i gets ``[i * batch_size, (i + 1) * batch_size)``).  One difference: a server whose chunk
    is empty (fewer queries than servers) is not called (OpenRLHF posts it an empty list).  Each call has the
    whole deadline and retries of ``http_reward_func``; the first failure is raised, naming its server.
    ``extra_logs`` keys that only some servers return are NaN (not logged) for the other servers' rows.
    """
    from concurrent.futures import ThreadPoolExecutor

    fns = [http_reward_func(u, timeout_s, retries, api_key) for u in urls]

    def call(queries, prompts, labels, **kwargs):
        n, k = len(queries), len(urls)
        size = (n + k - 1) // k
        spans = [(i, i * size, min((i + 1) * size, n)) for i in range(k) if i * size < n]
        with ThreadPoolExecutor(len(spans), thread_name_prefix="reward_http") as pool:
            futs = [pool.submit(fns[i], queries[a:b], prompts[a:b], labels[a:b]) for i, a, b in spans]
            parts = [check_result(f.result(), b - a, urls[i]) for f, (i, a, b) in zip(futs, spans)]
        keys = sorted({key for p in parts for key in p["extra_logs"]})
        return {"rewards": torch.cat([p["rewards"] for p in parts]), "scores": torch.cat([p["scores"] for p in parts]),
                "extra_logs": {key: torch.cat([p["extra_logs"].get(key, torch.full_like(p["rewards"], float("nan")))
                                               for p in parts]) for key in keys}}

    return call


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
