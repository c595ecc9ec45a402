"""Screen SFT / RM / DPO rows before tokenizing: count what ``--max_len`` truncates, drop what cannot train.

Dropped (counted, announced once, logged as ``data/*`` metrics):
  * an empty response (SFT output, or a chosen / rejected side) -- nothing to learn from;
  * chosen == rejected (RM / DPO) -- the pair's loss is log 2 with zero gradient forever.
Truncated (kept, counted): rows longer than ``--max_len`` lose prompt tokens from the left (``fit_pair``);
only a response that alone fills ``--max_len`` is cut at its end.  No row trains on an empty response.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from rlhf.console import print0
from rlhf.data.formatting import format_prompt, format_response, has_prompt, pair_texts, tokenize_pair

RESPONSE_KEYS = {"sft": ("output_key",), "rm": ("chosen_key", "rejected_key"), "dpo": ("chosen_key", "rejected_key")}


@dataclass
class DataReport:
    split: str
    max_len: int
    rows: int = 0
    kept: int = 0
    prompt_truncated: int = 0
    response_truncated: int = 0
    dropped_empty: int = 0
    dropped_identical: int = 0
    examples: Dict[str, int] = field(default_factory=dict)   # reason -> index of the first such row

    def metrics(self) -> Dict[str, float]:
        return {f"{self.split}_{k}": float(getattr(self, k)) for k in
                ("rows", "kept", "prompt_truncated", "response_truncated", "dropped_empty", "dropped_identical")}

    def message(self) -> str:
        parts = []
        if self.prompt_truncated:
            parts.append(f"{self.prompt_truncated} longer than --max_len {self.max_len} had their prompt "
                         f"left-truncated (first: row {self.examples['prompt']})")
        if self.response_truncated:
            parts.append(f"{self.response_truncated} had a response longer than --max_len {self.max_len} cut at its "
                         f"end (first: row {self.examples['response']})")
        if self.dropped_empty:
            parts.append(f"{self.dropped_empty} dropped for an empty response (first: row {self.examples['empty']})")
        if self.dropped_identical:
            parts.append(f"{self.dropped_identical} dropped because chosen == rejected (their loss is log 2 with zero "
                         f"gradient; first: row {self.examples['identical']})")
        if not parts:
            return ""
        fix = "; raise --max_len to keep rows whole" if self.prompt_truncated or self.response_truncated else ""
        return f"[data] {self.split}: of {self.rows} rows, " + "; ".join(parts) + fix

    def announce(self) -> None:
        msg = self.message()
        if msg:
            print0(msg)


def screen_rows(rows: List[Dict], tokenizer, data, kind: str, split: str = "train",
                pretrain_mode: bool = False) -> Tuple[List[Dict], DataReport]:
    """(kept rows, report) for kind sft / rm / dpo; ``data`` is the --data flag group
    (rlhf.config.schema.DataConfig), ``pretrain_mode`` SFT's --pretrain_mode."""
    d = data
    keys = [getattr(d, k) for k in RESPONSE_KEYS[kind]]
    rep = DataReport(split, d.max_len, rows=len(rows))
    if kind == "sft" and (d.multiturn or pretrain_mode):  # whole conversations / texts
        from rlhf.data.sft_modes import mode_of, screen_mode_rows
        return screen_mode_rows(rows, tokenizer, d, mode_of(d, pretrain_mode), split, rep), rep
    kept, whole = [], 0
    for i, row in enumerate(rows):
        if any(row.get(k) is None for k in keys):
            rep.dropped_empty += 1
            rep.examples.setdefault("empty", i)
            continue
        whole += kind != "sft" and not has_prompt(row, d.input_key)
        try:  # message lists rendered as training will see them (a list without --apply_chat_template: an error)
            prompt, responses = _texts(row, tokenizer, d, kind)
        except ValueError as e:
            raise ValueError(f"{split} data, row {i}: {e}") from None
        if any(not x.strip() for x in responses):
            rep.dropped_empty += 1
            rep.examples.setdefault("empty", i)
            continue
        if len(responses) == 2 and responses[0].strip() == responses[1].strip():
            rep.dropped_identical += 1
            rep.examples.setdefault("identical", i)
            continue
        hows = {tokenize_pair(tokenizer, prompt, x, d.max_len, return_how=True)[2] for x in responses}
        for how in ("response", "prompt"):
            if how in hows:
                setattr(rep, f"{how}_truncated", getattr(rep, f"{how}_truncated") + 1)
                rep.examples.setdefault(how, i)
                break
        kept.append(row)
    rep.kept = len(kept)
    if whole:
        print0(f"[data] {split}: {whole} of {len(rows)} rows have no --input_key {d.input_key!r} column: chosen and "
               f"rejected are read as whole conversations (OpenRLHF's preference format without --prompt_key)")
    rep.announce()
    if rows and not kept:
        raise ValueError(f"{split} data: all {len(rows)} rows were dropped: {rep.message()}")
    return kept, rep


def _texts(row: Dict, tokenizer, d, kind: str):
    """(prompt, [responses]) as training renders them: SFT's prompt -> output, or a preference pair
    (``pair_texts``: with a prompt column, or OpenRLHF's whole conversations without one). Message lists are checked
    first (``check_messages``), so a malformed one is named here, not inside the chat template."""
    from rlhf.data.sft_modes import check_messages

    for flag in ("input_key",) + RESPONSE_KEYS[kind]:
        check_messages(row.get(getattr(d, flag)), flag, getattr(d, flag))
    if kind == "sft":
        prompt = format_prompt(row[d.input_key], tokenizer, d.apply_chat_template, d.input_template)
        return prompt, [format_response(row[d.output_key], row[d.input_key], tokenizer, d.apply_chat_template,
                                        "output_key")]
    prompt, chosen, rejected = pair_texts(row, tokenizer, d, is_dpo=kind == "dpo")
    return prompt, [chosen, rejected]
