"""Data loading (files, dirs, parquet, mixtures, errors), the tiny kit round trip, metrics logging."""
import json
import os

import pytest

from rlhf.data.loading import DataError, load_rows, split_eval


def _jsonl(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def test_files_dirs_parquet_mixture_and_errors(tmp_path):
    import pandas as pd

    a = _jsonl(tmp_path / "a.jsonl", [{"input": f"a{i}", "output": "x"} for i in range(10)])
    d = tmp_path / "dir"
    d.mkdir()
    _jsonl(d / "p1.jsonl", [{"input": "d1", "output": "y"}])
    _jsonl(d / "p2.jsonl", [{"input": "d2", "output": "y"}])
    pq = tmp_path / "b.parquet"
    pd.DataFrame({"input": [f"b{i}" for i in range(10)], "output": ["z"] * 10}).to_parquet(pq)
    keys = {"input_key": "input", "output_key": "output"}
    assert len(load_rows(a, keys)) == 10
    assert sorted(r["input"] for r in load_rows(str(d), keys)) == ["d1", "d2"]
    assert len(load_rows(f"{a},{pq}", keys)) == 20
    assert len(load_rows(f"{a},{pq}", keys, max_samples=3)) == 6
    mixed = load_rows(f"{a},{pq}", keys, probs="0.5,0.5", seed=1)
    assert {r["input"][0] for r in mixed} == {"a", "b"}
    with pytest.raises(DataError, match=r"has no key 'prompt'.*set --input_key"):
        load_rows(a, {"input_key": "prompt"})
    empty = _jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="empty.jsonl is empty"):
        load_rows(empty, keys)
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"), keys)
    with pytest.raises(DataError, match="2 data sets"):
        load_rows(f"{a},{pq}", keys, probs="1")
    tr, ev = split_eval(list(range(100)), 0.1, 0)
    assert len(ev) == 10 and len(tr) == 90 and not set(tr) & set(ev)


def test_tiny_kit_round_trip_offline(tiny_kit, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_kit)
    lm = AutoModelForCausalLM.from_pretrained(tiny_kit)
    rm = AutoModelForSequenceClassification.from_pretrained(os.path.join(tiny_kit, "reward"))
    assert tok.pad_token and tok.eos_token and tok.pad_token_id != tok.eos_token_id
    assert tok.tokenize("12+7=19") == ["1", "2", "+", "7", "=", "1", "9"]
    text = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>1+2=\n<|assistant|>"
    ids = tok("3+4=7", return_tensors="pt")["input_ids"]
    assert lm(input_ids=ids).logits.shape[-1] == lm.config.vocab_size >= len(tok)
    assert rm(input_ids=ids).logits.shape == (1, 1)
    assert tok.decode(tok("3+4=7</s>")["input_ids"]) == "3+4=7</s>"
    for f in ("prompts_train.jsonl", "prompts_eval.jsonl", "sft_train.jsonl", "pref_train.jsonl"):
        row = json.loads(open(os.path.join(tiny_kit, "data", f)).readline())
        a, b = row["input"][:-1].split("+")
        assert int(row["label"]) == int(a) + int(b)
    again = AutoModelForCausalLM.from_pretrained(tiny_kit)
    assert all(torch.equal(p, q) for p, q in zip(lm.parameters(), again.parameters()))


def test_metrics_logger_jsonl_tensorboard_wandb_offline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    from rlhf.utils.logging import MetricsLogger, read_metrics

    lg = MetricsLogger(0, str(tmp_path), total_steps=2, use_wandb="True", use_tensorboard=True, progress_bar=True)
    lg.log(1, {"reward": 0.5, "kl": 0.01})
    lg.advance()
    lg.log(2, {"reward": 0.75}, prefix="eval")
    lg.close()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["split"], r["reward"]) for r in rows] == [(1, "train", 0.5), (2, "eval", 0.75)]
    assert "[train 1] reward=0.5 kl=0.01" in capsys.readouterr().out
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    assert os.path.isdir(tmp_path / "wandb")
    silent = MetricsLogger(1, str(tmp_path / "r1"), total_steps=1)
    silent.log(1, {"x": 1.0})
    assert not os.path.exists(tmp_path / "r1")  # only rank 0 writes


# ---- issue 18, metrics.jsonl after a resume, the tensorboard dir (from tests/test_silent_data.py)
def test_metrics_after_resume_have_no_duplicated_steps(tmp_path):
    from rlhf.utils.logging import MetricsLogger, read_metrics

    run1 = MetricsLogger(0, str(tmp_path), total_steps=6, progress_bar=False)
    run1.log(0, {"train_rows": 10.0}, prefix="data")
    for s in range(1, 6):                       # crashed after step 5; the checkpoint is of step 3
        run1.log(s, {"loss": float(s)})
    run1.log(2, {"loss": 0.5}, prefix="eval")
    run1.jsonl.write('{"step": 6, "spl')       # a line cut by the crash
    run1.close()
    run2 = MetricsLogger(0, str(tmp_path), total_steps=6, progress_bar=False)
    run2.log(0, {"train_rows": 10.0}, prefix="data")
    run2.resume_at(3)
    for s in range(4, 7):
        run2.log(s, {"loss": 10.0 + s})
    run2.close()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    keys = [(r["split"], r["step"]) for r in rows]
    assert len(keys) == len(set(keys)), f"duplicated steps: {keys}"
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows if r["split"] == "train"][3:] == [14.0, 15.0, 16.0]
    assert [r["split"] for r in rows].count("data") == 1 and [r["split"] for r in rows].count("eval") == 1


def test_tensorboard_dir(tmp_path):
    from rlhf.utils.logging import MetricsLogger, tensorboard_dir

    assert tensorboard_dir(None, "L") is None and tensorboard_dir("True", "L") == os.path.join("L", "tensorboard")
    assert tensorboard_dir(True, "L") == os.path.join("L", "tensorboard") and tensorboard_dir("/x/tb", "L") == "/x/tb"
    lg = MetricsLogger(0, str(tmp_path / "logs"), 1, use_tensorboard=str(tmp_path / "tb"), progress_bar=False)
    lg.log(1, {"x": 1.0})
    lg.close()
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))
