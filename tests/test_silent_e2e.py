"""Issue 18 end to end (2 ranks, tiny kit): DPO on rows longer than --max_len and chosen == rejected rows trains
on every row's responses (counted in the metrics), then a resume leaves metrics.jsonl without repeated steps."""
import json
import os

import pytest
from e2e import torchrun

from rlhf.utils.logging import read_metrics


def test_dpo_long_and_identical_rows_then_resume(tiny_kit, tmp_path):
    rows = [json.loads(line) for line in open(os.path.join(tiny_kit, "data", "pref_train.jsonl"))][:64]
    for r in rows[:16]:
        r["input"] = "9+9=18 " * 12 + r["input"]          # ~90 prompt tokens, --max_len 32
    for r in rows[16:24]:
        r["rejected"] = r["chosen"]                        # identical pair: log 2 loss, zero gradient
    data = tmp_path / "pref.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs = str(tmp_path / "logs")
    common = ["--pretrain", tiny_kit, "--dataset", data, "--eval_split", 0, "--max_len", 32, "--train_batch_size", 8,
              "--micro_train_batch_size", 2, "--learning_rate", 1e-3, "--save_path", tmp_path / "out",
              "--ckpt_path", tmp_path / "ck", "--save_steps", 2]
    train, _, out = torchrun("rlhf.train_dpo", 2, common + ["--max_global_steps", 3], tmp_path, logs)
    assert "of 64 rows, 16 longer than --max_len 32 had their prompt left-truncated" in out, out[-3000:]
    assert "8 dropped because chosen == rejected" in out
    data_rows = [r for r in read_metrics(os.path.join(logs, "metrics.jsonl")) if r["split"] == "data"]
    assert data_rows[0]["train_prompt_truncated"] == 16 and data_rows[0]["train_dropped_identical"] == 8
    assert data_rows[0]["train_kept"] == 56
    assert all(r["grad_norm"] > 0 for r in train), [r["grad_norm"] for r in train]
    assert [r["step"] for r in train] == [1, 2, 3]
    # resume from the step-2 checkpoint; step 3 is trained again and must not appear twice
    train2, _, out2 = torchrun("rlhf.train_dpo", 2, common + ["--max_global_steps", 4, "--load_checkpoint"],
                               tmp_path, logs)
    assert "[resume] from" in out2 and "at step 2" in out2
    rows = read_metrics(os.path.join(logs, "metrics.jsonl"))
    keys = [(r["split"], r["step"]) for r in rows]
    assert len(keys) == len(set(keys)), keys
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4]
    with pytest.raises(AssertionError, match="--no_start_fresh_if_no_checkpoint refuses"):
        torchrun("rlhf.train_dpo", 1, common + ["--ckpt_path", tmp_path / "ck_typo", "--load_checkpoint",
                                                "--no_start_fresh_if_no_checkpoint"], tmp_path, str(tmp_path / "logs3"))


def test_sft_resume_on_another_number_of_ranks(tiny_kit, tmp_path):
    """FSDP2 checkpoints reshard: saved by 2 ranks, resumed by 1 (said at start), training continues at step 3."""
    d = os.path.join(tiny_kit, "data")
    logs = str(tmp_path / "logs")
    common = ["--pretrain", tiny_kit, "--dataset", f"{d}/sft_train.jsonl", "--max_samples", 200, "--eval_split", 0,
              "--train_batch_size", 8, "--micro_train_batch_size", 2, "--save_path", tmp_path / "out",
              "--ckpt_path", tmp_path / "ck", "--save_steps", 2, "--learning_rate", 1e-3]
    first, _, _ = torchrun("rlhf.train_sft", 2, common + ["--max_global_steps", 2], tmp_path, logs)
    second, _, out = torchrun("rlhf.train_sft", 1, common + ["--max_global_steps", 4, "--load_checkpoint"],
                              tmp_path, logs)
    assert "was saved by 2 ranks, this run has 1" in out and "at step 2" in out, out[-2000:]
    assert [r["step"] for r in second] == [1, 2, 3, 4]
    assert second[2]["loss"] < first[0]["loss"], "the resumed run must continue from the trained weights"
