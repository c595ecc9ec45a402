"""SFT modes beside prompt -> response (issue 26 item 9): --multiturn (loss on every assistant turn of a
conversation) and --pretrain_mode (loss on every token), as OpenRLHF's openrlhf/datasets/sft_dataset.py."""
import json
import os

import click
import pytest
import torch
import torch.nn.functional as F
from helpers.tasks import make_task

from rlhf.config.cli import parse
from rlhf.data.formatting import format_prompt, format_response, tokenize_pair
from rlhf.data.screen import screen_rows
from rlhf.data.sft_modes import conversation, multiturn_sample, pretrain_sample


def msg(role, content):
    return {"role": role, "content": content}


# three assistant turns, then a user turn after the last one (carries no loss and is left out)
CHAT = [msg("system", "be brief"), msg("user", "1+2="), msg("assistant", "3"), msg("user", "+4="),
        msg("assistant", "7"), msg("user", "+1="), msg("assistant", "8"), msg("user", "thanks")]


@pytest.fixture(scope="module")
def tok(tiny_kit):
    from rlhf.models.load import load_tokenizer

    # rlhf.models.tiny_kit's: "<|role|>content\n" per message, "<|assistant|>" as the generation prompt
    return load_tokenizer(tiny_kit, padding_side="right")


def test_multiturn_mask_covers_every_assistant_turn(tok):
    """The hand-built sample: the template renders '<|system|>be brief\\n<|user|>1+2=\\n<|assistant|>3\\n...'; the
    tiny tokenizer gives one token per character here. Loss on each assistant turn's text including the template's
    end of turn ('\\n'), and on the eos that ends the last turn; never on system / user text or '<|assistant|>'."""
    ids, mask, how = multiturn_sample(CHAT, tok, 100)
    expect = [("<|system|>", 0), *[(c, 0) for c in "be"], ("Ġ", 0), *[(c, 0) for c in "brief"], ("Ċ", 0),
              ("<|user|>", 0), *[(c, 0) for c in "1+2="], ("Ċ", 0), ("<|assistant|>", 0), ("3", 1), ("Ċ", 1),
              ("<|user|>", 0), *[(c, 0) for c in "+4="], ("Ċ", 0), ("<|assistant|>", 0), ("7", 1), ("Ċ", 1),
              ("<|user|>", 0), *[(c, 0) for c in "+1="], ("Ċ", 0), ("<|assistant|>", 0), ("8", 1), ("</s>", 1)]
    assert list(zip(tok.convert_ids_to_tokens(ids), mask)) == expect, "multiturn tokens / loss mask"
    assert [i for i, m in enumerate(mask) if m] == [17, 18, 25, 26, 33, 34] and how == ""
    assert ids[-1] == tok.eos_token_id

    # one assistant turn: exactly the single-turn sample of the same data (--input_key / --output_key SFT)
    one = CHAT[:3]
    single = tokenize_pair(tok, format_prompt(one[:2], tok, True), format_response(one[2:], one[:2], tok, True), 100)
    assert multiturn_sample(one, tok, 100)[:2] == single

    # --output_key's message is appended to the conversation (OpenRLHF: data[input_key].append(data[output_key]))
    row = {"messages": CHAT[:6], "output": CHAT[6]}
    assert conversation(row, "messages", "output") == CHAT[:7]
    assert multiturn_sample(conversation(row, "messages", "output"), tok, 100)[:2] == (ids, mask)

    # --max_len cuts the end off (and says so)
    cut_ids, cut_mask, how = multiturn_sample(CHAT, tok, 26)
    assert (cut_ids, cut_mask, how) == (ids[:26], mask[:26], "response")


def test_multiturn_with_a_chatml_template(tiny_kit):
    """ChatML (Qwen2.5-style: the end of turn is the eos, <|im_end|>): middle turns train on their '<|im_end|>\n',
    the last turn ends with one <|im_end|> (the template's, stripped, then the eos id appended: not two)."""
    from rlhf.models.load import load_tokenizer

    tok = load_tokenizer(tiny_kit, padding_side="right")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    ids, mask, _ = multiturn_sample(CHAT[1:5], tok, 100)
    marked = "".join(f"[{t}]" if m else t for t, m in zip(tok.convert_ids_to_tokens(ids), mask))
    assert marked == ("<|im_start|>userĊ1+2=<|im_end|>Ċ<|im_start|>assistantĊ[3][<|im_end|>][Ċ]"
                      "<|im_start|>userĊ+4=<|im_end|>Ċ<|im_start|>assistantĊ[7][<|im_end|>]")


def test_multiturn_bad_input_names_the_flag(tok):
    with pytest.raises(click.UsageError, match=r"--multiturn renders .* add --apply_chat_template"):
        parse("sft", ["--multiturn"])
    with pytest.raises(click.UsageError, match=r"--multiturn is an SFT mode .* drop it for dpo"):
        parse("dpo", ["--multiturn", "--apply_chat_template"])
    with pytest.raises(click.UsageError, match=r"--multiturn and --pretrain_mode are two SFT modes"):
        parse("sft", ["--multiturn", "--apply_chat_template", "--pretrain_mode"])
    cfg = parse("sft", ["--multiturn", "--apply_chat_template", "--input_key", "messages"])
    assert cfg.data.multiturn and not cfg.model.pretrain_mode
    # OpenRLHF's dotted spelling reaches the same flag
    assert parse("sft", ["--data.multiturn", "--apply_chat_template"]).data.multiturn
    assert parse("sft", ["--model.pretrain_mode_enable"]).model.pretrain_mode

    rows = [{"messages": CHAT[:3]}, {"messages": [msg("system", "s"), msg("user", "1+1=")]}]
    with pytest.raises(ValueError, match=r"train data, row 1: --multiturn: the conversation has no assistant turn "
                                         r"\(roles \['system', 'user'\]\)"):
        screen_rows(rows, tok, cfg.data, "sft")
    with pytest.raises(ValueError, match=r"row 0: --multiturn: --input_key 'messages' must hold the whole "
                                         r"conversation as a chat message list"):
        screen_rows([{"messages": "1+2="}], tok, cfg.data, "sft")
    kept, rep = screen_rows(rows[:1] * 3, tok, cfg.data, "sft")
    assert len(kept) == 3 and rep.kept == 3 and rep.dropped_empty == 0


def test_pretrain_mode_loss_is_the_plain_causal_lm_loss(tiny_kit):
    """--pretrain_mode: the text's own tokens (no chat template, no input_template, no eos), mask 1 everywhere, and
    the SFT loss of a padded batch equals the causal-LM loss by hand: mean over every real next token of
    -log softmax(logits_t)[x_{t+1}] (to 1e-6), with the fused LM head and without."""
    from transformers import AutoModelForCausalLM

    from rlhf.algorithms.preference import sft_token_loss
    from rlhf.models.load import load_tokenizer
    from rlhf.supervised.tasks import SFTTask, token_logprobs

    tok = load_tokenizer(tiny_kit, padding_side="right")
    cfg = parse("sft", ["--pretrain_mode", "--input_key", "text", "--apply_chat_template", "--input_template",
                        "Q: {}", "--max_len", "64"])
    task = make_task(SFTTask, cfg, tok)
    assert task.required_keys == {"input_key": None}  # no --output_key column needed
    texts = ["1+2=3 and 2+1=3", "7*8=56"]
    samples = [task.make_sample({"text": t}) for t in texts]
    for t, (ids, mask) in zip(texts, samples):
        assert ids == tok(t, add_special_tokens=False)["input_ids"] and mask == [1] * len(ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_kit, dtype=torch.float32).eval()
    b = task.collate(samples)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), b["input_ids"][:, 1:], reduction="none")
        real = b["attention_mask"][:, 1:].bool()
        by_hand = nll[real].mean()
        loss, _ = task.compute(model, b)
        unfused = sft_token_loss(token_logprobs(model, b, 3, fused=False), b["loss_mask"][:, 1:])  # 3-row chunks
        hf = model(input_ids=b["input_ids"][1:, :len(samples[1][0])], labels=b["input_ids"][1:, :len(samples[1][0])]).loss
    assert real.sum() == sum(len(s[0]) - 1 for s in samples)
    assert abs(float(loss) - float(by_hand)) < 1e-6 and abs(float(unfused) - float(by_hand)) < 1e-6, (loss, by_hand)
    assert abs(float(task.compute(model, task.collate(samples[1:]))[0]) - float(hf)) < 1e-6  # HF's own LM loss
    with pytest.raises(ValueError, match=r"--pretrain_mode trains on plain text, but --input_key 'text' holds"):
        pretrain_sample([msg("user", "hi")], tok, 64, "text")
    assert pretrain_sample("1+2=3", tok, 3)[:2] == (tok("1+2=3", add_special_tokens=False)["input_ids"][:3], [1] * 3)
    # rows with no next token to predict are dropped and counted; rows over --max_len are cut at the end and counted
    kept, rep = screen_rows([{"text": ""}, {"text": "7"}, {"text": "7*8=56"}, {"text": "1+2=3 " * 20}], tok, cfg.data, "sft",
                            pretrain_mode=cfg.model.pretrain_mode)
    assert [r["text"] for r in kept] == ["7*8=56", "1+2=3 " * 20]
    assert (rep.dropped_empty, rep.response_truncated, rep.examples["empty"]) == (2, 1, 0)


def _write(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def test_sft_modes_run_through_the_cli(tiny_kit, tmp_path):
    """python -m rlhf.train_sft --multiturn and --pretrain_mode (with LoRA) on the tiny kit, one process each. Each
    first step's loss (one micro-batch of all 16 rows) equals the mode's loss on the untrained model computed here,
    so the CLI trains on exactly these masks; the LoRA run's adapter folder then merges with
    rlhf.tools.lora_combiner into a plain model whose logits equal base + adapter."""
    from helpers.e2e import torchrun
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf.models.load import load_tokenizer
    from rlhf.supervised.tasks import SFTTask
    from rlhf.tools.lora_combiner import main as combine

    chats = [{"messages": [msg("user", f"{a}+{b}="), msg("assistant", str(a + b)), msg("user", f"+{a}="),
                           msg("assistant", str(2 * a + b))]} for a, b in zip(range(16), range(5, 21))]
    texts = [{"text": f"{a}+{b}={a + b} and {b}+{a}={a + b}"} for a, b in zip(range(16), range(3, 19))]
    common = ["--pretrain", tiny_kit, "--train_batch_size", 16, "--micro_train_batch_size", 16, "--eval_split", 0]
    mt, _, _ = torchrun("rlhf.train_sft", 0, common + [
        "--dataset", _write(tmp_path / "mt.jsonl", chats), "--input_key", "messages", "--multiturn",
        "--apply_chat_template", "--max_global_steps", 1, "--save_path", tmp_path / "mt"], tmp_path,
        str(tmp_path / "mt_logs"))
    pt, _, _ = torchrun("rlhf.train_sft", 0, common + [
        "--dataset", _write(tmp_path / "pt.jsonl", texts), "--input_key", "text", "--pretrain_mode",
        "--lora_rank", 4, "--learning_rate", 1e-2, "--max_epochs", 2, "--save_path", tmp_path / "pt"],
        tmp_path, str(tmp_path / "pt_logs"))

    tok = load_tokenizer(tiny_kit, padding_side="right")
    base = AutoModelForCausalLM.from_pretrained(tiny_kit, dtype=torch.float32).eval()
    for rows, log, flags in ((chats, mt, ["--multiturn", "--apply_chat_template", "--input_key", "messages"]),
                             (texts, pt, ["--pretrain_mode", "--input_key", "text"])):
        task = make_task(SFTTask, parse("sft", flags), tok)
        with torch.no_grad():
            want = float(task.loss(base, [task.make_sample(r) for r in rows])[0])
        assert abs(log[0]["loss"] - want) < 1e-4, (flags, log[0]["loss"], want)

    assert len(pt) == 2 and os.path.isfile(tmp_path / "pt" / "adapter_config.json")
    combine(["--model_path", tiny_kit, "--lora_path", str(tmp_path / "pt"), "--output_path", str(tmp_path / "merged"),
             "--param_dtype", "fp32"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([tok("3+4=7 and 4+3=7", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "pt").eval()(ids).logits
        got = merged(ids).logits
    assert (adapted - plain).abs().max() > 1e-3, "two LoRA steps at lr 1e-2 should move the logits"
    assert (got - adapted).abs().max() < 1e-5
