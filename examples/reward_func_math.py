"""GSM8K-style verifiable reward: the last number of the response (or after '####') against the label's.

    --remote_rm_url examples/reward_func_math.py
"""
import re

import torch

_NUM = re.compile(r"-?\d[\d,]*\.?\d*")


def _final_number(text: str):
    if "####" in text:
        text = text.split("####")[-1]
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text)
    if boxed:
        text = boxed[-1]
    nums = _NUM.findall(text)
    if not nums:
        return None
    try:
        return float(nums[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for q, p, lab in zip(queries, prompts, labels):
        pred, gold = _final_number(q[len(p):]), _final_number(str(lab))
        rewards.append(1.0 if pred is not None and gold is not None and abs(pred - gold) < 1e-6 else 0.0)
    r = torch.tensor(rewards)
    return {"rewards": r, "scores": r, "extra_logs": {"accuracy": r}}
