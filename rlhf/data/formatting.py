"""Turn rows into prompt text and tokenized SFT / preference samples."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from rlhf.console import is_rank0


def format_prompt(raw, tokenizer, apply_chat_template: bool, input_template: Optional[str] = None,
                  tools: Optional[list] = None) -> str:
    """Chat template (messages list or plain text as one user turn) or ``input_template.format(text)``; ``tools``:
    OpenAI function schemas the chat template renders (``apply_chat_template(..., tools=tools)``; template only)."""
    if apply_chat_template:
        msgs = raw if isinstance(raw, list) else [{"role": "user", "content": str(raw)}]
        kw = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    text = raw if isinstance(raw, str) else "\n".join(m["content"] for m in raw)
    return input_template.format(text) if input_template else text


def is_messages(raw) -> bool:
    """A chat message list, OpenRLHF style: ``[{"role": ..., "content": ...}, ...]``."""
    return isinstance(raw, list) and bool(raw) and all(isinstance(m, dict) and "content" in m for m in raw)


def format_response(raw, prompt_raw, tokenizer, apply_chat_template: bool, key: str = "output_key") -> str:
    """A response as text: plain text as it is; a message list through the chat template, as OpenRLHF does
    (openrlhf/datasets/sft_dataset.py and reward_dataset.py ``preprocess_data``: ``apply_chat_template(prompt +
    response, tokenize=False)[len(prompt):]`` with ``prompt = apply_chat_template(prompt, tokenize=False,
    add_generation_prompt=True)``), with the trailing newline and eos text removed since ``tokenize_pair`` ends
    every response with the eos id. A message list without --apply_chat_template is a ValueError that says so
    (``str()`` would train on the Python repr).
    """
    if not isinstance(raw, list):
        return raw if isinstance(raw, str) else str(raw)
    if not is_messages(raw):
        raise ValueError(f"--{key} response {str(raw)[:80]!r} is a list but not of chat messages; give text or "
                         '[{"role": "assistant", "content": "..."}]')
    if not apply_chat_template:
        raise ValueError(f"--{key} response is a chat message list ({str(raw)[:80]!r}); pass --apply_chat_template "
                         "to render it with the tokenizer's chat template (as OpenRLHF does), or give plain text")
    msgs = prompt_raw if isinstance(prompt_raw, list) else [{"role": "user", "content": str(prompt_raw)}]
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(msgs + raw, tokenize=False)
    if not full.startswith(prompt):
        raise ValueError(f"--{key}: the chat template renders prompt + response without the prompt's own text as a "
                         "prefix, so the response cannot be cut out; give the response as plain text")
    text = full[len(prompt):].rstrip("\n")
    eos = getattr(tokenizer, "eos_token", None)
    return text[:-len(eos)] if eos and text.endswith(eos) else text


def _strip_end(text: str, tokenizer) -> str:
    """A response's end as ``tokenize_pair`` wants it: trailing newlines and the eos text removed (the eos id is
    appended there), OpenRLHF's ``(prompt + response).rstrip("\\n")`` + eos."""
    text = text.rstrip("\n")
    eos = getattr(tokenizer, "eos_token", None)
    return text[:-len(eos)] if eos and text.endswith(eos) else text


def has_prompt(row, input_key: str) -> bool:
    """A preference row with a prompt column; without one, chosen / rejected are whole conversations (OpenRLHF's
    format without ``--prompt_key``, e.g. OpenRLHF/preference_dataset_mixture2_and_safe_pku)."""
    return row.get(input_key) is not None


def conversation_pair(row, tokenizer, cfg_data, is_dpo: bool):
    """(prompt, chosen, rejected) text of a preference row that has no prompt column, as OpenRLHF's
    openrlhf/datasets/reward_dataset.py ``preprocess_data`` with ``prompt_key=None``:

    * chat template, reward model: ``prompt = ""``, each side the whole conversation rendered;
    * chat template, DPO: ``prompt = template(chosen[:-1], add_generation_prompt=True)`` and each side its rendering
      after that prompt (``[len(prompt):]``), so the loss lies on the last message;
    * no chat template: ``prompt = ""`` and each side's text as it is.

    Each side's end as ``_strip_end`` (``tokenize_pair`` appends the eos id). ValueError (naming the flag) for a side
    that is not a conversation under the template, or not text without it, and for DPO sides whose conversations
    differ before their last message (OpenRLHF cuts both at the chosen prompt's length, which would cut the rejected
    side mid-text)."""
    d = cfg_data
    sides = [row.get(d.chosen_key), row.get(d.rejected_key)]
    for key, side in zip(("chosen_key", "rejected_key"), sides):
        if d.apply_chat_template and not is_messages(side):
            raise ValueError(f"--{key} holds {str(side)[:80]!r}: without a --input_key column ({d.input_key!r}) each "
                             f"side is a whole conversation, a chat message list (OpenRLHF's format without "
                             f"--prompt_key); give message lists, or a prompt column named by --input_key")
        if not d.apply_chat_template and not isinstance(side, str):
            raise ValueError(f"--{key} holds {str(side)[:80]!r}: a conversation needs --apply_chat_template to be "
                             f"rendered (as OpenRLHF does); or give plain text")
    if not d.apply_chat_template:
        return "", _strip_end(sides[0], tokenizer), _strip_end(sides[1], tokenizer)
    full = [tokenizer.apply_chat_template(side, tokenize=False) for side in sides]
    if not is_dpo:
        return "", _strip_end(full[0], tokenizer), _strip_end(full[1], tokenizer)
    if sides[0][:-1] != sides[1][:-1]:
        raise ValueError(f"--chosen_key and --rejected_key conversations differ before their last message; DPO "
                         f"without a --input_key column ({d.input_key!r}) takes the prompt from the chosen side "
                         f"(OpenRLHF), so both must share it: give the same conversation with different last "
                         f"messages, or a prompt column named by --input_key")
    prompt = tokenizer.apply_chat_template(sides[0][:-1], tokenize=False, add_generation_prompt=True)
    if not all(f.startswith(prompt) for f in full):
        raise ValueError("--chosen_key: the chat template renders the conversation without its prompt's own text as "
                         "a prefix, so the last message cannot be cut out; give a prompt column named by --input_key")
    return prompt, _strip_end(full[0][len(prompt):], tokenizer), _strip_end(full[1][len(prompt):], tokenizer)


def pair_texts(row, tokenizer, cfg_data, is_dpo: bool):
    """(prompt, chosen, rejected) text of a preference row (reward model and DPO): with a --input_key column the
    prompt through ``format_prompt`` and each side through ``format_response``; without one, OpenRLHF's whole
    conversations (``conversation_pair``)."""
    d = cfg_data
    if not has_prompt(row, d.input_key):
        return conversation_pair(row, tokenizer, d, is_dpo)
    prompt = format_prompt(row[d.input_key], tokenizer, d.apply_chat_template, d.input_template)
    return (prompt,) + tuple(format_response(row[getattr(d, k)], row[d.input_key], tokenizer, d.apply_chat_template, k)
                             for k in ("chosen_key", "rejected_key"))


@dataclass
class PromptItem:
    prompt: str
    label: Optional[str]
    ids: List[int]
    tools: Optional[list] = None  # the OpenAI function schemas rendered into the prompt (row_tools)
    images: Optional[tuple] = None  # a vision-language prompt's (pixel_values, image_grid_thw, files): rlhf.data.images


def row_tools(row, default: Optional[list] = None) -> Optional[list]:
    """A row's ``tools`` column (OpenAI function schemas; a JSON text of them too, as datasets often store it), else
    ``default`` (the --tools_path file's schemas)."""
    t = row.get("tools")
    if isinstance(t, str):
        import json

        try:
            t = json.loads(t)
        except json.JSONDecodeError as e:
            raise ValueError(f"a row's 'tools' column is text but not JSON ({e}): {t[:80]!r}; give a list of OpenAI "
                             f'function schemas, e.g. [{{"type": "function", "function": {{"name": ...}}}}]') from e
    if t is not None and not (isinstance(t, list) and all(isinstance(x, dict) for x in t)):
        raise ValueError(f"a row's 'tools' column holds {str(t)[:80]!r}; give a list of OpenAI function schemas")
    return t if t else default


def build_prompts(rows: List[Dict], tokenizer, cfg_data, tools: Optional[list] = None, images=None
                  ) -> List[PromptItem]:
    """Prompts left-truncated to --prompt_max_len; how many were cut is said once (not silently).  A prompt with
    no tokens at all (an empty --input_key, no chat template) has nothing to condition on and would break the
    rollout's shapes: such rows are dropped and counted; a file of nothing else is refused here, at load.
    ``tools``: the schemas of rows without a ``tools`` column of their own (``row_tools``).  ``images``: a
    vision-language model's ``rlhf.data.images.ImageInputs`` (its prompts carry their images)."""
    if images is not None:
        return images.build_prompts(rows, tokenizer, cfg_data)
    out, cut, empty = [], 0, 0
    for r in rows:
        offered = row_tools(r, tools)
        text = format_prompt(r[cfg_data.input_key], tokenizer, cfg_data.apply_chat_template, cfg_data.input_template,
                             offered)
        full = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not full:
            empty += 1
            continue
        ids = full[-cfg_data.prompt_max_len:]
        cut += len(ids) < len(full)
        label = r.get(cfg_data.label_key) if cfg_data.label_key else None
        out.append(PromptItem(text, None if label is None else str(label), ids, offered))
    if rows and not out:
        from rlhf.data.loading import DataError

        raise DataError(f"all {len(rows)} prompts are empty (no tokens in --input_key {cfg_data.input_key!r}): check "
                        f"--input_key names the column that holds the prompts, or use --apply_chat_template")
    say = is_rank0()
    if empty and say:
        print(f"[data] {empty} of {len(rows)} prompts are empty (no tokens in --input_key {cfg_data.input_key!r}) "
              f"and are left out", flush=True)
    if cut and say:
        print(f"[data] {cut} of {len(rows)} prompts are longer than --prompt_max_len {cfg_data.prompt_max_len} and "
              f"lost their first tokens; raise --prompt_max_len to keep them whole", flush=True)
    return out


def fit_pair(p: List[int], r: List[int], max_len: int):
    """Fit prompt ids ``p`` and response ids ``r`` (eos included) into ``max_len`` tokens.

    Too long: the prompt is left-truncated so the whole response fits (one prompt token is kept, so the first
    response token still has a prediction); only a response that alone fills ``max_len`` is cut at its end.
    Returns (p, r, how) with how "" (fits), "prompt" or "response".  The response is never emptied.
    """
    if len(p) + len(r) <= max_len:
        return p, r, ""
    if len(r) <= max_len - 1:
        return p[len(p) + len(r) - max_len:], r, "prompt"
    p = p[-1:]
    return p, r[:max_len - len(p)], "response"


def tokenize_pair(tokenizer, prompt: str, response: str, max_len: int, return_how: bool = False):
    """(input_ids, loss_mask) of prompt + response + eos; loss on response tokens (and eos) only.

    Longer than ``max_len``: see ``fit_pair`` (prompt side truncated first).
    """
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    p, r, how = fit_pair(p, r, max_len)
    out = (p + r, [0] * len(p) + [1] * len(r))
    return out + (how,) if return_how else out


def pad_batch(seqs: List[List[int]], pad_id: int, side: str = "right"):
    """(ids, attention_mask) (B, max len), padded on the given side; one tensor build, no per-row copies."""
    n = max(len(s) for s in seqs)
    if side == "right":
        ids = [list(s) + [pad_id] * (n - len(s)) for s in seqs]
        att = [[1] * len(s) + [0] * (n - len(s)) for s in seqs]
    else:
        ids = [[pad_id] * (n - len(s)) + list(s) for s in seqs]
        att = [[0] * (n - len(s)) + [1] * len(s) for s in seqs]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(att, dtype=torch.long)


def collate_supervised(samples, pad_id: int) -> Dict[str, torch.Tensor]:
    """samples: list of (ids, loss_mask) -> padded input_ids, attention_mask, loss_mask (aligned to labels)."""
    ids, att = pad_batch([s[0] for s in samples], pad_id)
    lm, _ = pad_batch([s[1] for s in samples], 0)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": lm}


def collate_packed(samples) -> Dict[str, torch.Tensor]:
    """One row of all samples back to back, position ids restarting per sample (no padding)."""
    ids = torch.tensor([t for s in samples for t in s[0]]).unsqueeze(0)
    lm = torch.tensor([m for s in samples for m in s[1]]).unsqueeze(0)
    pos = torch.cat([torch.arange(len(s[0])) for s in samples]).unsqueeze(0)
    seg = torch.cat([torch.full((len(s[0]),), i) for i, s in enumerate(samples)]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": pos, "loss_mask": lm, "segment_ids": seg}
