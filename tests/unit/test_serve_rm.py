"""rlhf.serve_rm under hostile and heavy clients (127.0.0.1 only, each bounded in count and time), and its
truncation.  The server runs in a thread with a fake scorer whose micro-batch cost is known, so timings say
what the server did, not how fast the model is; the truncation test uses the tiny reward model."""
import json
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from helpers.net import post_json

from rlhf.rewards.remote import http_reward_func
from rlhf.rewards.result import RewardError
from rlhf.rewards.reward_func import RewardSource
from rlhf.rm_server.app import Limits, RewardApp
from rlhf.rm_server.server import RewardServer


class FakeScorer:
    """score_batch as RewardScorer's: rewards = query lengths; ``cost_s`` seconds per micro-batch."""

    def __init__(self, batch_size=4, cost_s=0.0):
        self.batch_size, self.cost_s = batch_size, cost_s

    def score_batch(self, queries):
        time.sleep(self.cost_s)
        return [float(len(q)) for q in queries], [False] * len(queries)


class Served:
    def __init__(self, scorer=None, **limits):
        self.app = RewardApp(scorer or FakeScorer(), Limits(**limits))
        self.server = RewardServer(self.app, "127.0.0.1", 0)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/get_reward"
        deadline = time.monotonic() + 10
        while not self.server.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the server did not stop"


def post(url, obj, headers=None, timeout=10):
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def raw_request(port, n_queries):
    body = json.dumps({"query": ["q" * 5] * n_queries}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % len(body) + body)
    return s


def test_100_concurrent_clients_all_served():
    """100 clients connect at the same instant; the stdlib server's listen backlog of 5 reset 17-31% of them."""
    with Served(FakeScorer(batch_size=8)) as srv:
        go = threading.Barrier(100)
        results = [None] * 100

        def client(i):
            go.wait()
            try:
                results[i] = post(srv.url, {"query": ["x" * (i % 7 + 1)]}, timeout=30)[:2]
            except Exception as e:  # noqa: BLE001 - a reset connection is the failure under test
                results[i] = (type(e).__name__, str(e))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    bad = [(i, r) for i, r in enumerate(results) if r is None or r[0] != 200]
    assert not bad, f"{len(bad)} of 100 concurrent clients not served, e.g. {bad[:3]}"
    assert all(r[1]["rewards"] == [float(i % 7 + 1)] for i, r in enumerate(results)), "answers were mixed up"


def test_huge_request_rejected_small_one_answered_while_a_large_one_runs_and_a_gone_clients_work_stops():
    with Served(FakeScorer(batch_size=4, cost_s=0.005), max_queries_per_request=4096) as srv:
        t0 = time.monotonic()
        code, out, _ = post(srv.url, {"query": ["a"] * 60000})
        assert code == 413 and "--max_queries_per_request" in out["error"] and "60000" in out["error"], (code, out)
        assert time.monotonic() - t0 < 5, "the 60,000-query request was not refused at once"
        big = raw_request(srv.port, 4000)  # 1000 micro-batches x 5 ms = 5 s of work
        while srv.app.batches_scored < 5:
            time.sleep(0.01)
        t0 = time.monotonic()
        code, out, _ = post(srv.url, {"query": ["abc"]})
        took = time.monotonic() - t0
        assert code == 200 and out["rewards"] == [3.0]
        assert took < 1.0, f"a 1-query request waited {took:.2f}s behind a 4000-query one"
        assert srv.app.batches_scored < 900, "the small request was answered only after the large one"
        big.close()  # the client leaves: its remaining ~900 micro-batches must not run
        time.sleep(0.3)
        at_close = srv.app.batches_scored
        time.sleep(0.5)
        assert srv.app.batches_scored - at_close <= 1, \
            f"{srv.app.batches_scored - at_close} micro-batches ran for a client that had left"
        assert srv.app.cancelled == 1 and srv.app.pending == 0


def test_request_deadline_gives_504_and_drops_the_rest():
    with Served(FakeScorer(batch_size=1, cost_s=0.05), request_deadline_s=0.3) as srv:
        t0 = time.monotonic()
        code, out, _ = post(srv.url, {"query": ["a"] * 200})  # 200 x 50 ms = 10 s of work
        assert code == 504 and "--request_deadline_s" in out["error"] and time.monotonic() - t0 < 2, (code, out)
        time.sleep(0.2)
        n = srv.app.batches_scored
        time.sleep(0.3)
        assert srv.app.batches_scored - n <= 1 and n < 20, (n, srv.app.batches_scored)


def test_pending_queries_bound_is_503_with_retry_after():
    with Served(FakeScorer(batch_size=10, cost_s=0.2), max_pending_queries=30) as srv:
        hog = raw_request(srv.port, 25)
        while srv.app.pending == 0:
            time.sleep(0.01)
        code, out, headers = post(srv.url, {"query": ["a"] * 10})
        assert code == 503 and "--max_pending_queries" in out["error"] and headers.get("retry-after") == "1"
        hog.close()


def test_chunked_body_is_read():
    """A body sent with Transfer-Encoding: chunked (no Content-Length) is scored, not refused as empty."""
    with Served() as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        body = json.dumps({"query": ["abc", "de"]}).encode()
        s.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                  + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        data = _read_all(s)
    head, _, payload = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and json.loads(payload)["rewards"] == [3.0, 2.0], data[:300]


def _read_all(s):
    data = b""
    while True:
        try:
            chunk = s.recv(4096)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
    return data


def test_trickling_clients_are_dropped():
    """A client that sends a byte every 0.1 s never lets a per-read socket timeout expire (the stdlib server's
    only bound); the request deadline drops it, headers or body."""
    with Served(request_timeout_s=0.5) as srv:
        for head, trickle in ((b"POST /get_reward HTTP/1.1\r\n", b"X-Slow: a" * 40),
                              (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n", b"[" * 500)):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(head)
                t0 = time.monotonic()
                dropped = None
                for b in trickle:
                    try:
                        s.sendall(bytes([b]))
                    except (BrokenPipeError, ConnectionResetError):
                        dropped = time.monotonic() - t0
                        break
                    s.settimeout(0.1)
                    try:
                        if s.recv(4096, socket.MSG_PEEK) is not None:
                            dropped = time.monotonic() - t0
                            break
                    except TimeoutError:
                        pass
                assert dropped is not None and dropped < 2.0, f"a trickling client was kept {time.monotonic() - t0:.1f}s"
                s.settimeout(5)
                data = _read_all(s)
                assert data == b"" or b" 408 " in data.split(b"\r\n")[0], data[:100]


def test_api_key(monkeypatch):
    with Served(api_key="s3cret") as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            code, out, h = post(srv.url, {"query": ["ab"]}, headers)
            assert code == 401 and "API key" in out["error"] and h.get("www-authenticate") == "Bearer", (headers, code)
        code, out, _ = post(srv.url, {"query": ["ab"]}, {"Authorization": "Bearer s3cret"})
        assert code == 200 and out["rewards"] == [2.0]
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=10) as r:
            assert r.status == 200  # health checks need no key
        monkeypatch.delenv("RLHF_RM_API_KEY", raising=False)
        with pytest.raises(RewardError, match=r"rejected the request \(401\).*RLHF_RM_API_KEY.*not set"):
            http_reward_func(srv.url, timeout_s=10)(["ab"], ["a"], [None])
        monkeypatch.setenv("RLHF_RM_API_KEY", "s3cret")
        assert http_reward_func(srv.url, timeout_s=10)(["ab"], ["a"], [None])["rewards"] == [2.0]


def test_long_query_keeps_its_response(tiny_kit):
    """Two answers to one prompt longer than --max_len: truncating from the right (the tokenizer's default, and
    OpenRLHF's serve_rm) cut both answers off and gave them the same reward; from the left each keeps its answer."""
    from rlhf.rm_server.scoring import RewardScorer, encode_left_truncated

    scorer = RewardScorer(os.path.join(tiny_kit, "reward"), batch_size=2, max_len=24)
    prompt = "1+2=3, " * 20
    answers = [prompt + "4+4=8", prompt + "9+9=1"]
    ids, mask, cut = encode_left_truncated(scorer.tok, answers, 24, 0)
    full = scorer.tok(answers, add_special_tokens=False)["input_ids"]
    assert cut == [True, True] and ids.shape[1] == 24 and ids[0].tolist() == full[0][-24:]
    rewards, flags = scorer.score_batch(answers)
    assert flags == [True, True]
    assert abs(rewards[0] - rewards[1]) > 1e-4, f"two different answers got the same reward {rewards}"
    with Served(scorer) as srv:
        code, out, _ = post(srv.url, {"query": answers + ["1+2=3"]})
        assert code == 200 and out["extra_logs"]["rm_query_truncated"] == [1.0, 1.0, 0.0]
        assert out["rewards"][:2] == pytest.approx(rewards, abs=1e-5)


# ---- routes, validation, the real reward model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def rm_server(tiny_kit):
    from rlhf.rm_server.app import Limits, RewardApp
    from rlhf.rm_server.scoring import RewardScorer
    from rlhf.rm_server.server import RewardServer

    server = RewardServer(RewardApp(RewardScorer(os.path.join(tiny_kit, "reward"), batch_size=2),
                                    Limits(request_timeout_s=0.5)), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _post(port, body: bytes, headers=None):
    return post_json(f"http://127.0.0.1:{port}/get_reward", body, headers, timeout=10)


def test_serve_rm_empty_query_is_400(rm_server):
    code, out = _post(rm_server, json.dumps({"queries": [""]}).encode())
    assert code == 400 and "empty strings" in out["error"], (code, out)
    code, out = _post(rm_server, json.dumps({"queries": ["1+2=3", "  "]}).encode())
    assert code == 400 and "[1]" in out["error"]
    code, out = _post(rm_server, json.dumps({"queries": ["1+2=3"]}).encode())
    assert code == 200 and len(out["rewards"]) == 1


def test_serve_rm_half_sent_request_times_out(rm_server):
    with socket.create_connection(("127.0.0.1", rm_server), timeout=10) as s:
        s.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"queries\": [")   # then stops sending
        t0 = time.monotonic()
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        took = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.0 408") or data.startswith(b"HTTP/1.1 408"), data[:80]
    assert b"not received within 0.5s" in data and took < 5
    with socket.create_connection(("127.0.0.1", rm_server), timeout=10) as s:
        s.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\n")          # headers never finished
        t0 = time.monotonic()
        while s.recv(4096):
            pass
        assert time.monotonic() - t0 < 5, "the server kept a half-sent request open"
    with socket.create_connection(("127.0.0.1", rm_server), timeout=10) as s:
        s.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
        data = b""
        while b"}" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    assert b" 400 " in data.split(b"\r\n")[0] and b"Invalid HTTP request" in data  # h11 refuses it


def test_serve_rm_accepts_openrlhf_query_key(rm_server):
    """OpenRLHF's client posts ``query`` (openrlhf/utils/remote_rm_utils.py remote_rm_fn): 200 with the same
    scores as ``queries``; a body with neither is a 400 that shows the body to send."""
    texts = ["1+2=3", "1+2=4"]
    code, a = _post(rm_server, json.dumps({"query": texts, "prompts": ["1+2="] * 2, "labels": ["3", "3"]}).encode())
    assert code == 200 and len(a["rewards"]) == 2, (code, a)
    code, b = _post(rm_server, json.dumps({"queries": texts}).encode())
    assert code == 200 and a["rewards"] == pytest.approx(b["rewards"], abs=1e-6)
    code, out = _post(rm_server, json.dumps({"texts": texts}).encode())
    assert code == 400 and "no 'query'" in out["error"] and '{"query": [' in out["error"], out
    code, out = _post(rm_server, json.dumps({"query": ["a"], "labels": [1, 2]}).encode())
    assert code == 400 and "as long as 'query'" in out["error"], out


def test_rm_server_over_http(tiny_kit):
    from rlhf.rm_server.app import Limits, RewardApp
    from rlhf.rm_server.scoring import RewardScorer
    from rlhf.rm_server.server import RewardServer

    scorer = RewardScorer(os.path.join(tiny_kit, "reward"), batch_size=2)
    server = RewardServer(RewardApp(scorer, Limits(request_timeout_s=30.0)), "127.0.0.1", 0)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    try:
        code, out = post_json(url, json.dumps({"queries": ["1+2=3", "1+2=4", "5+5=10"]}).encode())
        assert code == 200 and len(out["rewards"]) == 3 and all(isinstance(x, float) for x in out["rewards"])
        direct = scorer(["1+2=3", "1+2=4", "5+5=10"])
        assert out["rewards"] == pytest.approx(direct, abs=1e-5)
        alone = scorer(["1+2=4"])  # batching and padding do not change a score
        assert alone[0] == pytest.approx(direct[1], abs=1e-4)
        for bad, needle in ((b"not json", "not JSON"), (b"[1]", "JSON object"), (b'{"queries": []}', "non-empty"),
                            (b'{"queries": ["a"], "labels": [1, 2]}', "as long as")):
            code, out = post_json(url, bad)
            assert code == 400 and needle in out["error"]
        fn = http_reward_func(url, timeout_s=30)
        src = RewardSource(fn, url)
        res = src(["1+2=3"], ["1+2="], ["3"])
        assert res["rewards"].tolist() == pytest.approx(direct[:1], abs=1e-5)
        with pytest.raises(RewardError, match="rejected the request"):
            http_reward_func(url)([], [], [])
    finally:
        server.shutdown()


SERVE_REMOTE_RM_011 = ["--reward.model_name_or_path", "{rm}", "--port", "0", "--ds.param_dtype", "bf16",
                       "--ds.attn_implementation", "flash_attention_2", "--reward.normalize_enable",
                       "--data.max_len", "8192", "--batch_size", "16"]
SERVE_REMOTE_RM_0101 = ["--reward_pretrain", "{rm}", "--port", "0", "--param_dtype", "bf16",
                        "--attn_implementation", "flash_attention_2", "--normalize_reward", "--max_len", "8192",
                        "--batch_size", "16"]


def _start_cli(monkeypatch, args):
    """rlhf.serve_rm's CLI in-process up to serving: returns (the server it would serve, stderr notices)."""
    from rlhf import serve_rm

    started, notes = {}, []
    monkeypatch.setattr(serve_rm.RewardServer, "serve_forever", lambda self: started.setdefault("server", self))
    monkeypatch.setattr(serve_rm.click, "echo", lambda msg="", err=False, **kw: notes.append(str(msg)))
    was = torch.is_grad_enabled()
    try:
        serve_rm.main.main(args, standalone_mode=False)
    finally:
        torch.set_grad_enabled(was)  # main() turns autograd off for the whole (server) process
    started["server"].sock.close()
    return started["server"], notes


@pytest.mark.parametrize("script", [SERVE_REMOTE_RM_011, SERVE_REMOTE_RM_0101], ids=["0.11-dotted", "0.10.1-flat"])
def test_openrlhf_serve_remote_rm_script_runs_with_openrlhf_meaning(tiny_kit, tmp_path, monkeypatch, script):
    """OpenRLHF's serve_remote_rm.sh (openrlhf/cli/serve_rm.py flags): before, only --port/--batch_size were known.
    Meaning checked: --param_dtype bf16 -> bf16 weights; --max_len 8192; --batch_size 16; --normalize_reward ->
    (score - mean) / std with the mean/std saved in config.json (openrlhf/models/model.py RewardModel.forward:
    ``if not self.training and self.normalize_reward``); flash_attention_2 on a CPU -> sdpa with a notice."""
    import shutil

    rm = str(tmp_path / "rm")
    shutil.copytree(os.path.join(tiny_kit, "reward"), rm)
    if os.path.exists(os.path.join(rm, "reward_norm.json")):
        os.remove(os.path.join(rm, "reward_norm.json"))
    with open(os.path.join(rm, "config.json")) as fh:
        cfg = json.load(fh)
    cfg.update(mean=0.25, std=2.0)  # OpenRLHF saves them in config.json
    with open(os.path.join(rm, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    server, notes = _start_cli(monkeypatch, [a.replace("{rm}", rm) for a in script] + ["--no_warmup"])
    scorer = server.app.scorer
    assert scorer.max_len == 8192 and scorer.batch_size == 16, (scorer.max_len, scorer.batch_size)
    assert {p.dtype for p in scorer.model.parameters()} == {torch.bfloat16}
    assert scorer.stats == (0.25, 2.0), f"--normalize_reward did not apply config.json's mean/std: {scorer.stats}"
    assert any("flash_attention_2" in n and "sdpa" in n for n in notes), notes
    assert scorer.model.config._attn_implementation == "sdpa"
    raw = RewardScorerFor(rm)(["1+2=3", "1+2=4"])
    got = scorer(["1+2=3", "1+2=4"])
    assert got == pytest.approx([(r - 0.25) / 2.0 for r in raw], abs=0.03), (got, raw)  # bf16 vs fp32


def RewardScorerFor(path, **kw):
    from rlhf.rm_server.scoring import RewardScorer

    return RewardScorer(path, batch_size=2, **kw)


def test_raw_score_without_normalize_reward_and_a_notice(tiny_kit, tmp_path):
    """OpenRLHF serves the raw score unless --normalize_reward (issue 41 item 1's meaning); a saved mean/std left
    unused is said once at start."""
    import shutil

    rm = str(tmp_path / "rm")
    shutil.copytree(os.path.join(tiny_kit, "reward"), rm)
    with open(os.path.join(rm, "reward_norm.json"), "w") as fh:
        json.dump({"mean": 1.0, "std": 4.0}, fh)
    logged = []
    raw = RewardScorerFor(rm, log=logged.append)
    assert raw.stats == (0.0, 1.0) and any("--normalize_reward" in m for m in logged), logged
    norm = RewardScorerFor(rm, normalize=True)
    a, b = raw(["1+2=3"]), norm(["1+2=3"])
    assert b[0] == pytest.approx((a[0] - 1.0) / 4.0, abs=1e-5)


def test_placement_puts_the_model_on_cuda_when_there_is_one(tiny_kit, monkeypatch):
    """Issue 40 item 10: OpenRLHF's serve_rm loads with device_map="auto" in bf16 (openrlhf/cli/serve_rm.py
    RewardModelProxy; openrlhf/models/model.py get_llm_for_sequence_regression, param_dtype default bf16): with
    CUDA visible, from_pretrained must get device_map="auto" and bf16 (before: always the CPU, fp32)."""
    from rlhf.models import load
    from rlhf.rm_server.scoring import RewardScorer, resolve_placement

    gpu = resolve_placement("auto", "auto", "auto", cuda_available=True, flash_available=False)
    assert gpu.device_map == "auto" and gpu.dtype == torch.bfloat16 and gpu.attn_implementation == "sdpa"
    assert resolve_placement("auto", "auto", "auto", cuda_available=True, flash_available=True
                             ).attn_implementation == "flash_attention_2"
    assert resolve_placement("cuda:1", "fp16", "eager", cuda_available=True).device_map == {"": "cuda:1"}
    cpu = resolve_placement("auto", "auto", "auto", cuda_available=False)
    assert cpu.device_map is None and cpu.dtype == torch.float32 and cpu.attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="--device cuda: no CUDA device"):
        resolve_placement("cuda", cuda_available=False)
    seen = {}
    real = load.from_pretrained_or_meta

    def spy(auto_cls, path, on_meta=False, config_kwargs=None, **kw):
        seen.update(kw)
        kw.pop("device_map", None)  # no GPU here: load on the CPU, the arguments are what is checked
        return real(auto_cls, path, on_meta, config_kwargs, **kw)

    monkeypatch.setattr(load, "from_pretrained_or_meta", spy)
    scorer = RewardScorer(os.path.join(tiny_kit, "reward"), batch_size=2, placement=gpu)
    assert seen["device_map"] == "auto" and seen["dtype"] == torch.bfloat16, seen
    assert {p.dtype for p in scorer.model.parameters()} == {torch.bfloat16}
    out = scorer(["1+2=3"])
    assert isinstance(out[0], float) and math.isfinite(out[0])


def test_deeply_nested_json_is_400_not_500():
    """Issue 42 item 8: 100,000 levels of nesting raised RecursionError inside json.loads -> a bare 500."""
    with Served() as srv:
        for body in (b"[" * 100_000 + b"]" * 100_000,
                     b'{"query": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
            code, out, _ = post(srv.url, body)
            assert code == 400 and "nested deeper" in out["error"], (code, out)
        assert post(srv.url, {"query": ["ab"]})[0] == 200  # and the server still serves


def test_long_query_is_cut_in_characters_before_tokenizing(tiny_kit):
    """Issue 42 item 9: a 10 MB single-string query was tokenized whole (24 s on the model thread) before the cut to
    --max_len; now at most a few times max_len * 8 characters reach the tokenizer, and the kept tokens are those of
    the whole text."""
    from rlhf.rm_server.scoring import RewardScorer, tokenize_tails

    scorer = RewardScorer(os.path.join(tiny_kit, "reward"), batch_size=2, max_len=32)
    longest = []
    real = scorer.tok

    class Spy:
        def __call__(self, texts, **kw):
            longest.append(max(len(t) for t in texts))
            return real(texts, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    scorer.tok = Spy()
    big = "1+2=3, " * 300_000 + "4+4=8"  # 2.1 MB
    t0 = time.monotonic()
    rewards, cut = scorer.score_batch([big, "1+2=3"])
    assert cut == [True, False] and time.monotonic() - t0 < 5
    assert max(longest) <= 32 * 8 * 4, f"{max(longest)} characters were tokenized for --max_len 32"
    tail = big[-5000:]
    assert tokenize_tails(real, [big], 32)[0][0] == real(tail, add_special_tokens=False)["input_ids"][-32:]

    class Words:  # one token per 30-character word: the first character cap leaves too few tokens, so it doubles
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[hash(w) % 1000 for w in t.split(" ")] for t in texts]}

    text = " ".join(f"{i:030d}" for i in range(200))
    ids, flags = tokenize_tails(Words(), [text, "short text"], 4)
    assert ids[0] == Words()([text])["input_ids"][0][-4:] and flags == [True, False]
    assert ids[1] == Words()(["short text"])["input_ids"][0]


def test_request_too_big_for_the_deadline_is_413_up_front():
    """Issue 42 item 9: a body of 4,000 queries ran into the 300 s deadline (504 after 300 s); refused at once with 413
    naming the limit when the fastest measured rate cannot score it within --request_deadline_s.  A request that
    fits is scored; a big body (over 256 KiB) is parsed off the event loop and still answered."""
    with Served(FakeScorer(batch_size=4, cost_s=0.05), request_deadline_s=1.0) as srv:
        q = ["x" * 1000] * 8  # 2 micro-batches of 4000 padded tokens, 0.05 s each: the rate
        assert post(srv.url, {"query": q})[0] == 200 and srv.app.s_per_token is not None
        t0 = time.monotonic()
        code, out, _ = post(srv.url, {"query": ["x" * 1000] * 400})  # 100 micro-batches: about 5 s
        took = time.monotonic() - t0
        assert code == 413 and "--request_deadline_s 1" in out["error"] and "at most about" in out["error"], out
        assert took < 0.9, f"refused after {took:.2f}s, not up front"
        assert srv.app.batches_scored == 2, "work of the refused request was started"
        assert post(srv.url, {"query": ["x" * 1000] * 12})[0] == 200  # 0.15 s: fits


def test_port_in_use_is_one_line_naming_the_flag(tiny_kit):
    """Issue 42 item 15: a port in use printed an OSError traceback after the model loaded; now one line naming
    --port and the fix, exit status 2, before the model loads."""
    from click.testing import CliRunner

    from rlhf.serve_rm import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = CliRunner().invoke(main, ["--reward_pretrain", os.path.join(tiny_kit, "reward"), "--port", str(port)])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.output, res.exception)
    assert f"--port {port} on 127.0.0.1 is in use" in lines[0] and "--port 0" in lines[0], lines
