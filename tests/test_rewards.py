"""reward_func loading and every bad-input case; the RM server over a real local HTTP port."""
import json
import math
import threading
import urllib.error
import urllib.request

import pytest
import torch
from conftest import post_json

from rlhf.rewards.reward_func import RewardError, RewardSource, http_reward_func, load_reward_func, make_reward_source


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


def _post(url, body: bytes):
    return post_json(url, body)


def test_rm_server_over_http(tiny_kit):
    import os

    from rlhf.serve_rm import RewardScorer, make_server

    scorer = RewardScorer(os.path.join(tiny_kit, "reward"), batch_size=2)
    server = make_server(scorer, "127.0.0.1", 0)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    try:
        code, out = _post(url, json.dumps({"queries": ["1+2=3", "1+2=4", "5+5=10"]}).encode())
        assert code == 200 and len(out["rewards"]) == 3 and all(isinstance(x, float) for x in out["rewards"])
        direct = scorer(["1+2=3", "1+2=4", "5+5=10"])
        assert out["rewards"] == pytest.approx(direct, abs=1e-5)
        alone = scorer(["1+2=4"])  # batching and padding do not change a score
        assert alone[0] == pytest.approx(direct[1], abs=1e-4)
        for bad, needle in ((b"not json", "not JSON"), (b"[1]", "JSON object"), (b'{"queries": []}', "non-empty"),
                            (b'{"queries": ["a"], "labels": [1, 2]}', "as long as")):
            code, out = _post(url, bad)
            assert code == 400 and needle in out["error"]
        fn = http_reward_func(url, timeout_s=30)
        src = RewardSource(fn, url)
        res = src(["1+2=3"], ["1+2="], ["3"])
        assert res["rewards"].tolist() == pytest.approx(direct[:1], abs=1e-5)
        with pytest.raises(RewardError, match="rejected the request"):
            http_reward_func(url)([], [], [])
    finally:
        server.shutdown()


def test_serve_rm_cli_end_to_end(tiny_kit):
    """python -m rlhf.serve_rm as users start it; then train-time client calls against it."""
    import os
    import re
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "rlhf.serve_rm", "--reward_pretrain", os.path.join(tiny_kit, "reward"),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r"(http://127\.0\.0\.1:\d+/get_reward)", line)
            if m:
                url = m.group(1)
                break
        assert url, "server did not report its address"
        src = make_reward_source(url)
        out = src(["1+2=3", "1+2=4"], ["1+2=", "1+2="], ["3", "3"])
        assert out["rewards"].shape == (2,) and torch.isfinite(out["rewards"]).all()
        with urllib.request.urlopen(url.replace("/get_reward", "/health"), timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
