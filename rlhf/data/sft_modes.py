"""The two SFT sample modes beside prompt -> response: ``--multiturn`` (loss on every assistant turn of a
conversation) and ``--pretrain_mode`` (loss on every token of plain text, continued pre-training).

Mirrors OpenRLHF's openrlhf/datasets/sft_dataset.py (``SFTDataset.process_data`` / ``get_loss_mask``):

* multiturn: the whole conversation is one chat message list in ``--input_key`` (a message or list of messages in
  ``--output_key``, when the row has one, is appended to it, as OpenRLHF does). For each assistant turn ``i`` the
  chat template is applied to the growing prefixes ``msgs[:i]`` (with the generation prompt) and ``msgs[:i+1]``;
  the text between the two renderings is that turn's response and carries the loss; everything else (system,
  user, tool turns and the generation prompts) carries none. Upstream tokenizes the full text once and counts
  the tokens of each prefix to find the ranges; here each piece is tokenized on its own and the pieces are
  concatenated, so the mask lies exactly on the tokens it names (whole-text BPE can merge across a boundary and
  shift upstream's ranges). The last assistant turn ends like a single-turn SFT response
  (``rlhf.data.formatting.format_response``: trailing newline and eos text removed, the eos id appended), so a
  one-turn conversation gives the same sample as ``--input_key``/``--output_key`` SFT with
  ``--apply_chat_template``. Messages after the last assistant turn carry no loss and are left out.
* pretrain_mode: ``--input_key`` is plain text, tokenized as it is (no chat template, no --input_template, no
  special tokens, no eos: upstream's ``text = prompt``), loss on every token.

Both are cut at their end to ``--max_len`` (upstream's ``truncation=True``).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from rlhf.data.formatting import format_response, is_messages

Sample = Tuple[List[int], List[int]]


def check_messages(msgs, flag: str, key: str) -> None:
    """Every message a dict with a string ``role`` and a string ``content`` (``None`` only beside ``tool_calls``),
    checked before the chat template sees them (jinja2 would fail inside the template, naming neither the row nor
    the field). ValueError names the flag, the message's index and field, and the fix."""
    if not isinstance(msgs, list) or not msgs:
        return
    fix = ('each message is {"role": "user" | "assistant" | "system" | ..., "content": "text"}')
    for j, m in enumerate(msgs):
        where = f"--{flag} {key!r}, message {j}"
        if not isinstance(m, dict):
            raise ValueError(f"{where} is a {type(m).__name__} ({str(m)[:60]!r}), not a message; {fix}")
        if not isinstance(m.get("role"), str) or not m.get("role"):
            got = "has no 'role'" if "role" not in m else f"has the role {m['role']!r}, not a name"
            raise ValueError(f"{where} {got} (keys: {', '.join(map(str, m))}); {fix}")
        content = m.get("content")
        if "content" not in m:
            raise ValueError(f"{where} ({m['role']}) has no 'content' (keys: {', '.join(map(str, m))}); {fix}")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(f"{where} ({m['role']}): 'content' is a {type(content).__name__} "
                             f"({str(content)[:60]!r}), not text; give the text as a string (only an assistant "
                             f"message with 'tool_calls' may have null content)")


def conversation(row: Dict, input_key: str, output_key: str = None) -> List[Dict]:
    """The row's messages: ``--input_key``'s list plus ``--output_key``'s message(s) when the row has them; every
    message checked (``check_messages``)."""
    msgs = row.get(input_key)
    check_messages(msgs, "input_key", input_key)
    if not is_messages(msgs):
        raise ValueError(f"--multiturn: --input_key {input_key!r} must hold the whole conversation as a chat message "
                         f'list ([{{"role": "user", "content": ...}}, {{"role": "assistant", ...}}, ...]), got '
                         f"{str(msgs)[:80]!r}; for prompt/response text drop --multiturn")
    extra = row.get(output_key) if output_key else None
    if extra is not None:
        extra = [extra] if isinstance(extra, dict) else extra
        check_messages(extra, "output_key", output_key)
        if not is_messages(extra):
            raise ValueError(f"--multiturn: --output_key {output_key!r} holds {str(extra)[:80]!r}, not a chat "
                             f"message (or list of them) to append to the conversation; put the whole conversation "
                             f'in --input_key and pass --output_key ""')
        msgs = list(msgs) + list(extra)
    return list(msgs)


def multiturn_segments(msgs: List[Dict], tokenizer) -> List[Tuple[str, bool]]:
    """[(text, carries loss)] of a conversation rendered with the chat template, up to its last assistant turn.

    For assistant turn i: ``prompt_i = template(msgs[:i], add_generation_prompt=True)``,
    ``full_i = template(msgs[:i+1])``; the loss text is ``full_i[len(prompt_i):]``, the text before it is
    ``prompt_i[len(full_{previous}):]``. ValueError when no turn is an assistant's or a rendering does not
    extend the previous one (the pieces could not be cut apart).
    """
    turns = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
    if not turns:
        roles = [m.get("role") for m in msgs]
        raise ValueError(f"--multiturn: the conversation has no assistant turn (roles {roles}), so nothing carries "
                         f"the loss; every row needs at least one {{\"role\": \"assistant\"}} message")

    def render(part, gen):
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=gen) if part else ""

    out, done = [], ""
    for i in turns:
        prompt = render(msgs[:i], True)
        full = render(msgs[:i + 1], False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise ValueError("--multiturn: the chat template renders a longer conversation without the shorter one's "
                             "text as its prefix, so the assistant turns cannot be cut out; use a tokenizer whose "
                             "template renders turns in order")
        if len(prompt) > len(done):
            out.append((prompt[len(done):], False))
        out.append((full[len(prompt):], True))
        done = full
    last = turns[-1]  # ends like a single-turn response (format_response); the eos id is appended by the caller
    if last:
        out[-1] = (format_response([msgs[last]], msgs[:last], tokenizer, True, "multiturn"), True)
    else:  # the conversation opens with its only assistant turn: no prompt to render (transformers refuses [])
        text, eos = out[-1][0].rstrip("\n"), getattr(tokenizer, "eos_token", None)
        out[-1] = (text[:-len(eos)] if eos and text.endswith(eos) else text, True)
    return out


def multiturn_sample(msgs: List[Dict], tokenizer, max_len: int) -> Tuple[List[int], List[int], str]:
    """(input_ids, loss_mask, how) of a conversation: mask 1 on every assistant turn's tokens and the final eos;
    how is "response" when ``max_len`` cut the end off, else ""."""
    ids, mask = [], []
    for text, loss in multiturn_segments(msgs, tokenizer):
        t = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += t
        mask += [int(loss)] * len(t)
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    how = "response" if len(ids) > max_len else ""
    return ids[:max_len], mask[:max_len], how


def pretrain_sample(text, tokenizer, max_len: int, input_key: str = "input") -> Tuple[List[int], List[int], str]:
    """(input_ids, loss_mask, how) of plain text: its tokens as they are, mask 1 everywhere."""
    if not isinstance(text, str):
        raise ValueError(f"--pretrain_mode trains on plain text, but --input_key {input_key!r} holds "
                         f"{str(text)[:80]!r}; give a text column (or drop --pretrain_mode for prompt/response data)")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    how = "response" if len(ids) > max_len else ""
    ids = ids[:max_len]
    return ids, [1] * len(ids), how


def mode_of(data, pretrain_mode: bool) -> str:
    """"multiturn", "pretrain" or "" (prompt -> response SFT), from ``data`` (the --data flag group,
    rlhf.config.schema.DataConfig: --multiturn) and --pretrain_mode."""
    return "pretrain" if pretrain_mode else "multiturn" if data.multiturn else ""


def mode_sample(row: Dict, tokenizer, data, mode: str) -> Tuple[List[int], List[int], str]:
    """(input_ids, loss_mask, how) of a row under ``mode`` (``mode_of``: --multiturn or --pretrain_mode); ``data``
    gives --input_key, --output_key and --max_len."""
    d = data
    if mode == "pretrain":
        return pretrain_sample(row.get(d.input_key), tokenizer, d.max_len, d.input_key)
    return multiturn_sample(conversation(row, d.input_key, d.output_key), tokenizer, d.max_len)


def screen_mode_rows(rows: List[Dict], tokenizer, data, mode: str, split: str, rep) -> List[Dict]:
    """rlhf.data.screen.screen_rows for the two modes: rows cut by --max_len are counted (``response_truncated``),
    rows left with no token to predict (no loss token after the first) are dropped (``dropped_empty``); a row the
    mode cannot read is a ValueError naming the row and the flag."""
    kept = []
    for i, row in enumerate(rows):
        try:
            ids, mask, how = mode_sample(row, tokenizer, data, mode)
        except ValueError as e:
            raise ValueError(f"{split} data, row {i}: {e}") from None
        if not any(mask[1:]):
            rep.dropped_empty += 1
            rep.examples.setdefault("empty", i)
            continue
        if how:
            rep.response_truncated += 1
            rep.examples.setdefault("response", i)
        kept.append(row)
    rep.kept = len(kept)
    rep.announce()
    if rows and not kept:
        raise ValueError(f"{split} data: all {len(rows)} rows were dropped: {rep.message()}")
    return kept
