"""Per-request generation on vLLM's V1 engine: ``step_requests`` drives ``LLM.llm_engine``'s ``add_request`` /
``abort_request`` / ``step`` as ``LLM._run_engine`` does (vllm/entrypoints/common/offline.py ``_add_request``:
the prompt rendered by ``_preprocess_cmpl_one``, ``output_kind = FINAL_ONLY`` so a step reports only finished
requests; ``_run_engine``: ``step()`` while requests are unfinished), one step per call, requests joining and
leaving between steps (vllm/v1/core/sched/scheduler.py schedules whatever is running or waiting each step).

Seeds: a request is sampled from the engine's shared generator, not a per-request one (vLLM samples seeded
requests one by one in a Python loop, vllm/v1/sample/ops/topk_topp_sampler.py ``random_sample``); greedy
requests give exactly a single-request ``generate``'s tokens.  A request vLLM refuses (a prompt at or over
max_model_len: ``VLLMValidationError``, vllm/renderers/params.py) fails alone (``StepResult.failed``)."""
from __future__ import annotations

from typing import Sequence

from rlhf.engines.requests import Completion, Request, StepResult


def vllm_params(vllm, r: Request, eos: int):
    """vLLM SamplingParams of one request, as ``VLLMEngine._generate`` builds them (log-probs of the sampled
    token, no detokenisation), reporting only the finished output."""
    from vllm.sampling_params import RequestOutputKind

    p = r.params
    sp = vllm.SamplingParams(n=1, temperature=max(p.temperature, 0.0), top_p=p.top_p,
                             top_k=p.top_k if p.top_k > 0 else -1, max_tokens=p.max_new_tokens, logprobs=0,
                             stop_token_ids=list(p.stop_token_ids) or [eos], detokenize=False)
    sp.output_kind = RequestOutputKind.FINAL_ONLY
    return sp


def completion(out) -> Completion:
    """A finished vLLM ``RequestOutput`` as a Completion (vLLM's "abort" counts as "length": cut short)."""
    c = out.outputs[0]
    ids = list(c.token_ids)
    return Completion(out.request_id, ids, [d[t].logprob for t, d in zip(ids, c.logprobs)],
                      "stop" if c.finish_reason == "stop" else "length")


def step_llm(llm, vllm, admit: Sequence[Request], abort: Sequence[str], eos: int, lora=None) -> StepResult:
    """Abort, admit, one ``llm_engine.step()``; the finished requests and how many were unfinished before it.
    ``lora``: the current adapter version's LoRARequest (--lora_sync adapter), given to every admitted request
    (vllm/v1/engine/llm_engine.py ``add_request(..., lora_request=)``)."""
    eng = llm.llm_engine
    if abort:
        eng.abort_request(list(abort))
    failed = []
    for r in admit:
        if r.images is not None:  # not built: vLLM's Qwen-VL models need torchvision, absent here (docs: vlmagent)
            failed.append((r.request_id, f"request {r.request_id} has images: agent turns with images run on the HF "
                                         f"engine only (--rollout_engine hf)"))
            continue
        try:
            prompt = llm._preprocess_cmpl_one({"prompt_token_ids": list(r.prompt_ids)})
            eng.add_request(r.request_id, prompt, vllm_params(vllm, r, eos), lora_request=lora)
        except Exception as e:  # noqa: BLE001  vLLM refused this request (VLLMValidationError, ...): it fails alone
            failed.append((r.request_id, f"vLLM refused request {r.request_id}: {e}"))
    running = eng.get_num_unfinished_requests()
    finished = [completion(o) for o in (eng.step() if running else []) if o.finished]
    return StepResult(finished, running, failed)
