"""Data sets as OpenRLHF reads them (issue 40 item 4, issue 41 items 3, 5, 8, issue 42 item 12).

Contracts encoded here, from OpenRLHF's source:
* openrlhf/datasets/utils.py ``blending_datasets``: ``name@data_dir`` (``load_dataset(name, data_dir=...)``) for hub
  names and local folders, ``load_from_disk`` folders, ``.arrow`` files, the split from ``--prompt_split`` /
  ``--dataset_split`` / ``--eval_split`` (``data[dataset_split]``).
* openrlhf/cli/train_sft.py ``--input_template`` default ``"User: {}\\nAssistant: "`` (0.10.1 flat, 0.11 dotted),
  applied by openrlhf/datasets/sft_dataset.py ``preprocess_data`` when no chat template is.
* openrlhf/cli/train_*.py: no eval data set means no eval (every row trains).
* openrlhf/datasets/reward_dataset.py ``preprocess_data`` with ``prompt_key=None``: chosen / rejected as whole
  conversations.
"""
import json
import os
import sys

import pytest
from helpers.tasks import make_task

from rlhf.config import build_config
from rlhf.data.formatting import fit_pair, tokenize_pair
from rlhf.data.loading import DataError, interleave, load_rows, load_train_eval, parse_source
from rlhf.data.screen import screen_rows


def _jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def _gsm8k_like(root):
    """A local copy of openai/gsm8k's layout: two configs (main, socratic) in folders of their names, declared in
    the README's YAML with train/test files, and no default config."""
    for cfg in ("main", "socratic"):
        for split, n in (("train", 3), ("test", 2)):
            _jsonl(os.path.join(root, cfg, f"{split}-00000-of-00001.jsonl"),
                   [{"question": f"{cfg} {split} q{i}", "answer": f"#### {i}"} for i in range(n)])
    files = "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
                    f"  - split: test\n    path: {c}/test-*\n" for c in ("main", "socratic"))
    with open(os.path.join(root, "README.md"), "w") as fh:
        fh.write(f"---\nconfigs:\n{files}---\n")
    return str(root)


def test_at_names_the_data_dir_of_a_local_folder(tmp_path):
    """The issue's test: a folder with two data dirs of different keys; ``folder@b`` reads b, ``folder@a`` reads a
    (OpenRLHF: ``load_dataset(folder, data_dir=...)``). Before, ``@`` named a split and neither loaded."""
    root = tmp_path / "two"
    _jsonl(root / "a" / "rows.jsonl", [{"q": "1+1=", "a": "2"}])
    _jsonl(root / "b" / "rows.jsonl", [{"input": "2+2=", "label": "4"}, {"input": "3+3=", "label": "6"}])
    assert load_rows(f"{root}@b", {"input_key": "input", "label_key": "label"}) == \
        [{"input": "2+2=", "label": "4"}, {"input": "3+3=", "label": "6"}], "folder@b must read the data dir b"
    assert load_rows(f"{root}@a", {"input_key": "q"}) == [{"q": "1+1=", "a": "2"}], "folder@a must read a"
    with pytest.raises(DataError, match=r"no folder 'c' \(its folders: a, b\)"):
        load_rows(f"{root}@c", {"input_key": "input"})


def test_old_split_spelling_is_refused_with_the_flag_to_use(tmp_path):
    """``name@train`` meant a split here before; now ``@`` is a data_dir, so the old spelling is refused, naming the
    split flag of the data it was given for, and the escape for a folder really named like a split."""
    with pytest.raises(DataError) as e:
        load_rows("openai/gsm8k@test", {"input_key": "question"}, split_flag="--prompt_split")
    assert "--prompt_split test" in str(e.value) and "openai/gsm8k@test/" in str(e.value)
    with pytest.raises(DataError, match="--eval_split train"):
        parse_source("some/set@train[:100]", "--eval_split")
    folder = tmp_path / "f"
    _jsonl(folder / "train" / "x.jsonl", [{"input": "a"}])
    assert load_rows(f"{folder}@train", {"input_key": "input"}) == [{"input": "a"}], "an existing folder wins"
    assert parse_source("org/set@test/").data_dir == "test"
    assert parse_source("org/set:main@sub") == parse_source("org/set:main@sub/")
    assert (parse_source("org/set:main").path, parse_source("org/set:main").config) == ("org/set", "main")


def test_configs_splits_and_the_gsm8k_layout(tmp_path):
    """openai/gsm8k's layout, locally: without a config the error lists them and says how to pass one; ``@main``
    (OpenRLHF's spelling, the GRPO recipes') and ``:socratic`` load, with the split flag choosing train or test."""
    root = _gsm8k_like(tmp_path / "gsm8k")
    keys = {"input_key": "question", "label_key": "answer"}
    with pytest.raises(DataError) as e:
        load_rows(root, keys)
    assert "several configs and no default (main, socratic)" in str(e.value) and f"{root}:main" in str(e.value)
    assert [r["question"] for r in load_rows(f"{root}@main", keys)] == [f"main train q{i}" for i in range(3)]
    assert [r["question"] for r in load_rows(f"{root}@main", keys, split="test")] == ["main test q0", "main test q1"]
    assert [r["question"] for r in load_rows(f"{root}:socratic", keys, split="test")][0] == "socratic test q0"
    with pytest.raises(DataError, match=r"no config 'nope'; its configs are main, socratic"):
        load_rows(f"{root}:nope", keys)
    with pytest.raises(DataError, match=r"has the splits train, test; --prompt_split dev names none"):
        load_rows(f"{root}@main", keys, split="dev", split_flag="--prompt_split")


@pytest.mark.parametrize("recipe", ["configs/grpo_qwen2.5_7b_math.yaml", "configs/grpo_qwen2.5_7b_async.yaml"])
def test_grpo_recipes_load_gsm8k(recipe, tmp_path):
    """The recipes' own data flags load the gsm8k layout (the hub name swapped for a local copy of it): train rows
    from the train split of main/, eval rows from its test split. Before, ``openai/gsm8k`` without a config died on
    every rank at data loading."""
    from rlhf.config import parse

    d = parse("grpo", ["--config", recipe]).data
    assert d.prompt_data.startswith("openai/gsm8k@") and d.eval_dataset.startswith("openai/gsm8k@")
    local = _gsm8k_like(tmp_path / "gsm8k")
    d.prompt_data = d.prompt_data.replace("openai/gsm8k", local)
    d.eval_dataset = d.eval_dataset.replace("openai/gsm8k", local)
    train, ev = load_train_eval(d, {"input_key": d.input_key, "label_key": d.label_key}, d.prompt_data, None, None,
                                "", 0)
    assert [r["question"] for r in train] == [f"main train q{i}" for i in range(3)]
    assert [r["question"] for r in ev] == ["main test q0", "main test q1"]


def test_saved_folders_arrow_files_and_single_file_splits(tmp_path):
    """``save_to_disk`` folders (a Dataset, a DatasetDict by split) and ``.arrow`` files, as blending_datasets."""
    datasets = pytest.importorskip("datasets")

    rows = [{"input": f"x{i}", "label": str(i)} for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                          "test": datasets.Dataset.from_list(rows[3:])}).save_to_disk(str(tmp_path / "dd"))
    keys = {"input_key": "input"}
    assert load_rows(str(tmp_path / "one"), keys) == rows
    assert load_rows(str(tmp_path / "dd"), keys) == rows[:3]
    assert load_rows(str(tmp_path / "dd"), keys, split="test") == rows[3:]
    with pytest.raises(DataError, match="has the splits train, test; --dataset_split dev"):
        load_rows(str(tmp_path / "dd"), keys, split="dev")
    arrow = [f for f in os.listdir(tmp_path / "one") if f.endswith(".arrow")]
    assert load_rows(str(tmp_path / "one" / arrow[0]), keys) == rows
    f = _jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match="one file, read as the split 'train'"):
        load_rows(f, keys, split="test", split_flag="--prompt_split")


def test_json_read_without_datasets(tmp_path, monkeypatch):
    """.jsonl / .json files and flat folders of them are read with the standard library (the GPU image has no
    ``datasets``): JSON lines, a list of objects, an object of columns; absent values None as datasets' table."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    a = _jsonl(tmp_path / "a.jsonl", [{"input": "1", "label": "x"}, {"input": "2"}])
    (tmp_path / "b.json").write_text(json.dumps([{"input": "3"}]))
    (tmp_path / "c.json").write_text(json.dumps({"input": ["4", "5"], "label": ["y", "z"]}))
    keys = {"input_key": "input"}
    assert load_rows(a, keys) == [{"input": "1", "label": "x"}, {"input": "2", "label": None}]
    assert load_rows(str(tmp_path / "c.json"), keys) == [{"input": "4", "label": "y"}, {"input": "5", "label": "z"}]
    both = load_rows(f"{a},{tmp_path / 'b.json'}", keys)
    assert [r["input"] for r in both] == ["1", "2", "3"] and both[2]["label"] is None
    flat = tmp_path / "flat"
    _jsonl(flat / "p1.jsonl", [{"input": "d1"}])
    _jsonl(flat / "p2.jsonl", [{"input": "d2"}])
    assert [r["input"] for r in load_rows(str(flat), keys)] == ["d1", "d2"]


def test_interleave_matches_datasets(tmp_path):
    """--dataset_probs mixes row for row as ``datasets.interleave_datasets(all_exhausted)`` (OpenRLHF's call)."""
    datasets = pytest.importorskip("datasets")

    a = [{"input": f"a{i}"} for i in range(7)]
    b = [{"input": f"b{i}"} for i in range(3)]
    for probs, seed in (([0.3, 0.7], 1), ([0.9, 0.1], 42)):
        want = datasets.interleave_datasets([datasets.Dataset.from_list(a), datasets.Dataset.from_list(b)],
                                            probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
        assert interleave([a, b], probs, seed) == want.to_list(), f"probabilities {probs}, seed {seed}"


def test_no_eval_data_trains_on_every_row(tmp_path, capsys):
    """OpenRLHF trains on every row without --eval_dataset (eval off); the hold-out is --eval_holdout, asked for by
    name; a number in --eval_split (its old meaning) is read as --eval_holdout with a notice."""
    from rlhf.config import parse

    f = _jsonl(tmp_path / "p.jsonl", [{"input": f"{i}+1="} for i in range(20)])
    keys = {"input_key": "input"}
    d = parse("grpo", ["--prompt_data", f, "--remote_rm_url", "r.py"]).data
    train, ev = load_train_eval(d, keys, d.prompt_data, None, None, "", 0)
    assert len(train) == 20 and ev == [], "without an eval data set every row trains (OpenRLHF)"
    d = parse("grpo", ["--prompt_data", f, "--remote_rm_url", "r.py", "--eval_holdout", "0.1"]).data
    train, ev = load_train_eval(d, keys, d.prompt_data, None, None, "", 0)
    assert (len(train), len(ev)) == (18, 2) and "--eval_holdout 0.1: holding out 2 of 20" in capsys.readouterr().out
    d = parse("sft", ["--eval_split", "0.25"]).data
    assert (d.eval_holdout, d.eval_split) == (0.25, "train")
    assert "read as --eval_holdout 0.25" in capsys.readouterr().err
    assert parse("sft", ["--eval.split", "test"]).data.eval_split == "test"


def test_sft_default_input_template_is_openrlhfs(tiny_kit):
    """SFT wraps the input as OpenRLHF does when no chat template is applied; the sample's tokens are OpenRLHF's
    (openrlhf/datasets/sft_dataset.py: ``prompt = input_template.format(input)``, text ``prompt + response``, loss
    from the prompt's length on). RM / DPO / RL keep OpenRLHF's None there."""
    from rlhf.config import parse
    from rlhf.models.load import load_tokenizer
    from rlhf.supervised.tasks import SFTTask
    from rlhf.train_sft import DEFAULTS

    tok = load_tokenizer(tiny_kit, padding_side="right")
    cfg = parse("sft", ["--max_len", "64"], DEFAULTS)
    assert cfg.data.input_template == "User: {}\nAssistant: "
    for kind in ("rm", "dpo", "grpo"):
        assert parse(kind, []).data.input_template is None, kind
    row = {"input": "7+8=", "output": "15"}
    ids, mask = make_task(SFTTask, cfg, tok).make_sample(row)
    # OpenRLHF, verbatim: preprocess_data (no chat template) and __getitem__ / get_loss_mask
    prompt = "User: {}\nAssistant: ".format(row["input"])
    text = (prompt + row["output"]).rstrip("\n")
    prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
    theirs = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # " " + eos text: the eos id
    assert ids == theirs, "the SFT sample's tokens differ from OpenRLHF's default formatting"
    assert mask == [0] * prompt_len + [1] * (len(ids) - prompt_len), "loss on the response and eos only"
    bare = parse("sft", ["--max_len", "64", "--input_template", ""], DEFAULTS)
    assert make_task(SFTTask, bare, tok).make_sample(row)[0][:3] == tok("7+8=", add_special_tokens=False)["input_ids"][:3]


def _openrlhf_pair(data, tok, is_dpo, apply_chat_template):
    """openrlhf/datasets/reward_dataset.py ``preprocess_data`` with ``prompt_key=None`` and ``__getitem__``'s text:
    ``(prompt + side).rstrip("\\n")``, plus ``" " + eos`` unless it already ends with the eos."""
    t = tok.apply_chat_template if apply_chat_template else None
    if t:
        prompt = ""
        chosen = t(data["chosen"], tokenize=False)
        rejected = t(data["rejected"], tokenize=False)
        if is_dpo:
            prompt = t(data["chosen"][:-1], tokenize=False, add_generation_prompt=True)
            chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
    else:
        prompt, chosen, rejected = "", data["chosen"], data["rejected"]
    return prompt, [(prompt + x).rstrip("\n") for x in (chosen, rejected)]


def test_preference_conversations_without_prompt_column(tiny_kit, tmp_path, capsys):
    """OpenRLHF's preference format (chosen / rejected whole conversations, no prompt column, as
    OpenRLHF/preference_dataset_mixture2_and_safe_pku) loads for train_rm and train_dpo and gives OpenRLHF's texts
    on a hand example: RM scores each whole conversation, DPO's loss lies on the last message."""
    from rlhf.config import parse
    from rlhf.data.screen import screen_rows
    from rlhf.models.load import load_tokenizer
    from rlhf.supervised.tasks import DPOTask, RMTask

    tok = load_tokenizer(tiny_kit, padding_side="right")
    user = {"role": "user", "content": "1+2="}
    row = {"chosen": [user, {"role": "assistant", "content": "3"}],
           "rejected": [user, {"role": "assistant", "content": "4"}]}
    f = _jsonl(tmp_path / "pairs.jsonl", [row, row])
    for kind, task_cls in (("rm", RMTask), ("dpo", DPOTask)):
        cfg = parse(kind, ["--apply_chat_template", "--max_len", "64"])
        task = make_task(task_cls, cfg, tok)
        rows = load_rows(f, {k: getattr(cfg.data, k) for k in task.required_keys})  # no 'input' column: loads
        kept, _ = screen_rows(rows, tok, cfg.data, kind)
        assert len(kept) == 2
        assert "chosen and rejected are read as whole conversations" in capsys.readouterr().out
        prompt, theirs = _openrlhf_pair(row, tok, kind == "dpo", True)
        sample = task.make_sample(row)
        sides = sample if kind == "rm" else (sample[0][0], sample[1][0])
        for ids, text in zip(sides, theirs):
            ours = tok.decode(ids, skip_special_tokens=False)
            assert ours == text + ("" if text.endswith(tok.eos_token) else tok.eos_token), (kind, ours, text)
        if kind == "dpo":  # loss on the last message (and eos) only, after OpenRLHF's prompt
            n = len(tok(prompt, add_special_tokens=False)["input_ids"])
            assert sample[0][1] == [0] * n + [1] * (len(sample[0][0]) - n)
    # plain text sides without a chat template: prompt "" and the texts as they are (OpenRLHF)
    cfg = parse("rm", ["--max_len", "64"])
    ids = make_task(RMTask, cfg, tok).make_sample({"chosen": "1+2=3", "rejected": "1+2=4"})
    assert tok.decode(ids[0]) == "1+2=3" + tok.eos_token
    # DPO sides that differ before their last message cannot share OpenRLHF's prompt: refused, naming the row
    bad = dict(row, rejected=[{"role": "user", "content": "9+9="}, {"role": "assistant", "content": "4"}])
    with pytest.raises(ValueError, match=r"train data, row 0: --chosen_key and --rejected_key conversations differ"):
        screen_rows([bad], tok, parse("dpo", ["--apply_chat_template"]).data, "dpo")


@pytest.mark.parametrize("messages, field", [
    ([{"content": "1+2="}, {"role": "assistant", "content": "3"}], "message 0 has no 'role'"),
    ([{"role": "user"}, {"role": "assistant", "content": "3"}], "message 0 (user) has no 'content'"),
    ([{"role": "user", "content": "1+2="}, {"role": "assistant", "content": 3}],
     "message 1 (assistant): 'content' is a int"),
    ([{"role": "user", "content": "1+2="}, "3"], "message 1 is a str"),
    ([{"role": "user", "content": "1+2="}], "has no assistant turn"),
])
def test_malformed_multiturn_rows_named_before_the_template(tiny_kit, messages, field):
    """Multi-turn SFT rows are checked before the chat template (and before any process group: the supervised
    trainer screens rows before comm.init): the error names the row, the message and field, and the fix."""
    from rlhf.config import parse
    from rlhf.data.screen import screen_rows
    from rlhf.models.load import load_tokenizer

    tok = load_tokenizer(tiny_kit, padding_side="right")
    cfg = parse("sft", ["--multiturn", "--apply_chat_template", "--input_key", "messages", "--output_key", ""])
    good = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    with pytest.raises(ValueError) as e:
        screen_rows([good, {"messages": messages}], tok, cfg.data, "sft")
    msg = str(e.value)
    assert msg.startswith("train data, row 1: ") and field in msg, msg
    assert "jinja" not in msg.lower()


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

    from rlhf.supervised.tasks import DPOTask, RMTask

    tok = AutoTokenizer.from_pretrained(tiny_kit)
    cfg = build_config({"max_len": 12}, "dpo")
    row = {"input": "9+9=" * 10, "chosen": "18", "rejected": "17"}
    (c_ids, c_mask), (r_ids, r_mask), _ = make_task(DPOTask, cfg, tok).make_sample(row)
    assert sum(c_mask[1:]) == 3 and sum(r_mask[1:]) == 3  # "1" "8" eos on each side
    c, r = make_task(RMTask, build_config({"max_len": 12}, "rm"), tok).make_sample(row)
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
    from rlhf.supervised.tasks import DPOTask, RMTask, SFTTask

    tok = AutoTokenizer.from_pretrained(tiny_kit)
    chat = {"max_len": 32, "apply_chat_template": True}
    plain = {"input": "1+2=", "output": "3", "chosen": "3", "rejected": "4"}
    msgs = {"input": [{"role": "user", "content": "1+2="}], "output": _msgs("3"), "chosen": _msgs("3"),
            "rejected": _msgs("4")}
    assert format_response(msgs["chosen"], msgs["input"], tok, True) == "3"
    for task in (SFTTask, RMTask, DPOTask):
        cfg = build_config(chat, task.name)
        got, want = make_task(task, cfg, tok).make_sample(msgs), make_task(task, cfg, tok).make_sample(plain)
        assert got == want, f"{task.name}: message-list sample {got} differs from the plain-text one {want}"
    rows = [msgs, dict(msgs, rejected=_msgs("3")), dict(msgs, chosen=_msgs("  "))]
    kept, rep = screen_rows(rows, tok, build_config(chat, "rm").data, "rm")
    assert (rep.kept, rep.dropped_identical, rep.dropped_empty) == (1, 1, 1), rep
    capsys.readouterr()
    for kind in ("sft", "rm", "dpo"):
        with pytest.raises(ValueError, match=r"row 0: .*is a chat message list .*pass --apply_chat_template"):
            screen_rows([msgs], tok, build_config({"max_len": 32}, kind).data, kind)
    with pytest.raises(ValueError, match="pass --apply_chat_template"):
        make_task(SFTTask, build_config({"max_len": 32}, "sft"), tok).make_sample(dict(plain, output=_msgs("3")))


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
