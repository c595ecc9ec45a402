"""failfast: a rank whose torchrun agent is gone stops by itself; a dying rank takes its child processes along,
found through /proc (no psutil)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_descendants_and_kill_without_psutil():
    from rlhf.distributed.failfast import descendants, kill_descendants

    p = subprocess.Popen(["bash", "-c", "sleep 60 & (sleep 61 & wait) & wait"])
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end and len(descendants(p.pid)) < 4:
            time.sleep(0.05)
        kids = descendants(p.pid)
        assert len(kids) >= 3, f"expected the sleeps and the subshell below bash, found {kids}"
        assert kill_descendants(p.pid) == len(kids)
        assert all(_wait_gone(k, 5) for k in kids), "a child survived kill_descendants"
    finally:
        p.kill()
        p.wait()


RANK = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    from rlhf.distributed.failfast import AbortBoard, Watchdog
    import subprocess
    child = subprocess.Popen(["sleep", "60"])         # like vLLM's engine core or a reward sandbox
    Watchdog(default_s=600, poll_s=0.2, board_=AbortBoard(None))
    print(os.getpid(), child.pid, flush=True)
    time.sleep(60)
    print("still training", flush=True)
""")

AGENT = textwrap.dedent("""
    import subprocess, sys
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=open(sys.argv[2], "w"),
                            stderr=subprocess.STDOUT)
    rank.wait()
""")


def test_rank_stops_when_its_torchrun_agent_is_killed(tmp_path):
    """kill -9 of the agent: the rank notices within a poll, prints one line, ends its own child and exits."""
    out = tmp_path / "rank.log"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, RANK.format(root=ROOT), str(out)])
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and not (out.exists() and out.read_text().strip()):
            time.sleep(0.1)
        rank_pid, child_pid = map(int, out.read_text().split()[:2])
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        assert _wait_gone(rank_pid, 10), "the rank went on after its torchrun agent was killed"
        assert _wait_gone(child_pid, 5), "the rank's child process outlived it"
        text = out.read_text()
        assert "the torchrun agent (pid" in text and "is gone" in text and "still training" not in text, text
        assert text.count("stopping:") == 1, text
    finally:
        agent.kill()
