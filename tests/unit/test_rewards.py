"""Reward sources: reward_func loading and every bad-input case, the call and its deadline, the HTTP client (one or
several servers), what reaches the advantages. The reward server itself: tests/unit/test_serve_rm.py."""
import hashlib
import json
import math
import os
import socket
import sys
import threading
import time

import pytest
import torch

from rlhf.rewards.remote import http_reward_func
from rlhf.rewards.result import RewardError
from rlhf.rewards.reward_file import load_reward_func
from rlhf.rewards.reward_func import RewardSource, make_reward_source


def _write(tmp_path, body, name="rf.py"):
    f = tmp_path / name
    f.write_text(body)
    return str(f)


GOOD = """
import torch
def reward_func(queries, prompts, labels, **kwargs):
    return {"rewards": torch.tensor([float(len(q)) for q in queries]), "scores": [1.0] * len(queries),
            "extra_logs": {"len": [len(q) for q in queries]}}
"""


def test_good_reward_func_sync_and_async(tmp_path):
    src = make_reward_source(_write(tmp_path, GOOD))
    out = src(["ab", "abcd"], ["a", "a"], [None, None])
    assert out["rewards"].tolist() == [2.0, 4.0] and out["scores"].tolist() == [1.0, 1.0]
    assert out["extra_logs"]["len"].tolist() == [2.0, 4.0] and out["valid"].all()
    asrc = make_reward_source(_write(tmp_path, "async def reward_func(q, p, l, **kw):\n    return {'rewards': [0.5] * len(q)}\n", "a.py"))
    assert asrc(["x"], ["x"], [1])["rewards"].tolist() == [0.5]


@pytest.mark.parametrize("body,needle", [
    ("x = 1\n", "defines no callable reward_func"),
    ("def reward_func(queries):\n    return {}\n", "must accept (queries, prompts, labels"),
    ("def reward_func(q, p, l, needed):\n    return {}\n", "extra required arguments"),
    ("import nonexistent_pkg_xyz\n", "importing"),
])
def test_bad_reward_files(tmp_path, body, needle):
    with pytest.raises(RewardError, match=needle.replace("(", r"\(")):
        load_reward_func(_write(tmp_path, body))
    with pytest.raises(RewardError, match="no such file"):
        load_reward_func(str(tmp_path / "missing.py"))


@pytest.mark.parametrize("ret,needle", [
    ("[1.0]", "must return a dict with 'rewards'"),
    ("{'scores': [1.0]}", "must return a dict with 'rewards'"),
    ("{'rewards': [1.0, 2.0, 3.0]}", "has 3 values for a batch of 2"),
    ("{'rewards': ['a', 'b']}", "not a list/tensor of numbers"),
])
def test_bad_returns(tmp_path, ret, needle):
    src = make_reward_source(_write(tmp_path, f"def reward_func(q, p, l, **kw):\n    return {ret}\n"))
    with pytest.raises(RewardError, match=needle):
        src(["a", "b"], ["", ""], [0, 0])


def test_exception_and_timeout_and_nan(tmp_path):
    src = make_reward_source(_write(tmp_path, "def reward_func(q, p, l, **kw):\n    raise KeyError('label')\n"))
    with pytest.raises(RewardError) as e:
        src(["first query"], [""], [0])
    assert "KeyError" in str(e.value) and "first query" in str(e.value) and "Traceback" in str(e.value)
    slow = make_reward_source(_write(tmp_path, "import asyncio\nasync def reward_func(q, p, l, **kw):\n"
                                                 "    await asyncio.sleep(5)\n", "slow.py"), timeout_s=0.2)
    with pytest.raises(RewardError, match="did not return within 0.2s"):
        slow(["a"], [""], [0])
    logged = []
    nan = RewardSource(lambda q, p, labels: {"rewards": [1.0, math.nan, math.nan]}, "nanfn", log=logged.append)
    out = nan(["a", "b", "c"], ["", "", ""], [0, 0, 0])
    assert out["valid"].tolist() == [True, False, False] and out["rewards"].tolist() == [1.0, 0.0, 0.0]
    nan(["a", "b", "c"], ["", "", ""], [0, 0, 0])
    assert nan.invalid_total == 4 and len(logged) == 1 and "'b'" in logged[0]


def test_builtin_arithmetic_reward():
    src = make_reward_source("builtin:arithmetic")
    out = src(["3+4=7", "3+4=8", "3+4=x", "3+4= 7 because"], ["3+4="] * 4, ["7"] * 4)
    assert out["rewards"].tolist() == pytest.approx([1.0, 0.45, 0.0, 1.0])
    assert out["scores"].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_math_example_reward():
    src = make_reward_source("examples/reward_func_math.py")
    out = src(["Q: so the answer is #### 1,234", "Q: \\boxed{5}", "Q: none"], ["Q: "] * 3, ["#### 1234", "5", "3"])
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0]


def test_code_example_reward_sandboxed():
    src = make_reward_source("examples/reward_func_code.py")
    ok = "P:```python\ndef f(x):\n    return x + 1\n```"
    bad = "P:```python\ndef f(x):\n    return x\n```"
    loop = "P:```python\nwhile True: pass\n```"
    out = src([ok, bad, loop], ["P:"] * 3, ["assert f(1) == 2"] * 3)
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]




# ---- issue 27 item 5: silently wrong rewards --------------------------------------------------------------------
def test_reward_tensor_with_a_graph_is_detached(tmp_path):
    """A reward_func that returns a tensor still attached to autograd (an RM called outside no_grad): before the fix
    its graph rode into the advantages and the second micro-batch's backward raised "Trying to backward through
    the graph a second time"."""
    from rlhf.algorithms import compute_advantages

    src = make_reward_source(_write(tmp_path, "import torch\nw = torch.tensor(2.0, requires_grad=True)\n"
                                              "def reward_func(q, p, l, **kw):\n"
                                              "    return {'rewards': w * torch.tensor([float(len(x)) for x in q])}\n"))
    out = src(["a", "abc", "ab", "abcd"], [""] * 4, [None] * 4)
    assert not out["rewards"].requires_grad and out["rewards"].tolist() == [2.0, 6.0, 4.0, 8.0]
    adv, _ = compute_advantages("group_norm", out["rewards"], torch.ones(4, 3), group_size=4)
    logp = torch.zeros(4, 3, requires_grad=True)
    for rows in (slice(0, 2), slice(2, 4)):  # two micro-batches, one backward each
        (-(adv[rows] * logp[rows]).sum()).backward()
    assert logp.grad.abs().sum() > 0


def test_group_statistics_survive_a_huge_reward():
    """One reward of 1e20 in a group: in float32 the std's square overflowed to inf and every advantage of the group
    was 0; in float64, (s - mean) / std = [1.5, -0.5, -0.5, -0.5] (mean 2.5e19, std 5e19, n = 4)."""
    from rlhf.algorithms import compute_advantages

    scores = torch.tensor([1e20, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0])
    # scale="batch": centred on the group mean (2.5e19), over the batch's std (sqrt(8.75e39 / 7) = 3.5355e19)
    for scale, want in (("group", [1.5, -0.5, -0.5, -0.5]), ("batch", [2.12132, -0.707107, -0.707107, -0.707107])):
        adv, _ = compute_advantages("group_norm", scores, torch.ones(8, 2), group_size=4, scale=scale,
                                    clip_range=(-10.0, 10.0))
        assert adv.dtype == torch.float32 and torch.isfinite(adv).all()
        assert adv[:4, -1].tolist() == pytest.approx(want, abs=1e-5), (scale, adv[:, -1])
    adv, _ = compute_advantages("group_norm", scores, torch.ones(8, 2), group_size=4)
    assert adv[4:, -1].tolist() == pytest.approx([-1.1619, -0.3873, 0.3873, 1.1619], abs=1e-4)


SIGNAL_ALARM = """
import signal, time
class Timeout(Exception):
    pass
def _raise(signum, frame):
    raise Timeout()
def reward_func(queries, prompts, labels, **kw):
    out = []
    for q in queries:
        signal.signal(signal.SIGALRM, _raise)      # math_verify-style per-answer timeout
        signal.alarm(1)
        try:
            if q == "hang":
                time.sleep(10)
            out.append(float(len(q)))
        except Timeout:
            out.append(-1.0)
        finally:
            signal.alarm(0)
    return {"rewards": out}
"""


def test_reward_func_using_signal_alarm(tmp_path):
    """A reward function with its own signal.alarm timeout: before the fix every call ran on a worker thread and
    failed with Python's "signal only works in main thread"; called from the main thread (the trainers) it now
    runs there; from another thread the error says why."""
    src = make_reward_source(_write(tmp_path, SIGNAL_ALARM), timeout_s=30)
    t0 = time.monotonic()
    assert src(["ab", "hang", "abc"], [""] * 3, [None] * 3)["rewards"].tolist() == [2.0, -1.0, 3.0]
    assert time.monotonic() - t0 < 5
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("err", _raises(src, ["ab"], [""], [None])))
    th.start()
    th.join(30)
    msg = str(box["err"])
    assert "signal handler" in msg and "only on the main thread" in msg and "not the main thread" in msg, msg


def _raises(fn, *args):
    try:
        fn(*args)
    except RewardError as e:
        return e
    return None


def test_deadline_ends_a_reward_func_that_swallows_exceptions(tmp_path):
    """The main-thread deadline raises a BaseException inside the function: its own `except Exception` does not
    keep it running past --reward_timeout_s."""
    src = make_reward_source(_write(tmp_path, "import time\ndef reward_func(q, p, l, **kw):\n    while True:\n"
                                              "        try:\n            time.sleep(10)\n"
                                              "        except Exception:\n            pass\n"), timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match="did not return within 0.3s"):
        src(["a"], [""], [0])
    assert time.monotonic() - t0 < 3


def test_several_reward_urls_split_each_batch(tmp_path):
    """--remote_rm_url URL1,URL2: each batch is split in contiguous chunks of ceil(n / 2) across the servers, as
    OpenRLHF does (before the fix only the first URL was used, silently); a comma list of files is refused."""
    from test_serve_rm import Served

    with Served() as a, Served() as b:
        src = make_reward_source(f"{a.url}, {b.url}", timeout_s=10)
        q = ["a", "bb", "ccc", "dddd", "eeeee"]
        out = src(q, [""] * 5, [None] * 5)
        assert out["rewards"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert out["extra_logs"]["rm_query_truncated"].tolist() == [0.0] * 5
        assert (a.app.batches_scored, b.app.batches_scored) == (1, 1), "the batch did not reach both servers"
        assert src(["z"], [""], [None])["rewards"].tolist() == [1.0]  # one query: the second server is not called
        assert b.app.batches_scored == 1
    for spec in (f"{_write(tmp_path, GOOD)},{_write(tmp_path, GOOD, 'b.py')}", f"{_write(tmp_path, GOOD)},http://h/x"):
        with pytest.raises(RewardError, match="comma list must be http.s. reward servers only.*silently ignore"):
            make_reward_source(spec)


# ---- the HTTP client ---------------------------------------------------------------------------------------------
def test_sync_reward_func_timeout_enforced(tmp_path):
    f = tmp_path / "slow_sync.py"
    f.write_text("import time\ndef reward_func(q, p, l, **kw):\n    time.sleep(30)\n    return {'rewards': [1.0]}\n")
    src = make_reward_source(str(f), timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(RewardError) as e:
        src(["a"], [""], [0])
    took = time.monotonic() - t0
    assert "did not return within 0.3s" in str(e.value) and "--reward_timeout_s" in str(e.value)
    assert took < 5, f"a blocking sync reward_func held the caller {took:.1f}s past its 0.3s deadline"
    fast = RewardSource(lambda q, p, labels: {"rewards": [2.0] * len(q)}, "fast", timeout_s=5)
    assert fast(["a", "b"], ["", ""], [0, 0])["rewards"].tolist() == [2.0, 2.0]


class _LocalServer:
    """A TCP server on 127.0.0.1 whose accept loop hands each connection to ``handle`` (a reward server's stand-in)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.handle(c)

    def handle(self, conn):
        raise NotImplementedError

    @property
    def url(self):
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/get_reward"


class _Stalled(_LocalServer):
    """A TCP server that accepts and never answers (a paused reward server)."""

    def __init__(self):
        self.conns = []
        self.accepts = 0
        super().__init__()

    def handle(self, conn):
        self.accepts += 1
        self.conns.append(conn)

    def close(self):
        for c in self.conns:
            c.close()
        self.sock.close()


def test_http_client_deadline_covers_all_tries():
    srv = _Stalled()
    try:
        fn = http_reward_func(srv.url, timeout_s=1.0, retries=2)
        t0 = time.monotonic()
        with pytest.raises(RewardError) as e:
            fn(["1+2=3"], ["1+2="], ["3"])
        took = time.monotonic() - t0
        msg = str(e.value)
        assert took < 2.5, f"a paused server held the client {took:.1f}s for a 1s --reward_timeout_s"
        assert "waited 1s (--reward_timeout_s)" in msg and "the reward server's answer to POST" in msg
        assert "1 queries" in msg and "--remote_rm_retries 2" in msg and "no answer within" in msg
    finally:
        srv.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/get_reward"
    with pytest.raises(RewardError) as e:
        http_reward_func(dead, timeout_s=2.0, retries=1)(["x"], [""], [None])
    assert "connection refused (is the server running?" in str(e.value) and "2 tries" in str(e.value)


class _OpenRLHFStyleServer:
    """A reward server that reads only ``query``, as OpenRLHF's serve_rm does (openrlhf/cli/serve_rm.py:
    ``queries = data.get("query")``): anything else in the body is ignored, a body without it is a 400."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append(data)
                q = data.get("query")
                code, out = (400, {"error": "no query"}) if not q else \
                    (200, {"rewards": [float(len(x)) for x in q], "scores": [1.0] * len(q), "extra_logs": {}})
                body = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/get_reward"


def test_http_client_speaks_openrlhf_query_key():
    """Our client's body is OpenRLHF's {"query", "prompts", "labels"}: a server that reads only ``query`` scores
    every text (before the fix the client sent ``queries`` and such a server answered 400)."""
    srv = _OpenRLHFStyleServer()
    try:
        out = RewardSource(http_reward_func(srv.url, timeout_s=10), srv.url)(["ab", "abcd"], ["a", "a"], ["x", "y"])
        assert out["rewards"].tolist() == [2.0, 4.0], out
        assert srv.seen[-1] == {"query": ["ab", "abcd"], "prompts": ["a", "a"], "labels": ["x", "y"]}, srv.seen[-1]
    finally:
        srv.server.shutdown()


# ---- issue 41 item 10, issue 42 item 10, issue 40 item 14 -------------------------------------------------------
OPENRLHF_EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "openrlhf_examples")


def openrlhf_example(name: str, blob: str, dest) -> str:
    """Write OpenRLHF's examples/python/<name> from its copy in tests/openrlhf_examples (read at OpenRLHF main,
    version.txt 0.11.0), checked byte for byte against OpenRLHF's git blob id: the file runs unchanged."""
    with open(os.path.join(OPENRLHF_EXAMPLES, name + ".txt"), "rb") as fh:
        data = fh.read()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, f"{name} is not OpenRLHF's file"
    path = dest / name
    path.write_bytes(data)
    return str(path)


def test_openrlhf_math_reward_func_runs_unchanged_with_per_sample_semantics(tmp_path, capsys):
    """OpenRLHF's examples/python/math_reward_func.py imports ``openrlhf.utils`` (extract_boxed_answer, grade_answer:
    openrlhf/utils/math_utils.py, vendored) and returns ``math_accuracy`` as one value (0-d tensor): OpenRLHF calls
    reward functions one query at a time (openrlhf/utils/agent.py ``_fetch_rewards_via_func``, batch_size = 1).
    Before: the import failed; then the one-value log failed ("has 1 values for a batch of 4").  Now the rewards
    are the per-sample ones, and math_accuracy logged per row averages to the mean of OpenRLHF's per-sample calls."""
    pytest.importorskip("pylatexenc", reason="OpenRLHF's math_utils needs pylatexenc: pip install -e '.[test]'")
    path = openrlhf_example("math_reward_func.py", "5f5d5a0f8b63a3c6c47c0529e93ae16adecf2183", tmp_path)
    src = make_reward_source(path)
    assert not any(k == "openrlhf" or k.startswith("openrlhf.") for k in sys.modules), "the shim leaked"
    prompts = ["Q1: ", "Q2: ", "Q3: ", "Q4: "]
    answers = ["so \\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{7}", "no box: 3"]
    labels = ["0.5", "\\frac12", "8", "3"]
    out = src([p + a for p, a in zip(prompts, answers)], prompts, labels)
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0, 0.0] and out["scores"].tolist() == [1.0, 1.0, 0.0, 0.0]
    per_sample = [src([p + a], [p], [lab])["extra_logs"]["math_accuracy"].tolist()
                  for p, a, lab in zip(prompts, answers, labels)]
    assert per_sample == [[1.0], [1.0], [0.0], [0.0]]
    assert out["extra_logs"]["math_accuracy"].tolist() == [0.5] * 4
    assert out["extra_logs"]["math_accuracy"].mean() == pytest.approx(sum(x[0] for x in per_sample) / 4)
    assert "[Math Reward] Pred: \\frac{1}{2}, Gold: 0.5, Match: True" in capsys.readouterr().out


def test_one_value_extra_logs_and_what_is_still_refused(tmp_path):
    src = make_reward_source(_write(tmp_path, "import torch\ndef reward_func(q, p, l, **kw):\n"
                                              "    return {'rewards': [1.0] * len(q), 'extra_logs': {'a': torch.tensor(2.0), "
                                              "'b': [3.0], 'c': 4, 'd': [1.0, 2.0]}}\n"))
    with pytest.raises(RewardError, match=r"extra_logs\[d\]' has 2 values for a batch of 3.*one value for the batch"):
        src(["x", "y", "z"], [""] * 3, [None] * 3)
    out = src(["x", "y"], [""] * 2, [None] * 2)
    assert {k: v.tolist() for k, v in out["extra_logs"].items()} == {"a": [2.0, 2.0], "b": [3.0, 3.0],
                                                                      "c": [4.0, 4.0], "d": [1.0, 2.0]}


def test_openrlhf_utils_names_not_served_are_named(tmp_path):
    with pytest.raises(RewardError, match=r"cannot import name 'get_strategy'.*rlhf serves openrlhf.utils.agent"):
        load_reward_func(_write(tmp_path, "from openrlhf.utils import get_strategy\n"
                                          "def reward_func(q, p, l):\n    return {}\n"))


def test_relative_reward_path_resolves_against_the_working_directory(tmp_path, monkeypatch):
    """Issue 40 item 14: ``--remote_rm_url rf.py`` is the job's working directory's rf.py, resolved once: the
    loaded module's ``__file__`` is absolute (a file reading data beside itself keeps working after a chdir; Python's
    importlib did that already), and a missing file names the absolute path and the directory it was looked for in
    (before: only the name as given)."""
    (tmp_path / "data.txt").write_text("7")
    _write(tmp_path, "import os\nHERE = os.path.dirname(__file__)\n"
                     "def reward_func(q, p, l, **kw):\n"
                     "    want = open(os.path.join(HERE, 'data.txt')).read()\n"
                     "    return {'rewards': [float(x.endswith(want)) for x in q]}\n", "rf.py")
    monkeypatch.chdir(tmp_path)
    src = make_reward_source("rf.py")
    monkeypatch.chdir(tmp_path.parent)
    assert src(["3+4=7", "3+4=8"], ["", ""], [None, None])["rewards"].tolist() == [1.0, 0.0]
    with pytest.raises(RewardError, match=f"no such file {tmp_path.parent}/missing.py.*working directory "
                                          f"{tmp_path.parent}"):
        make_reward_source("missing.py")


class _CutOffServer(_LocalServer):
    """A reward server whose first ``cut`` answers stop after 20 of their Content-Length bytes and close the
    connection (a crashed worker, a proxy's limit): what the client sees as ``http.client.IncompleteRead``."""

    def __init__(self, cut: int):
        self.cut, self.served = cut, 0
        super().__init__()

    def handle(self, c):
        with c:
            data = b""
            while b"\r\n\r\n" not in data:
                data += c.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            n = int([x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")][0].split(b":")[1])
            while len(body) < n:
                body += c.recv(65536)
            q = json.loads(body)["query"]
            out = json.dumps({"rewards": [float(len(x)) for x in q]}).encode().ljust(100)
            self.served += 1
            send = out[:20] if self.served <= self.cut else out
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                      b"Connection: close\r\n\r\n" % len(out) + send)


def test_cut_off_answer_is_retried_then_said_in_one_line():
    """Issue 42 item 10: an answer cut off once (IncompleteRead) ended the run with a traceback: it was not in the
    retry list.  Now it is tried again within --reward_timeout_s; cut off every time, one line says so."""
    once = _CutOffServer(cut=1)
    out = http_reward_func(once.url, timeout_s=10, retries=2)(["ab", "abc"], ["", ""], [None, None])
    assert out["rewards"] == [2.0, 3.0] and once.served == 2
    always = _CutOffServer(cut=10 ** 6)
    t0 = time.monotonic()
    with pytest.raises(RewardError) as e:
        make_reward_source(always.url, timeout_s=5, retries=1)(["ab"], [""], [None])
    msg = str(e.value)
    assert "\n" not in msg and "2 tries (--remote_rm_retries 1)" in msg, msg
    assert "cut off after 20 of 100 bytes (IncompleteRead" in msg and "see its log" in msg, msg
    assert time.monotonic() - t0 < 5
