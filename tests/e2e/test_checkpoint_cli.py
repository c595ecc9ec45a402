"""Checkpoint fallback through the CLI: an SFT run resumed after its newest shard was corrupted falls back to the
previous checkpoint (one process, python -m rlhf.train_sft)."""
import os

from rlhf import checkpoint as ckpt


def test_cli_sft_resume_falls_back_from_corrupted_shard(tiny_kit, tmp_path):
    """The one real run (1 rank, plain python), in OpenRLHF's layout (--save_path ./ckpt, --ckpt_path
    ./ckpt/checkpoints_sft, logs under ./ckpt too, as OpenRLHF's examples/scripts): save steps 1 and 2 and export
    the model into ./ckpt -- the export must leave the checkpoints, the logs and a foreign file there (issue 42
    item 1: it deleted them) -- then overwrite 4 KiB inside a model shard of step 2 (size unchanged), resume: the
    log names the damaged checkpoint and the fallback, training redoes step 2 with a finite loss, and the second
    export replaces the first."""
    import math

    from helpers.e2e import torchrun

    d = os.path.join(tiny_kit, "data")
    save, ck, logs = tmp_path / "ckpt", tmp_path / "ckpt" / "checkpoints_sft", tmp_path / "ckpt" / "logs"
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    common = ["--pretrain", tiny_kit, "--dataset", f"{d}/sft_train.jsonl", "--max_samples", 64, "--eval_split", 0,
              "--train_batch_size", 4, "--micro_train_batch_size", 2, "--save_path", save,
              "--ckpt_path", ck, "--save_steps", 1, "--learning_rate", 1e-3]
    torchrun("rlhf.train_sft", 0, common + ["--max_global_steps", 2], tmp_path, str(logs))
    p1, p2 = str(ck / "global_step_1"), str(ck / "global_step_2")
    assert os.path.isdir(p1) and os.path.isdir(p2), f"the final export deleted the checkpoints in {save}"
    assert os.path.isfile(logs / "metrics.jsonl") and (save / "notes.txt").read_text() == "mine"
    assert os.path.isfile(save / "model.safetensors") and "model.safetensors" in ckpt.export_record(str(save))
    shards = sorted(f for f in ckpt.read_manifest(p2)["files"] if f.startswith("model/") and "distcp" in f)
    assert shards, ckpt.read_manifest(p2)["files"].keys()
    f = os.path.join(p2, shards[0])
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) // 2)
        fh.write(b"\x7f" * 4096)
    first = open(save / "model.safetensors", "rb").read()
    train, _, out = torchrun("rlhf.train_sft", 0, common + ["--max_global_steps", 3, "--load_checkpoint"], tmp_path,
                             str(tmp_path / "logs2"))
    assert f"{p2} is damaged" in out and f"falling back to {p1}" in out and "at step 1" in out, out[-3000:]
    assert [r["step"] for r in train] == [2, 3], train
    assert all(math.isfinite(r["loss"]) for r in train), train
    assert open(save / "model.safetensors", "rb").read() != first, "the second export did not replace the first"
    assert os.path.isdir(ck / "global_step_3") and (save / "notes.txt").read_text() == "mine"
