"""Issue 18, data / checkpoint / logging side: --max_len truncation and drops (counted), JSONL errors with line
numbers, the label-key fix, rng state across world sizes, metrics.jsonl after a resume."""
import os

import pytest

from rlhf.config import build_config
from rlhf.data.formatting import fit_pair, tokenize_pair
from rlhf.data.loading import DataError, load_rows
from rlhf.data.screen import screen_rows


@pytest.mark.parametrize("p,r,max_len,want_p,want_r,how", [
    (3, 2, 10, 3, 2, ""),            # fits
    (8, 3, 10, 7, 3, "prompt"),      # prompt loses its first tokens, response whole
    (20, 9, 10, 1, 9, "prompt"),     # response + one prompt token fill max_len exactly
    (5, 12, 10, 1, 9, "response"),   # the response alone is too long: cut at its end, never emptied
])
def test_fit_pair(p, r, max_len, want_p, want_r, how):
    P, R = list(range(100, 100 + p)), list(range(r))
    pp, rr, h = fit_pair(P, R, max_len)
    assert (len(pp), len(rr), h) == (want_p, want_r, how)
    assert pp == P[len(P) - want_p:], "the prompt must keep its last tokens (the ones next to the response)"
    assert rr == R[:want_r] and len(pp) + len(rr) <= max_len


def _rows_sft():
    return [{"input": "1+2=", "output": "3"},                       # fits
            {"input": "1+2=" * 20, "output": "3"},                  # long prompt: truncated, kept
            {"input": "1+2=", "output": "4" * 40},                  # long response: cut, kept
            {"input": "1+2=", "output": ""},                        # empty response: dropped
            {"input": "1+2=", "output": "   "}]                     # blank response: dropped


def test_sft_rows_longer_than_max_len_counted_and_never_empty(tiny_kit, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_kit)
    cfg = build_config({"max_len": 16}, "sft")
    kept, rep = screen_rows(_rows_sft(), tok, cfg.data, "sft")
    assert (rep.rows, rep.kept, rep.prompt_truncated, rep.response_truncated, rep.dropped_empty) == (5, 3, 1, 1, 2)
    out = capsys.readouterr().out
    assert "1 longer than --max_len 16 had their prompt left-truncated" in out and "raise --max_len" in out
    assert "2 dropped for an empty response" in out
    assert rep.metrics()["train_dropped_empty"] == 2.0 and rep.metrics()["train_prompt_truncated"] == 1.0
    for row in kept:
        ids, mask = tokenize_pair(tok, row["input"], row["output"], 16)
        assert len(ids) <= 16 and sum(mask[1:]) >= 1, f"row {row} would train on an empty response"
    # the old cut (prompt + response)[:max_len] left this one with no response at all
    ids, mask = tokenize_pair(tok, "1+2=" * 20, "3", 16)
    assert mask[-2:] == [1, 1] and tok.decode(ids[-2:]).startswith("3")


def test_preference_rows_identical_and_empty_dropped(tiny_kit, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_kit)
    rows = [{"input": "1+2=", "chosen": "3", "rejected": "4"},
            {"input": "1+2=", "chosen": "3", "rejected": "3"},
            {"input": "2+2=", "chosen": " 4", "rejected": "4 "},
            {"input": "1+2=", "chosen": "", "rejected": "4"},
            {"input": "1+2=" * 30, "chosen": "3", "rejected": "5"}]
    for kind in ("rm", "dpo"):
        kept, rep = screen_rows(rows, tok, build_config({"max_len": 16}, kind).data, kind)
        assert (rep.kept, rep.dropped_identical, rep.dropped_empty, rep.prompt_truncated) == (2, 2, 1, 1), kind
        assert [r["chosen"] for r in kept] == ["3", "3"]
        assert "2 dropped because chosen == rejected" in capsys.readouterr().out
    with pytest.raises(ValueError, match="all 1 rows were dropped"):
        screen_rows(rows[1:2], tok, build_config({}, "dpo").data, "dpo")


def test_dpo_and_rm_samples_keep_both_responses(tiny_kit):
    """The tasks' make_sample goes through tokenize_pair: a long prompt no longer erases either response."""
    from transformers import AutoTokenizer

    from rlhf.trainers.tasks import DPOTask, RMTask

    tok = AutoTokenizer.from_pretrained(tiny_kit)
    cfg = build_config({"max_len": 12}, "dpo")
    row = {"input": "9+9=" * 10, "chosen": "18", "rejected": "17"}
    (c_ids, c_mask), (r_ids, r_mask), _ = DPOTask(cfg, tok).make_sample(row)
    assert sum(c_mask[1:]) == 3 and sum(r_mask[1:]) == 3  # "1" "8" eos on each side
    c, r = RMTask(build_config({"max_len": 12}, "rm"), tok).make_sample(row)
    assert c[-1] == tok.eos_token_id and tok.decode(c[-3:-1]) .replace(" ", "") == "18" and len(c) == 12


def _msgs(text):
    return [{"role": "assistant", "content": text}]


def test_message_list_responses_are_chat_templated_like_openrlhf(tiny_kit, capsys):
    """OpenRLHF-style responses ``[{"role": "assistant", "content": ...}]`` train on the chat template's rendering
    of prompt + response minus the prompt's (openrlhf/datasets/sft_dataset.py, reward_dataset.py), not on the
    Python repr: with the tiny template that is the content itself, so samples equal the plain-text rows'; the
    data check sees the rendered text (an identical pair is dropped as such). Without --apply_chat_template the
    rows are refused with the flag to pass."""
    from transformers import AutoTokenizer

    from rlhf.data.formatting import format_response
    from rlhf.trainers.tasks import DPOTask, RMTask, SFTTask

    tok = AutoTokenizer.from_pretrained(tiny_kit)
    chat = {"max_len": 32, "apply_chat_template": True}
    plain = {"input": "1+2=", "output": "3", "chosen": "3", "rejected": "4"}
    msgs = {"input": [{"role": "user", "content": "1+2="}], "output": _msgs("3"), "chosen": _msgs("3"),
            "rejected": _msgs("4")}
    assert format_response(msgs["chosen"], msgs["input"], tok, True) == "3"
    for task in (SFTTask, RMTask, DPOTask):
        cfg = build_config(chat, task.name)
        got, want = task(cfg, tok).make_sample(msgs), task(cfg, tok).make_sample(plain)
        assert got == want, f"{task.name}: message-list sample {got} differs from the plain-text one {want}"
    rows = [msgs, dict(msgs, rejected=_msgs("3")), dict(msgs, chosen=_msgs("  "))]
    kept, rep = screen_rows(rows, tok, build_config(chat, "rm").data, "rm")
    assert (rep.kept, rep.dropped_identical, rep.dropped_empty) == (1, 1, 1), rep
    capsys.readouterr()
    for kind in ("sft", "rm", "dpo"):
        with pytest.raises(ValueError, match=r"row 0: .*is a chat message list .*pass --apply_chat_template"):
            screen_rows([msgs], tok, build_config({"max_len": 32}, kind).data, kind)
    with pytest.raises(ValueError, match="pass --apply_chat_template"):
        SFTTask(build_config({"max_len": 32}, "sft"), tok).make_sample(dict(plain, output=_msgs("3")))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"input": "a", "output": "b"}\n\n{"input": "c", "output": \n{"input": "e"}\n')
    with pytest.raises(DataError) as e:
        load_rows(str(f), {"input_key": "input"})
    assert f"{f}:3: line 3 is not valid JSON" in str(e.value)
    f.write_text('{"input": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: line 2 is a JSON list"):
        load_rows(str(f), {"input_key": "input"})


def test_missing_label_column_says_leave_label_key_out(tmp_path):
    """--label_key defaults to None, as OpenRLHF's (openrlhf/cli/train_ppo_ray.py ``--label_key`` default None): RL
    data without labels loads; a named key the data lacks is refused with that fix. The built-in arithmetic reward
    reads its own task's 'label' column when the flag is left out."""
    from rlhf.config import parse

    f = tmp_path / "p.jsonl"
    f.write_text('{"input": "1+2="}\n')
    with pytest.raises(DataError) as e:
        load_rows(str(f), {"input_key": "input", "label_key": "label"})
    assert "leave --label_key out" in str(e.value)
    assert load_rows(str(f), {"input_key": "input", "label_key": None}) == [{"input": "1+2="}]
    assert parse("grpo", ["--remote_rm_url", "my_reward.py"]).data.label_key is None, "OpenRLHF's default is None"
    assert parse("ppo", ["--reward_pretrain", "rm"]).data.label_key is None
    assert parse("grpo", ["--remote_rm_url", "r.py", "--label_key", ""]).data.label_key is None
    assert parse("grpo", ["--remote_rm_url", "builtin:arithmetic"]).data.label_key == "label"
    assert parse("grpo", []).data.label_key == "label", "the built-in task (no reward given) reads its labels"
    assert parse("grpo", ["--label_key", "answer"]).data.label_key == "answer"


# ------------------------------------------------------------------------------------------------ checkpoint / log
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


def test_rl_prompts_truncated_are_counted(tiny_kit, capsys):
    from transformers import AutoTokenizer

    from rlhf.data.formatting import build_prompts

    tok = AutoTokenizer.from_pretrained(tiny_kit)
    d = build_config({"prompt_max_len": 6}, "ppo").data
    items = build_prompts([{"input": "1+2=", "label": 3}, {"input": "12+34+56=", "label": 102}], tok, d)
    assert [len(i.ids) for i in items] == [4, 6] and items[1].label == "102"
    assert "1 of 2 prompts are longer than --prompt_max_len 6" in capsys.readouterr().out


def test_empty_prompts_dropped_and_an_all_empty_file_refused_at_load(tiny_kit, capsys):
    """A prompt with no tokens would break the rollout's shapes at step 1: dropped and counted, and a file of
    nothing else is refused when it is loaded, naming --input_key."""
    from rlhf.config import parse
    from rlhf.data.formatting import build_prompts
    from rlhf.models.load import load_tokenizer

    tok = load_tokenizer(tiny_kit)
    d = parse("grpo", ["--remote_rm_url", "builtin:arithmetic"]).data
    rows = [{d.input_key: "", d.label_key: "1"}, {d.input_key: "1+2=", d.label_key: "3"}]
    kept = build_prompts(rows, tok, d)
    assert [p.label for p in kept] == ["3"] and kept[0].ids
    assert "1 of 2 prompts are empty" in capsys.readouterr().out
    with pytest.raises(DataError, match="all 2 prompts are empty .*--input_key"):
        build_prompts([{d.input_key: ""}, {d.input_key: ""}], tok, d)
