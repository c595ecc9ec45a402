"""Reward servers over HTTP (``--remote_rm_url http://...``): a client with retries and a deadline, the API key
from RLHF_RM_API_KEY, and a batch split across several servers (``sharded_http_reward_func``).
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Callable, List, Optional

import torch

from rlhf.rewards.result import RewardError, check_result

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
