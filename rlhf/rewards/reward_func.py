"""Reward functions: a local ``reward_func.py`` or an HTTP reward server, behind one checked call.

API (OpenRLHF's): ``reward_func(queries, prompts, labels, **kwargs) -> {"rewards", "scores", "extra_logs"}``,
sync or ``async def``, called once per batch.  ``queries`` are prompt + response texts.
"""
from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import socket
import threading
import time
import traceback
import urllib.error
import urllib.request
from typing import Callable, Dict, List, Optional

import torch


class RewardError(RuntimeError):
    pass


def load_reward_func(path: str) -> Callable:
    """Import ``reward_func`` from a file and check its signature before any training starts."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise RewardError(f"--remote_rm_url {path}: no such file (give a reward_func.py path or an http(s) URL)")
    spec = importlib.util.spec_from_file_location(f"rlhf_user_reward_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise RewardError(f"importing {path} failed: {type(e).__name__}: {e}") from e
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
    extra = {}
    for k, v in (out.get("extra_logs") or {}).items():
        extra[k] = _as_tensor(v, n, f"extra_logs[{k}]", where) if not isinstance(v, (int, float)) else \
            torch.full((n,), float(v))
    return {"rewards": rewards, "scores": scores, "extra_logs": extra}


class RewardTimeout(Exception):
    pass


def call_with_deadline(fn: Callable, args: tuple, kwargs: dict, timeout_s: float):
    """``fn(*args, **kwargs)`` (awaited when it returns an awaitable), given ``timeout_s`` seconds.

    Runs in a daemon thread, so a sync function that blocks is given up on (RewardTimeout) instead of hanging
    the rank; the thread is left behind (Python cannot kill it) and does not keep the process alive.
    """
    box: Dict[str, object] = {}
    done = threading.Event()

    def work():
        try:
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                out = asyncio.run(_await(out))
            box["out"] = out
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = e
        finally:
            done.set()

    threading.Thread(target=work, name="reward_func", daemon=True).start()
    if not done.wait(timeout_s if timeout_s and timeout_s > 0 else None):
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


def http_reward_func(url: str, timeout_s: float = 120.0, retries: int = 2) -> Callable:
    """A reward_func that POSTs ``{"query": [...], "prompts": [...], "labels": [...]}`` as JSON to url.

    The body is OpenRLHF's (openrlhf/utils/remote_rm_utils.py ``remote_rm_fn``: ``{"query": queries, "prompts":
    prompts, "labels": labels}``; its serve_rm reads ``query``), so a reward server written for OpenRLHF works
    unchanged; the answer's ``rewards`` (and optional ``scores``, ``extra_logs``) are read as OpenRLHF's are.

    One deadline (``timeout_s``, --reward_timeout_s) covers every try; a connection error, a timeout or a 5xx is
    tried again up to ``retries`` more times (--remote_rm_retries) while time is left; a 4xx is final.
    """
    def call(queries, prompts, labels, **kwargs):
        body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}).encode()
        deadline = time.monotonic() + timeout_s
        what = f"the reward server's answer to POST {url} ({len(queries)} queries, {len(body)} bytes)"
        last, tries = "no try made", 0
        for attempt in range(retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            tries += 1
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=left) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if 400 <= e.code < 500:
                    raise RewardError(f"reward server {url} rejected the request ({e.code}): {detail}") from None
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
            except (ConnectionError, OSError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            pause = min(2 ** attempt * 0.5, 5, max(0.0, deadline - time.monotonic()))
            if attempt < retries and pause > 0:
                time.sleep(pause)
        raise RewardError(f"waited {timeout_s:g}s (--reward_timeout_s) for {what}: {tries} tries "
                          f"(--remote_rm_retries {retries}), last: {last}")

    return call


def make_reward_source(spec: Optional[str], timeout_s: float = 120.0, log=print, retries: int = 2) -> Optional[RewardSource]:
    """``--remote_rm_url``: a reward_func.py path, an http(s) URL (first of a comma list), or builtin:arithmetic."""
    if not spec:
        return None
    first = spec.split(",")[0].strip()
    if first == "builtin:arithmetic":
        return builtin_reward_source(log)
    if first.startswith(("http://", "https://")):
        # the client keeps its own deadline; the outer one only backs it up
        return RewardSource(http_reward_func(first, timeout_s, retries), first, timeout_s + 5.0, log)
    return RewardSource(load_reward_func(first), first, timeout_s, log)


def builtin_reward_source(log=print) -> RewardSource:
    from rlhf.data.arithmetic import arithmetic_reward

    return RewardSource(arithmetic_reward, "builtin:arithmetic", log=log)
