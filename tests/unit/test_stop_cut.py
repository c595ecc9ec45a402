"""A stop signal during a long step (issue 42 item 2): said at once, with the deadline torchrun enforces; the step is
cut after its long phases (generation, reward) and the last completed step saved, so a 30 s grace suffices."""
import os
import signal
import types

from rlhf.distributed.abort import AbortBoard
from rlhf.distributed.watchdog import Watchdog, stop_notice

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_stop_notice_names_the_phase_the_plan_and_torchruns_grace(monkeypatch):
    """torchrun forwards SIGTERM and SIGKILLs the ranks --shutdown_timeout seconds later (30 by default,
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT: torch/distributed/launcher/api.py LaunchConfig): the notice says it when the
    signal arrives, with the top-level phase (not a nested one) and whether that phase is cut."""
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.setenv("RANK", "0")
    wd = Watchdog(default_s=600, board_=AbortBoard(None), start=False)
    src = types.SimpleNamespace(signal_name=None)
    wd.announce_stops(src, ("rollout", "reward"))
    assert wd.announce() is None, "no signal yet: nothing to say"
    with wd.phase("reward"):
        with wd.phase("reward_function"):
            src.signal_name = "SIGTERM"
            text = wd.announce()
    assert text.startswith("[preempt] SIGTERM received during 'reward' (0s in): the step is cut when this phase "
                           "ends"), text
    assert "torchrun kills the ranks 30s after it forwards the signal" in text and "KillWait" in text, text
    assert wd.announce() is None, "said once"
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "900")  # the sbatch scripts export it
    later = stop_notice("SIGTERM", "actor_update", 12.0, ("rollout", "reward"))
    assert "during 'actor_update' (12s in): the checkpoint is written when this step ends" in later, later
    assert "kills the ranks 900s after" in later


def test_sigterm_in_a_long_reward_call_cuts_the_step_and_saves_the_last_one(monkeypatch, tmp_path, capsys):
    """GRPO on one rank, in process: the reward function of step 2 gets SIGTERM and goes on 2 s more (a long
    reward call).  The notice comes while the call still runs; after it every rank agrees (one all_reduce) to cut
    step 2: no update, checkpoint of step 1, exit as preempted (75) - before, the whole step ran first, and a
    phase longer than torchrun's 30 s grace saved nothing."""
    from rlhf.config.cli import parse
    from rlhf.rl.trainer import run_rl
    from rlhf.train_grpo import GRPO_DEFAULTS

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "RLHF_STOP_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RLHF_STOP_CALL", "2")
    monkeypatch.setenv("RLHF_STOP_AFTER_S", "2")
    cfg = parse("grpo", ["--max_global_steps", "4", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
                         "--train_batch_size", "8", "--micro_train_batch_size", "4", "--micro_rollout_batch_size",
                         "8", "--generate_max_len", "8", "--remote_rm_url", os.path.join(ROOT, "tests",
                                                                                         "helpers", "stop_reward.py"),
                         "--ckpt_path", str(tmp_path / "ck"), "--save_path", str(tmp_path / "m"), "--log_dir",
                         str(tmp_path / "logs"), "--no_progress_bar", "--watchdog_timeout_s", "120"], GRPO_DEFAULTS)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)}
    try:
        trainer = run_rl(cfg, "grpo")
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    out = capsys.readouterr()
    assert trainer.cadence.preempted and trainer.step == 1, (trainer.step, out.out[-2000:])
    assert sorted(os.listdir(tmp_path / "ck")) == ["global_step_1"], os.listdir(tmp_path / "ck")
    assert not (tmp_path / "m").exists() or not os.listdir(tmp_path / "m"), "no export for an incomplete run"
    err = out.err
    notice = err.find("[preempt] SIGTERM received during 'reward'")
    returned = err.find("[stop_reward] call 2 returned")
    assert 0 <= notice < returned, f"the notice must come while the reward call still runs:\n{err[-3000:]}"
    assert "step 2 cut after its reward phase; checkpoint of step 1 (the last completed)" in out.out, out.out[-2000:]
    assert out.out.count("[train ") == 1, "step 2 must not have trained"
