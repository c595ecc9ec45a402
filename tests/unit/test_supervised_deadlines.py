"""SFT / RM / DPO under the watchdog as the RL trainers are (issue 42 item 2, issue 40 item 7): the "load" and
"save" deadlines follow the bytes moved (launch/sbatch.py ``io_deadlines_s``), the resume's verification runs
inside "load", and a stop signal is said at once on rank 0, with torchrun's grace.

Contract encoded: torchrun forwards SIGTERM to its workers and SIGKILLs them ``--shutdown_timeout`` seconds later
(torch/distributed/launcher/api.py ``LaunchConfig.shutdown_timeout``, default 30; torch/distributed/elastic/
multiprocessing/api.py ``_terminate_process_handler``): the notice must come when the signal arrives, not at the end
of a step that may outlast that grace."""
import os
import signal
import time

import launch.sbatch as sbatch
from rlhf.supervised import trainer as supervised

BIG = 70_000_000_000  # a 70B policy: a checkpoint of 980 GB, far past the fixed --watchdog_slow_timeout_s


def test_dpo_deadlines_count_the_reference_at_start_up_not_in_the_checkpoint(monkeypatch):
    """DPO trains the policy (its checkpoint: the policy's bytes) and reads policy + reference at start-up."""
    import types

    calls = []
    monkeypatch.setattr(sbatch, "model_params", lambda p: ({"pol": BIG, "ref": BIG // 2}[p], "test"))
    monkeypatch.setattr(sbatch, "io_deadlines_s", lambda *a: calls.append(a) or {"load": 1.0, "save": 2.0})
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(ref_pretrain="ref"))
    supervised.io_deadlines(cfg.model.ref_pretrain, "pol", "dpo", 2, 900.0)
    supervised.io_deadlines(cfg.model.ref_pretrain, "pol", "sft", 2, 900.0)
    assert calls == [(BIG, BIG + BIG // 2, 2, 900.0), (BIG, BIG, 2, 900.0)], calls


def test_sft_deadlines_scale_resume_is_watched_and_sigterm_is_said_at_once(tiny_kit, tmp_path, monkeypatch, capsys):
    """SFT in process, its model taken for 70B: the watchdog's load/save deadlines are ``io_deadlines_s``'s (before:
    the fixed --watchdog_slow_timeout_s); ``resume_path`` (which hashes the checkpoint) runs inside "load"; a
    SIGTERM during step 1's forward is announced while that forward still runs, then step 1 is saved and the run
    stops preempted (before: no notice at all on SFT/RM/DPO)."""
    from rlhf import checkpoint as ckpt
    from rlhf.config import parse
    from rlhf.distributed import comm
    from rlhf.supervised.tasks import SFTTask

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "RLHF_STOP_FILE",
              "SLURM_NNODES", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(sbatch, "model_params", lambda p: (BIG, "test"))
    argv = ["--pretrain", tiny_kit, "--dataset", os.path.join(tiny_kit, "data", "sft_train.jsonl"),
            "--max_global_steps", "3", "--train_batch_size", "4", "--micro_train_batch_size", "4", "--max_samples",
            "12", "--save_path", str(tmp_path / "m"), "--ckpt_path", str(tmp_path / "ck"), "--log_dir",
            str(tmp_path / "logs"), "--no_progress_bar", "--load_checkpoint", "--watchdog_slow_timeout_s", "900"]
    tr = supervised.SupervisedTrainer(parse("sft", argv), SFTTask, "sft")
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)}
    try:
        want = sbatch.io_deadlines_s(BIG, BIG, 1, 900.0)
        assert min(want.values()) > 900.0, want  # 980 GB written + read back: 3920 s each
        for name in ("load", "save"):
            assert tr.watchdog.deadline_of(name) == want[name], (name, tr.watchdog.deadlines, want)

        seen = {}
        real_resume, real_compute = ckpt.resume_path, tr.task.compute

        def resume_path(*a, **kw):
            seen["resume"] = tr.watchdog.current()
            return real_resume(*a, **kw)

        def compute(model, batch):
            if "notice" not in seen:  # step 1: SIGTERM, then a forward that runs on until the watchdog spoke
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(100):
                    if tr.watchdog._announced:
                        break
                    time.sleep(0.1)
                seen["notice"] = tr.watchdog._announced
            return real_compute(model, batch)

        monkeypatch.setattr(ckpt, "resume_path", resume_path)
        tr.task.compute = compute
        tr.fit()
        err = capsys.readouterr().err
        assert seen["resume"] == ("load", want["load"]), f"resume verification outside 'load': {seen['resume']}"
        assert seen["notice"], f"no stop notice while the step ran (10 s):\n{err[-2000:]}"
        assert "[preempt] SIGTERM received during 'train'" in err, err[-2000:]
        assert "the checkpoint is written when this step ends" in err and "30s after it forwards" in err, err
        assert tr.cadence.preempted and tr.step == 1, (tr.step, tr.cadence.preempted)
        assert sorted(os.listdir(tmp_path / "ck")) == [".lock", "global_step_1"], os.listdir(tmp_path / "ck")
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        tr.watchdog.stop()
        comm.destroy()
