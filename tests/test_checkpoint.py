"""Checkpoint integrity (manifest, fallback, --strict_resume), one run per --ckpt_path (lock), the run's identity,
and the non-finite grad-norm guard.  Unit level: checkpoint.py on temp dirs, no process group."""
import os
import subprocess
import sys
import time
import warnings

import pytest

from rlhf.config import ConfigError, build_config
from rlhf.config.preflight import preflight
from rlhf.trainers.cadence import NonFiniteGuard
from rlhf.utils import checkpoint as ckpt

SHARD = "model/shard_0.bin"


def _save(root, step, cfg=None, size=64 << 10):
    """One checkpoint of step ``step`` with a fake 64 KiB model shard (1-rank, no process group)."""
    def write(tmp):
        os.makedirs(os.path.join(tmp, "model"), exist_ok=True)
        with open(os.path.join(tmp, SHARD), "wb") as fh:
            fh.write(os.urandom(size))

    ident = ckpt.run_identity(cfg) if cfg is not None else None
    return ckpt.save_checkpoint(str(root), step, write, {"step": step}, max_keep=5, identity=ident)


def _two(tmp_path):
    root = tmp_path / "ck"
    return root, _save(root, 1), _save(root, 2)


def test_manifest_lists_every_file_with_size_and_hash(tmp_path):
    root, _, p2 = _two(tmp_path)
    man = ckpt.read_manifest(p2)
    assert set(man["files"]) == {SHARD, "rank_0.pt", ckpt.STATE_FILE}, man["files"].keys()
    assert man["files"][SHARD]["size"] == 64 << 10
    assert ckpt.verify_checkpoint(p2) is None
    assert not [e for e in os.listdir(root) if e.startswith(".tmp-")], "temporary directory left behind"


def test_corrupt_4k_inside_shard_falls_back_to_previous(tmp_path):
    root, p1, p2 = _two(tmp_path)
    with open(os.path.join(p2, SHARD), "r+b") as fh:  # 4 KiB overwritten, size unchanged
        fh.seek(16 << 10)
        fh.write(b"\xff" * 4096)
    path, notices = ckpt.pick_checkpoint(str(root))
    assert path == p1, f"resumed from {path}, expected the intact {p1}"
    text = "\n".join(notices)
    assert p2 in text and "checksum" in text and f"falling back to {p1}" in text, text
    with pytest.raises(ckpt.CheckpointError, match="strict_resume") as e:
        ckpt.pick_checkpoint(str(root), strict=True)
    assert p2 in str(e.value)


@pytest.mark.parametrize("damage", ["truncate", "empty", "delete"])
def test_truncated_or_missing_file_falls_back_naming_checkpoint(tmp_path, damage):
    root, p1, p2 = _two(tmp_path)
    f = os.path.join(p2, SHARD)
    if damage == "delete":
        os.remove(f)
    else:
        with open(f, "r+b") as fh:
            fh.truncate(0 if damage == "empty" else 1000)
    path, notices = ckpt.pick_checkpoint(str(root), hashes=False)  # sizes alone catch these
    assert path == p1, path
    assert p2 in notices[0] and SHARD in notices[0], notices


def test_preflight_strict_resume_refuses_damaged_newest(tmp_path, tiny_kit):
    out = dict(save_path=str(tmp_path / "out"), ckpt_path=str(tmp_path / "ck"), log_dir=str(tmp_path / "logs"),
               pretrain=tiny_kit, load_checkpoint=True)
    cfg = build_config(out, "sft")
    _save(tmp_path / "ck", 1, cfg)
    p2 = _save(tmp_path / "ck", 2, cfg)
    os.remove(os.path.join(p2, SHARD))
    notices = preflight(cfg, "sft")
    assert any(p2 in n and "skipping" in n for n in notices), notices
    with pytest.raises(ConfigError, match="strict_resume") as e:
        preflight(build_config({**out, "strict_resume": True}, "sft"), "sft")
    assert p2 in str(e.value)


def test_resume_path_fallback_one_rank(tmp_path, capsys):
    root, p1, p2 = _two(tmp_path)
    with open(os.path.join(p2, "rank_0.pt"), "r+b") as fh:
        fh.write(b"\0" * 16)
    assert ckpt.resume_path(str(root)) == p1
    assert f"falling back to {p1}" in capsys.readouterr().out
    with pytest.raises(ckpt.CheckpointError, match="--strict_resume refuses"):
        ckpt.resume_path(str(root), strict=True)


def _holder(root):
    """A separate process that takes the lock and sleeps; returns it once the lock is held."""
    code = (f"import time; from rlhf.utils import checkpoint as c; c.acquire_lock({str(root)!r}); "
            f"print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_run_on_one_folder_is_refused_naming_holder(tmp_path):
    root = tmp_path / "ck"
    p = _holder(root)
    try:
        with pytest.raises(ckpt.CheckpointError, match=f"pid={p.pid}") as e:
            ckpt.acquire_lock(str(root))
        assert "host=" in str(e.value) and "--ckpt_path" in str(e.value)
    finally:
        p.kill()
        p.wait()


def test_stale_lock_of_dead_process_is_taken_over(tmp_path):
    root = tmp_path / "ck"
    p = _holder(root)
    p.kill()
    p.wait()
    time.sleep(0.1)
    try:
        notices = ckpt.acquire_lock(str(root))
        assert notices and "stale lock" in notices[0] and f"pid={p.pid}" in notices[0], notices
        assert f"pid={os.getpid()}" in open(root / ckpt.LOCK_FILE).read()
    finally:
        ckpt.release_lock(str(root))


def test_temporary_names_are_unique_per_run(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(ckpt.os, "getpid", lambda: 4242)
    ckpt.save_checkpoint(str(tmp_path), 3, lambda tmp: seen.append(os.path.basename(tmp)), {"step": 3})
    assert seen == [f".tmp-global_step_3-{ckpt.socket.gethostname()}-4242"], seen


def _ident_cfg(tmp_path, tiny_kit, **kw):
    return build_config(dict(save_path=str(tmp_path / "out"), ckpt_path=str(tmp_path / "ck"),
                             log_dir=str(tmp_path / "logs"), pretrain=tiny_kit, **kw), "sft")


def test_identity_shape_flag_refused_naming_flag(tmp_path, tiny_kit):
    saved = ckpt.run_identity(_ident_cfg(tmp_path, tiny_kit))
    with pytest.raises(ckpt.CheckpointError, match="--lora_rank 0") as e:
        ckpt.compare_identity("ck/global_step_2", saved, ckpt.run_identity(_ident_cfg(tmp_path, tiny_kit,
                                                                                      lora_rank=8)))
    assert "ck/global_step_2" in str(e.value) and "shapes" in str(e.value)


def test_identity_different_pretrain_same_shape_refused(tmp_path, tiny_kit):
    import shutil

    other = str(tmp_path / "copy")
    shutil.copytree(tiny_kit, other)
    saved = ckpt.run_identity(_ident_cfg(tmp_path, tiny_kit))
    now = ckpt.run_identity(_ident_cfg(tmp_path, other))
    assert saved["pretrain_shape"] == now["pretrain_shape"]
    with pytest.raises(ckpt.CheckpointError, match="--pretrain"):
        ckpt.compare_identity("p", saved, now)


def test_identity_checked_in_preflight_before_models_load(tmp_path, tiny_kit):
    _save(tmp_path / "ck", 1, _ident_cfg(tmp_path, tiny_kit))
    with pytest.raises(ConfigError, match="lora_rank"):
        preflight(_ident_cfg(tmp_path, tiny_kit, lora_rank=4, load_checkpoint=True), "sft")
    notices = preflight(_ident_cfg(tmp_path, tiny_kit, learning_rate=1e-3, load_checkpoint=True), "sft")
    assert any("--learning_rate 5e-06 -> 0.001" in n for n in notices), notices


def test_nonfinite_grad_norm_counted_and_run_stopped():
    g = NonFiniteGuard(3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g.check(1, {"grad_norm": float("nan"), "loss": 1.0})
        g.check(2, {"grad_norm": 1.0})  # a finite step resets the streak
        g.check(3, {"actor/grad_norm": float("inf")})
        g.check(4, {"grad_norm": float("nan")})
    assert g.streak == 2 and len(w) == 3, (g.streak, [str(x.message) for x in w])
    with pytest.raises(RuntimeError, match="--max_nonfinite_steps 3"):
        g.check(5, {"grad_norm": float("nan")})
    NonFiniteGuard(0).check(1, {"grad_norm": float("nan")})  # 0 = never stop: a warning only


def test_cut_short_saves_removed_only_under_lock(tmp_path):
    root = tmp_path / "ck"
    (root / ".tmp-global_step_4-otherhost-1").mkdir(parents=True)
    _save(root, 5)
    assert (root / ".tmp-global_step_4-otherhost-1").exists(), "removed another run's save without the lock"
    ckpt.acquire_lock(str(root))
    try:
        _save(root, 6)
        assert not (root / ".tmp-global_step_4-otherhost-1").exists(), "a save cut short was left behind"
    finally:
        ckpt.release_lock(str(root))


def test_cli_sft_resume_falls_back_from_corrupted_shard(tiny_kit, tmp_path):
    """The one real run (1 rank, plain python): save steps 1 and 2, overwrite 4 KiB inside a model shard of step 2
    (size unchanged), resume: the log names the damaged checkpoint and the fallback, training redoes step 2 with a
    finite loss."""
    import math

    from e2e import torchrun

    d = os.path.join(tiny_kit, "data")
    common = ["--pretrain", tiny_kit, "--dataset", f"{d}/sft_train.jsonl", "--max_samples", 64, "--eval_split", 0,
              "--train_batch_size", 4, "--micro_train_batch_size", 2, "--save_path", tmp_path / "out",
              "--ckpt_path", tmp_path / "ck", "--save_steps", 1, "--learning_rate", 1e-3]
    torchrun("rlhf.train_sft", 0, common + ["--max_global_steps", 2], tmp_path, str(tmp_path / "logs"))
    p1, p2 = str(tmp_path / "ck" / "global_step_1"), str(tmp_path / "ck" / "global_step_2")
    shards = sorted(f for f in ckpt.read_manifest(p2)["files"] if f.startswith("model/") and "distcp" in f)
    assert shards, ckpt.read_manifest(p2)["files"].keys()
    f = os.path.join(p2, shards[0])
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) // 2)
        fh.write(b"\x7f" * 4096)
    train, _, out = torchrun("rlhf.train_sft", 0, common + ["--max_global_steps", 3, "--load_checkpoint"], tmp_path,
                             str(tmp_path / "logs2"))
    assert f"{p2} is damaged" in out and f"falling back to {p1}" in out and "at step 1" in out, out[-3000:]
    assert [r["step"] for r in train] == [2, 3], train
    assert all(math.isfinite(r["loss"]) for r in train), train


def test_missing_manifest_of_a_new_checkpoint_is_damage(tmp_path):
    root, p1, p2 = _two(tmp_path)
    os.remove(os.path.join(p2, ckpt.MANIFEST))
    assert ckpt.verify_checkpoint(p2) == f"{ckpt.MANIFEST} is missing"
    assert ckpt.pick_checkpoint(str(root))[0] == p1
    with open(os.path.join(p1, ckpt.STATE_FILE), "w") as fh:  # a save from before manifests: accepted
        fh.write('{"step": 1, "world_size": 1}')
    os.remove(os.path.join(p1, ckpt.MANIFEST))
    assert ckpt.verify_checkpoint(p1) is None


def test_every_checkpoint_damaged_is_refused_not_started_fresh(tmp_path):
    root, p1, p2 = _two(tmp_path)
    for p in (p1, p2):
        os.remove(os.path.join(p, SHARD))
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint") as e:
        ckpt.pick_checkpoint(str(root))
    assert p1 in str(e.value) and p2 in str(e.value)
