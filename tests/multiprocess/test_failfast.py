"""failfast: a rank whose torchrun agent is gone stops by itself; a dying rank takes its child processes along,
found through /proc (no psutil)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    from rlhf.distributed.abort import descendants, kill_descendants

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
    from rlhf.distributed.abort import AbortBoard
    from rlhf.distributed.watchdog import Watchdog
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
    from rlhf.rl.checks import batch_size_fix
    from rlhf.utils.cadence import planned_steps

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


STARTUP_RANK = textwrap.dedent("""
    import os, socket, sys, time
    sys.path.insert(0, {root!r})
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()  # nobody listens there
    os.environ.update(TORCHELASTIC_RUN_ID="test", TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", RLHF_DIST_BACKEND="gloo")
    from rlhf.distributed import comm, failfast
    comm.STORE_CONNECT_S = {connect_s}

    def main():
        print(os.getpid(), flush=True)
        t0 = time.monotonic()
        try:
            comm.init(1800)   # the agent's store never answers (the agent is dead or dying)
        except RuntimeError as e:
            print(f"init failed after {{time.monotonic() - t0:.1f}}s: {{e}}", flush=True)
            os._exit(3)
        print("initialised", flush=True)

    failfast.guarded(main)
""")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _start_rank(tmp_path, connect_s):
    out = tmp_path / "rank.log"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, STARTUP_RANK.format(root=ROOT, connect_s=connect_s),
                              str(out)])
    end = time.monotonic() + 60
    while time.monotonic() < end and not (out.exists() and out.read_text().strip()):
        time.sleep(0.1)
    return agent, out, int(out.read_text().split()[0])


def test_rank_stops_when_its_agent_is_killed_during_startup(tmp_path):
    """kill -9 of the torchrun agent while a rank is still in start-up (here: connecting to the agent's store in
    init_process_group, which torch retries for the whole --dist_timeout_s): the orphan check runs from the start
    of ``guarded``, so the rank stops within a poll with the one ``orphaned`` line (issue 42 item 4: 90-120 s)."""
    agent, out, rank_pid = _start_rank(tmp_path, connect_s=600)
    try:
        time.sleep(0.5)  # inside init_process_group's store connection
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        t0 = time.monotonic()
        assert _wait_gone(rank_pid, 8), "the rank still waits for the killed agent's store 8 s later"
        text = out.read_text()
        assert "the torchrun agent (pid" in text and "initialised" not in text, text
        assert time.monotonic() - t0 < 8
    finally:
        agent.kill()
        _kill(rank_pid)


def test_store_connection_has_a_short_timeout_of_its_own(tmp_path):
    """Under torchrun the ranks connect to the agent's store (torch/distributed/rendezvous.py
    ``_create_c10d_store``: a client, ``is_master=False``) with the whole --dist_timeout_s (1800 s) as the connect
    timeout; ours connects within comm.STORE_CONNECT_S and then names the cause (here 1 s, the agent alive but its
    store unreachable)."""
    agent, out, rank_pid = _start_rank(tmp_path, connect_s=1)
    try:
        agent.wait(timeout=20)
        text = out.read_text()
        assert "init failed after" in text and "no connection to torchrun's store at 127.0.0.1:" in text, text
        took = float(text.split("init failed after ")[1].split("s:")[0])
        assert took < 10, f"the store connection took {took}s with a 1 s connect timeout"
    finally:
        agent.kill()
        _kill(rank_pid)


def test_agent_gone_reads_the_parent_at_import(monkeypatch):
    """The agent is the parent read at import, not at the watchdog's start: a rank re-parented during a slow start
    (to PID 1, or another pid: a subreaper) counts as orphaned; torchrun itself as PID 1 (a container) does not."""
    from rlhf.distributed import failfast

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(failfast, "_PARENT_AT_IMPORT", 4242)
    monkeypatch.setattr(failfast.os, "getppid", lambda: 4242)
    assert failfast.launcher_pid() == 4242 and not failfast.agent_gone(4242)
    monkeypatch.setattr(failfast.os, "getppid", lambda: 1)
    assert failfast.agent_gone(4242)
    monkeypatch.setattr(failfast, "_PARENT_AT_IMPORT", 1)
    monkeypatch.setattr(failfast, "_cmdline", lambda pid: "/sbin/init")
    assert failfast.agent_gone(1), "a rank whose agent died before import (parent already init) is an orphan"
    monkeypatch.setattr(failfast, "_cmdline", lambda pid: "/usr/bin/python -m torch.distributed.run --nproc 8 ...")
    assert not failfast.agent_gone(1), "torchrun as a container's PID 1 is the agent"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert failfast.launcher_pid() is None and not failfast.agent_gone(None)


def test_one_rank_refusal_is_one_line_and_exit_2(monkeypatch, capsys):
    """A 1-rank job (no peer: guarded lets the exception through) refuses bad input as 2 ranks do: the one line
    ``error: <message>``, no traceback, exit 2 before any process group (issue 42: a 40-line traceback and exit 1)."""
    import pytest

    from rlhf.config.cli import main_entry
    from rlhf.distributed.failfast import guarded
    from rlhf.distributed.placement import TopologyError

    def run(cfg):
        def main():
            raise TopologyError("--ring_attn_size 2 must divide the actor ranks (1); use --ring_attn_size 1")
        return guarded(main)

    for k in ("WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(sys, "argv", ["rlhf.train_grpo"])
    with pytest.raises(SystemExit) as e:
        main_entry("grpo", run)
    err = capsys.readouterr().err
    assert e.value.code == 2, e.value.code
    assert err == "error: --ring_attn_size 2 must divide the actor ranks (1); use --ring_attn_size 1\n", err

    def crash(cfg):  # not a refusal: the traceback stays (a bug must show where it is)
        raise KeyError("bug")
    with pytest.raises(KeyError):
        main_entry("grpo", crash)


def test_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path, monkeypatch, capsys):
    """A --config with a YAML syntax error: one line with the file, the line and column (1-based) of the problem
    and where the open bracket began (PyYAML's MarkedYAMLError marks), exit 2; no parser traceback."""
    import pytest

    from rlhf.config.cli import main_entry

    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  learning_rate: 1e-3\n  bad: [1, 2\nfoo: bar\n")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["rlhf.train_sft", "--config", str(bad)])
    with pytest.raises(SystemExit) as e:
        main_entry("sft", lambda cfg: None)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: --config {bad}: YAML syntax error at line 4, column 4: expected ',' or ']'"), err
    assert "(opened at line 3, column 8)" in err, err


def test_one_rank_cli_refusals_end_in_one_line(tmp_path):
    """The real CLI on one rank, each refused before any process group with one line and exit 2 (issue 42 item
    15): --ring_attn_size 2 on one rank, and a hub name in offline mode (HF_HUB_OFFLINE=true, which
    huggingface_hub reads as on: huggingface_hub/constants.py ``_is_true``) that is neither a folder nor cached."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="true", HF_HUB_CACHE=str(tmp_path / "hub"))
    code = ("import sys; from rlhf.train_sft import run; from rlhf.config import main_entry\n"
            "d = sys.argv[1]\n"
            "for argv in (['--ring_attn_size', '2', '--packing_samples'], ['--pretrain', 'org/not-here-0.5B']):\n"
            "    sys.argv = ['rlhf.train_sft', '--save_path', d + '/m', '--ckpt_path', d + '/c',\n"
            "                '--log_dir', d + '/l', '--max_global_steps', '1'] + argv\n"
            "    try:\n"
            "        main_entry('sft', run)\n"
            "    except SystemExit as e:\n"
            "        print('rc', e.code, file=sys.stderr, flush=True)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    lines = p.stderr.strip().splitlines()
    assert lines == ["error: --ring_attn_size 2 must divide the world size 1; use --ring_attn_size 1", "rc 2",
                     lines[2], "rc 2"], p.stderr[-3000:]
    assert lines[2].startswith("error: --pretrain org/not-here-0.5B: not a local directory nor in the hub cache, "
                               "and HF_HUB_OFFLINE=true forbids downloading it"), lines[2]
