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


def test_summary_line_names_a_full_disk_behind_a_wrapper():
    """torch.save / DCP wrap the OSError: the one-line summary still leads with 'No space left on device'."""
    import errno

    from rlhf.distributed.failfast import describe

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1234 vs 1200") from inner
    except RuntimeError as e:
        line = describe(e)
    assert line.startswith("No space left on device: free space, or point --ckpt_path"), line
    assert "RuntimeError: [enforce fail" in line

    class CheckpointException(Exception):  # DCP's: per-rank failures as (exception, traceback)
        failures = {1: (OSError(errno.ENOSPC, "No space left on device"), None)}

    assert describe(CheckpointException("CheckpointException ranks:dict_keys([1])")).startswith(
        "No space left on device")
    assert describe(ValueError("bad value")) == "ValueError: bad value"


def test_steps_capped_by_data_are_said_and_batch_fix_passes_every_check():
    from rlhf.trainers.cadence import planned_steps
    from rlhf.trainers.rl_trainer import batch_size_fix

    assert planned_steps(11, 1, 1000, "--num_episodes") == (11, planned_steps(11, 1, 1000, "--num_episodes")[1])
    total, note = planned_steps(11, 1, 1000, "--num_episodes")
    assert total == 11 and "--max_global_steps 1000" in note and "--num_episodes 91 runs 1000" in note, note
    assert planned_steps(11, 2, 5, "--max_epochs") == (5, None)
    assert planned_steps(11, 2, 0, "--max_epochs") == (22, None)
    # 24 samples (rollout 6 x n 4), micro 4 on 3 ranks: 12 and 24 fit both checks; 16 was suggested before
    fix = batch_size_fix(24, 16, 4, 3)
    assert fix == "e.g. --train_batch_size 12", fix
    b = int(fix.split()[-1])
    assert b % (4 * 3) == 0 and 24 % b == 0
    assert batch_size_fix(10, 8, 4, 2) == "e.g. --micro_train_batch_size 1 --train_batch_size 10"
    assert "make that a multiple of 4" in batch_size_fix(6, 6, 1, 4)
