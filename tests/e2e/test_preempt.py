"""Stop requests end an incomplete run with a checkpoint and exit code 75 (EXIT_PREEMPTED), never 0."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_stop_file_checkpoints_and_exits_75(tiny_kit, tmp_path):
    from rlhf.config.cli import EXIT_PREEMPTED

    stop = tmp_path / "stop"
    stop.write_text("")
    d = os.path.join(tiny_kit, "data")
    cmd = [sys.executable, "-m", "rlhf.train_sft", "--pretrain", tiny_kit, "--dataset", f"{d}/sft_train.jsonl",
           "--max_global_steps", "5", "--train_batch_size", "8", "--micro_train_batch_size", "8", "--learning_rate",
           "1e-3", "--ckpt_path", str(tmp_path / "ck"), "--save_path", str(tmp_path / "m"), "--log_dir",
           str(tmp_path / "logs"), "--no_progress_bar"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(RLHF_STOP_FILE=str(stop), PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == EXIT_PREEMPTED == 75, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert "[preempt] stop file" in p.stdout and "NOT complete (1/5 steps)" in p.stdout, p.stdout[-2000:]
    assert os.path.isdir(tmp_path / "ck" / "global_step_1")
    assert not (tmp_path / "m" / "model.safetensors").exists()  # no final export for an incomplete run


def test_int_and_hup_are_stop_requests():
    import signal

    from rlhf.utils.preempt import StopSignal

    s = StopSignal(stop_file="")
    saved = {sig: signal.getsignal(sig) for sig in StopSignal.SIGNALS}
    try:
        s.install()
        for sig in (signal.SIGINT, signal.SIGHUP):
            s.signal_name = None
            os.kill(os.getpid(), sig)
            assert s.local() == 2 and s.signal_name == signal.Signals(sig).name
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)
