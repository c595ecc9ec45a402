"""A remote teacher (--teacher_url): the log-probs of the student's sampled tokens from a vLLM /
OpenAI-compatible server's ``/v1/completions`` with ``prompt_logprobs``.

The request and response follow vLLM vllm/entrypoints/openai/completion/protocol.py: ``CompletionRequest`` takes
``prompt`` as a list of token-id lists, ``max_tokens`` and the vLLM extension ``prompt_logprobs: int`` (or, with
``echo``, ``logprobs``); each ``CompletionResponseChoice`` has ``index`` and ``prompt_logprobs: list[dict[int,
Logprob] | None]``, one entry per prompt token: None for the first (nothing predicts it), else a dict from token id
(a JSON string key) to ``{"logprob", "rank", "decoded_token"}`` holding the prompt token itself and the top
``prompt_logprobs`` alternatives (vllm/logprobs.py ``Logprob``; -inf is sent as -9999.0,
vllm/entrypoints/openai/generate/base/serving.py ``clamp_prompt_logprobs``).  vLLM computes prompt log-probs from
the raw logits (temperature 1).
"""
from __future__ import annotations

import json
import urllib.request
from typing import Callable, List, Optional, Sequence

import torch

from rlhf.errors import TeacherServerError


def _post(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def _get(url: str, timeout_s: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def token_logprobs(prompt_logprobs: Sequence[Optional[dict]], ids: Sequence[int]) -> List[float]:
    """The log-prob of each token ``ids[j]`` from one choice's ``prompt_logprobs`` (0.0 for the first token, which
    nothing predicts).  Raises TeacherServerError where an entry lacks its own token (another tokenizer)."""
    if len(prompt_logprobs) != len(ids):
        raise TeacherServerError(f"the teacher server returned {len(prompt_logprobs)} prompt log-probs for "
                                 f"{len(ids)} tokens")
    out = [0.0]
    for j in range(1, len(ids)):
        entry = prompt_logprobs[j] or {}
        got = entry.get(str(ids[j]), entry.get(ids[j]))
        if got is None:
            raise TeacherServerError(f"the teacher server's prompt_logprobs at position {j} lack token {ids[j]} "
                                     f"(has {sorted(entry)[:5]}): it tokenizes differently from the student")
        out.append(float(got["logprob"] if isinstance(got, dict) else got))
    return out


class TeacherClient:
    """``logprobs(sequences, attention_mask, response_len) -> (B, R)``: the teacher's log-probs of each row's
    response tokens, one /v1/completions request per ``max_rows`` rows."""

    def __init__(self, url: str, model: Optional[str] = None, timeout_s: float = 300.0, max_rows: int = 64,
                 post: Callable[[str, dict, float], dict] = _post):
        self.base = url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.model, self.timeout_s, self.max_rows, self.post = model, timeout_s, max_rows, post

    def model_name(self) -> str:
        """--teacher_model_name, else the server's first /v1/models entry (vLLM's ``--served-model-name``)."""
        if self.model is None:
            data = _get(self.base + "/v1/models", self.timeout_s).get("data") or []
            if not data:
                raise TeacherServerError(f"{self.base}/v1/models lists no model: give --teacher_model_name")
            self.model = data[0]["id"]
        return self.model

    def request(self, rows: List[List[int]]) -> List[List[float]]:
        """Each token-id list's per-token log-probs (first token 0.0)."""
        body = {"model": self.model_name(), "prompt": rows, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 1}
        resp = self.post(self.base + "/v1/completions", body, self.timeout_s)
        choices = sorted(resp.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != len(rows):
            raise TeacherServerError(f"the teacher server answered {len(choices)} choices for {len(rows)} prompts "
                                     f"(answer: {str(resp)[:200]})")
        for c in choices:
            if c.get("prompt_logprobs") is None:
                raise TeacherServerError("the teacher server's choice has no prompt_logprobs: it must be vLLM's "
                                         "OpenAI-compatible server (the prompt_logprobs extension)")
        return [token_logprobs(c["prompt_logprobs"], ids) for c, ids in zip(choices, rows)]

    def logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
        """(B, P + R) ids and mask -> (B, R) float32 log-probs of the response columns (0 on padding)."""
        rows = [seq[m.bool()].tolist() for seq, m in zip(sequences.cpu(), attention_mask.cpu())]
        lps: List[List[float]] = []
        for s in range(0, len(rows), self.max_rows):
            lps.extend(self.request(rows[s:s + self.max_rows]))
        out = torch.zeros(sequences.shape, dtype=torch.float32)
        for i, (m, lp) in enumerate(zip(attention_mask.cpu(), lps)):
            out[i, m.bool()] = torch.tensor(lp, dtype=torch.float32)
        return out[:, -response_len:].to(sequences.device)
