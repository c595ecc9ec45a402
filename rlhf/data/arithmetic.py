"""Built-in verifiable task: integer addition, as jsonl generators (no download needed).

Prompt ``"12+7="``, label ``"19"``.  SFT rows add ``output``; preference rows
pair the right answer (chosen) with a wrong one (rejected).
"""
from __future__ import annotations

import json
import random
import re
from typing import Dict, Iterator, List, Optional

MAX_OPERAND = 9


def arithmetic_prompts(n: int, seed: int, max_operand: int = MAX_OPERAND) -> List[Dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"input": f"{a}+{b}=", "label": str(a + b)})
    return rows


def sft_rows(n: int, seed: int) -> List[Dict]:
    return [dict(r, output=r["label"]) for r in arithmetic_prompts(n, seed)]


def preference_rows(n: int, seed: int) -> List[Dict]:
    rng = random.Random(seed + 1)
    out = []
    for r in arithmetic_prompts(n, seed):
        good = int(r["label"])
        bad = good + rng.choice([-3, -2, -1, 1, 2, 3, 10])
        out.append({"input": r["input"], "chosen": str(good), "rejected": str(abs(bad)), "label": r["label"]})
    return out


_INT = re.compile(r"-?\d+")


def extract_answer(text: str) -> Optional[str]:
    m = _INT.search(text)
    return m.group(0) if m else None


def arithmetic_score(response: str, label: str) -> float:
    """1 for the exact sum; 0.5 * (1 - |error| / 10) for a near miss (dense signal); 0 without an integer."""
    ans = extract_answer(response)
    if ans is None:
        return 0.0
    err = abs(int(ans) - int(str(label).strip()))
    return 1.0 if err == 0 else 0.5 * max(0.0, 1.0 - err / 10.0)


def arithmetic_reward(queries: List[str], prompts: List[str], labels: List[str], **kwargs) -> Dict:
    """The reward_func API: shaped score as reward, exact-match accuracy in extra_logs."""
    import torch

    resp = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    t = torch.tensor([arithmetic_score(r, lab) for r, lab in zip(resp, labels)], dtype=torch.float32)
    acc = torch.tensor([float(extract_answer(r) == str(lab).strip()) for r, lab in zip(resp, labels)])
    return {"rewards": t, "scores": acc, "extra_logs": {"accuracy": acc}}


def write_jsonl(path: str, rows: List[Dict]) -> None:
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def corpus(seed: int = 0) -> Iterator[str]:
    """Text the tiny tokenizer is trained on."""
    for r in preference_rows(2000, seed):
        yield r["input"] + r["chosen"]
        yield r["input"] + r["rejected"]
    yield "user assistant system You are a helpful assistant. What is the sum?"
