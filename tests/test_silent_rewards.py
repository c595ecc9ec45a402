"""Issue 18, reward side: sync reward_func deadlines, a proportionate HTTP client, serve_rm's 400 / 408."""
import json
import socket
import threading
import time

import pytest
from conftest import post_json

from rlhf.rewards.reward_func import RewardError, RewardSource, http_reward_func, make_reward_source


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


class _Stalled:
    """A TCP server that accepts and never answers (a paused reward server)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.conns = []
        self.accepts = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepts += 1
            self.conns.append(c)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/get_reward"

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


@pytest.fixture(scope="module")
def rm_server(tiny_kit):
    import os

    from rlhf.serve_rm import RewardScorer, make_server

    server = make_server(RewardScorer(os.path.join(tiny_kit, "reward"), batch_size=2), "127.0.0.1", 0,
                         request_timeout_s=0.5)
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
