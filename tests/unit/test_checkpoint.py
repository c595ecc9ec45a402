"""Checkpoint integrity (manifest, fallback, --strict_resume), one run per --ckpt_path (lock), the run's identity,
and the non-finite grad-norm guard.  Unit level: checkpoint.py on temp dirs, no process group."""
import os
import subprocess
import sys
import time
import warnings

import pytest

from rlhf import checkpoint as ckpt
from rlhf.checkpoint import save as ckpt_save
from rlhf.config import ConfigError, build_config
from rlhf.config.preflight import preflight
from rlhf.utils.cadence import NonFiniteGuard

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
    code = (f"import time; from rlhf import checkpoint as c; c.acquire_lock({str(root)!r}); "
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
    monkeypatch.setattr(ckpt_save.os, "getpid", lambda: 4242)
    ckpt.save_checkpoint(str(tmp_path), 3, lambda tmp: seen.append(os.path.basename(tmp)), {"step": 3})
    assert seen == [f".tmp-global_step_3-{ckpt_save.socket.gethostname()}-4242"], seen


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


# ---------------------------------------------------------------- issue 42 item 1: the final export

def _tiny_model(tiny_kit):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_kit), AutoTokenizer.from_pretrained(tiny_kit)


def _tree(folder):
    return {os.path.relpath(os.path.join(b, n), folder): open(os.path.join(b, n), "rb").read()
            for b, _, ns in os.walk(folder) for n in ns}


def test_export_keeps_openrlhf_layout_and_foreign_files(tiny_kit, tmp_path):
    """OpenRLHF's scripts put --ckpt_path and the logs under --save_path (--save_path ./ckpt --ckpt_path
    ./ckpt/checkpoints_ppo_ray) and write the model into that folder (openrlhf/utils/deepspeed/deepspeed.py
    ``save_model``: os.makedirs(exist_ok=True) + save_pretrained, nothing deleted). save_hf used to rmtree
    --save_path before its rename: every checkpoint, the metrics and any other file went. Now they stay byte for
    byte, a second export replaces the first one's files, and a file the export would overwrite that no export
    wrote is refused at start (preflight, naming --save_path and the file) and at the install (nothing touched)."""
    from transformers import AutoModelForCausalLM

    save = tmp_path / "ckpt"
    root = save / "checkpoints_ppo_ray"
    _save(root, 1)
    (save / "logs").mkdir()
    (save / "logs" / "metrics.jsonl").write_text('{"step": 1}\n')
    (save / "notes.txt").write_text("mine")
    before = _tree(save)
    model, tok = _tiny_model(tiny_kit)
    out = dict(save_path=str(save), ckpt_path=str(root), log_dir=str(save / "logs"), pretrain=tiny_kit)
    preflight(build_config(out, "sft"), "sft")  # OpenRLHF's layout: accepted
    ckpt.save_hf(model.state_dict(), model, tok, str(save))
    after = _tree(save)
    lost = [k for k, v in before.items() if after.get(k) != v]
    assert not lost, f"the export deleted or changed files it did not write: {lost}"
    assert ckpt.verify_checkpoint(str(root / "global_step_1")) is None
    assert AutoModelForCausalLM.from_pretrained(str(save)).config.hidden_size == model.config.hidden_size
    rec = ckpt.export_record(str(save))
    assert "model.safetensors" in rec and "config.json" in rec and "notes.txt" not in rec, rec
    assert not os.path.exists(str(save) + ".tmp")

    import torch  # the second export (a resumed run) replaces the first one's files, nothing else
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ckpt.save_hf(model.state_dict(), model, tok, str(save))
    again = _tree(save)
    assert again["model.safetensors"] != after["model.safetensors"]
    assert all(again.get(k) == v for k, v in before.items())
    preflight(build_config(out, "sft"), "sft")  # its own earlier export is no obstacle

    foreign = tmp_path / "theirs"  # someone else's model in --save_path: refused before training
    foreign.mkdir()
    (foreign / "config.json").write_text('{"theirs": 1}')
    (foreign / "model.safetensors").write_bytes(b"theirs")
    with pytest.raises(ConfigError, match=r"--save_path .*theirs holds config.json, model.safetensors, which the "
                                          r"final export would overwrite"):
        preflight(build_config({**out, "save_path": str(foreign)}, "sft"), "sft")
    with pytest.raises(ckpt.ExportError, match=r"holds config.json, model.safetensors, which no export .* the "
                                               r"export is complete in"):
        ckpt.save_hf(model.state_dict(), model, tok, str(foreign))
    assert (foreign / "config.json").read_text() == '{"theirs": 1}'
    assert (foreign / "model.safetensors").read_bytes() == b"theirs"


def test_export_temporary_folder_of_someone_else_is_not_deleted(tmp_path):
    """``<save_path>.tmp`` is where the export is written first; one this project did not mark is refused, not
    deleted; a marked one (an export cut short) is replaced."""
    (tmp_path / "m.tmp").mkdir()
    (tmp_path / "m.tmp" / "x").write_text("keep")
    with pytest.raises(ckpt.ExportError, match="not written by an export of this project"):
        ckpt.begin_export(str(tmp_path / "m"))
    assert (tmp_path / "m.tmp" / "x").read_text() == "keep"
    (tmp_path / "m.tmp" / "x").unlink()
    (tmp_path / "m.tmp").rmdir()
    tmp = ckpt.begin_export(str(tmp_path / "m"))  # cut short: marked, left behind
    (tmp_path / "m.tmp" / "half.safetensors").write_bytes(b"half")
    assert ckpt.begin_export(str(tmp_path / "m")) == tmp and os.listdir(tmp) == [ckpt.EXPORT_RECORD]


# ---------------------------------------------------------------- issue 42 item 3: a full disk after a requeue

def test_dead_runs_cut_short_save_is_cleared_before_the_first_save(tmp_path):
    """Run 1 fills the disk while saving (ENOSPC inside write) and dies, leaving .tmp-global_step_N-<host>-<pid>;
    the requeued run 2 takes the lock, which proves run 1 dead, and clears it at once -- before its first save
    needs the space (it used to be cleared only after a successful save, so the requeued save hit the full disk
    again)."""
    import errno

    root = tmp_path / "ck"

    def write(tmp):
        with open(os.path.join(tmp, "shard.bin"), "wb") as fh:
            fh.write(os.urandom(1 << 20))
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        ckpt.save_checkpoint(str(root), 7, write, {"step": 7})
    left = [e for e in os.listdir(root) if e.startswith(".tmp-global_step_7-")]
    assert left, os.listdir(root)
    # what run 1 leaves in the lock file when it dies (its flock went with it)
    (root / ckpt.LOCK_FILE).write_text(f"host={ckpt_save.socket.gethostname()} pid=999999999 job=41")
    try:
        notices = ckpt.acquire_lock(str(root))
        assert not [e for e in os.listdir(root) if e.startswith(".tmp-")], "the dead run's save is still there"
        assert any("removed 1 save(s) cut short" in n and left[0] in n and "1.0 MiB" in n for n in notices), notices
        assert "stale lock" in notices[0] and "job=41" in notices[0], notices
    finally:
        ckpt.release_lock(str(root))


# ---------------------------------------------------------------- issue 42 item 5: the data stream's flags

def _rl_cfg(tmp_path, tiny_kit, **kw):
    d = os.path.join(tiny_kit, "data")
    return build_config(dict(save_path=str(tmp_path / "out"), ckpt_path=str(tmp_path / "ck"),
                             log_dir=str(tmp_path / "logs"), pretrain=tiny_kit, prompt_data=f"{d}/prompts_train.jsonl",
                             reward_pretrain=os.path.join(tiny_kit, "reward"), train_batch_size=4, **kw), "ppo")


@pytest.mark.parametrize("flag,value", [("rollout_batch_size", 4), ("n_samples_per_prompt", 2), ("seed", 7)])
def test_resume_with_another_data_stream_flag_refused_naming_it(tmp_path, tiny_kit, flag, value):
    """RL step N trains prompts N x --rollout_batch_size .. of a --seed shuffle (rl_trainer.prompts_for): another
    value on resume re-trains some prompts and skips others, silently (the identity left these out). Refused in
    preflight, before any model loads, naming the flag and both values."""
    _save(tmp_path / "ck", 2, _rl_cfg(tmp_path, tiny_kit, rollout_batch_size=8))
    saved = {"rollout_batch_size": 8, "n_samples_per_prompt": 1, "seed": 42}[flag]
    with pytest.raises(ConfigError, match=rf"saved with --{flag} {saved}, this run has --{flag} {value}") as e:
        preflight(_rl_cfg(tmp_path, tiny_kit, load_checkpoint=True, **{"rollout_batch_size": 8, flag: value}), "ppo")
    assert "global_step_2" in str(e.value) and f"Resume with --{flag} {saved}" in str(e.value)
    preflight(_rl_cfg(tmp_path, tiny_kit, load_checkpoint=True, rollout_batch_size=8), "ppo")  # same: resumes


def test_sft_resume_with_another_train_batch_size_refused(tmp_path, tiny_kit):
    """The supervised trainers' step N is samples N x --train_batch_size of a --seed shuffle (supervised.batches_for)."""
    _save(tmp_path / "ck", 1, _ident_cfg(tmp_path, tiny_kit))
    with pytest.raises(ConfigError, match=r"saved with --train_batch_size 8, this run has --train_batch_size 64"):
        preflight(_ident_cfg(tmp_path, tiny_kit, train_batch_size=64, load_checkpoint=True), "sft")


# ---------------------------------------------------------------- issue 41 item 7: --load_checkpoint on a first run

def test_load_checkpoint_first_run_starts_fresh_damaged_refused(tmp_path, tiny_kit):
    """OpenRLHF starts from step 0 when --ckpt_path holds no checkpoint (openrlhf/trainer/ppo_trainer.py
    ``init_checkpoint_states``: ``if args.load_checkpoint and os.path.exists(ckpt_path)`` else global_step 0): one
    notice line. A folder whose checkpoint is damaged is still refused naming the file -- including a
    global_step_N whose trainer_state.json is gone (it used to be invisible, so that run would start fresh)."""
    notes = preflight(_ident_cfg(tmp_path, tiny_kit, load_checkpoint=True), "sft")
    hit = [n for n in notes if "starting from step 0" in n]
    assert len(hit) == 1 and "--ckpt_path" in hit[0] and "does not exist" in hit[0], notes
    p = _save(tmp_path / "ck2", 2)
    os.remove(os.path.join(p, ckpt.STATE_FILE))
    with pytest.raises(ConfigError, match=rf"{p} is damaged \({ckpt.STATE_FILE} is missing\)"):
        preflight(build_config(dict(save_path=str(tmp_path / "out"), ckpt_path=str(tmp_path / "ck2"),
                                    log_dir=str(tmp_path / "logs"), pretrain=tiny_kit, load_checkpoint=True), "sft"),
                  "sft")


# ---------------------------------------------------------------- issue 40 item 14: CUDA rng state

def test_cuda_rng_state_saved_and_restored(tmp_path, monkeypatch):
    """With CUDA, every device's generator state goes into rank_N.pt (torch.cuda.random.get_rng_state_all, as
    transformers' trainer.py ``_save_rng_state``) and comes back per device on resume (only the devices this node
    has). CPU stand-in for torch.cuda."""
    import torch

    states = [torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([4, 5, 6], dtype=torch.uint8)]
    restored = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.__setitem__(i, s.clone()))
    p = _save(tmp_path / "ck", 3)
    saved = torch.load(os.path.join(p, "rank_0.pt"), weights_only=False)["rng"]
    assert [s.tolist() for s in saved["cuda"]] == [[1, 2, 3], [4, 5, 6]], saved.keys()
    ckpt.load_rank_state(p)
    assert list(restored) == [0] and restored[0].tolist() == [1, 2, 3], restored


def test_critic_export_keeps_other_files(tiny_kit, tmp_path):
    """``<save_path>_critic`` (--save_value_network) goes through the same install: a folder with other files keeps
    them, and the critic folder reads back (backbone + value_head.pt)."""
    from rlhf.models.critic import CriticModel

    critic = CriticModel.from_pretrained(tiny_kit)
    dst = tmp_path / "m_critic"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    critic.save_hf(critic.state_dict(), None, str(dst))
    assert (dst / "notes.txt").read_text() == "mine", "the critic export deleted a file it did not write"
    assert "value_head.pt" in ckpt.export_record(str(dst))
    again = CriticModel.from_pretrained(str(dst))
    assert again.value_head.weight.tolist() == critic.value_head.weight.tolist()


# ---- issue 18, rng state across world sizes (from tests/test_silent_data.py)
def test_rank_state_missing_rank_file_derived_and_said(tmp_path, capsys, monkeypatch):
    import random

    import torch

    from rlhf import checkpoint as ckpt
    from rlhf.checkpoint import resume

    d = ckpt.save_checkpoint(str(tmp_path), 5, lambda tmp: None, {"step": 5})
    assert ckpt.load_trainer_state(d)["world_size"] == 1 and ckpt.saved_world_size(d) == 1
    monkeypatch.setattr(resume, "_rank", lambda: 3)  # a rank the 1-rank run never saved
    s1 = ckpt.load_rank_state(d)
    a = (torch.rand(2).tolist(), random.random())
    s2 = ckpt.load_rank_state(d)
    b = (torch.rand(2).tolist(), random.random())
    assert s1["derived_seed"] == s2["derived_seed"] == ckpt.derived_seed(d, 3) and a == b, "must be deterministic"
    assert ckpt.derived_seed(d, 2) != ckpt.derived_seed(d, 3)
    assert "has no rank_3.pt (saved by 1 ranks)" in capsys.readouterr().out
