"""OpenRLHF's ``llm_engine`` (openrlhf/trainer/ray/vllm_engine_async.py ``generate``, read at OpenRLHF main
2026-08): ``await llm_engine.generate(prompt_token_ids, sampling_params, multi_modal_data=None)`` returns a vLLM
``RequestOutput``-like object (``prompt_token_ids``; ``outputs[0].token_ids / .text / .logprobs`` (a list of
{token id: obj with .logprob}) / ``.finish_reason`` "stop" or "length").

Each call is one request to the engine's continuous batch (``rlhf.agents.scheduler``): it joins the running
requests at the next engine step and returns when it finishes, whatever the other episodes do.  Inside an episode
task (``episode_stats.episode``) the call counts a turn and its wait, and a seeded request gets the episode's own
seed for that turn (``episode_stats.seed_for``)."""
from __future__ import annotations

import time
import types
from dataclasses import dataclass

from rlhf.agents import episode_stats
from rlhf.agents.episode_images import request_images
from rlhf.agents.scheduler import scheduler_for
from rlhf.engines.requests import Completion
from rlhf.engines.rollout import SamplingParams


@dataclass
class _Logprob:
    logprob: float


def to_params(sp, default_max_tokens: int, seed) -> SamplingParams:
    """Our SamplingParams (n=1) from a vLLM-like one (temperature, top_p, top_k, max_tokens, stop_token_ids)."""
    mt = sp.max_tokens if sp.max_tokens is not None else default_max_tokens
    return SamplingParams(n=1, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                          max_new_tokens=max(1, int(mt)), stop_token_ids=tuple(sp.stop_token_ids or ()), seed=seed)


def request_output(prompt_ids, c: Completion, tokenizer, skip_special: bool):
    """A vLLM ``RequestOutput``-like object from a completion."""
    comp = types.SimpleNamespace(token_ids=list(c.token_ids),
                                 text=tokenizer.decode(c.token_ids, skip_special_tokens=skip_special),
                                 logprobs=[{t: _Logprob(lp)} for t, lp in zip(c.token_ids, c.logprobs)],
                                 finish_reason=c.finish_reason)
    return types.SimpleNamespace(prompt_token_ids=list(prompt_ids), outputs=[comp], finished=True)


class AsyncEngine:
    """``await generate(token_ids, sampling_params)``: one request to ``engine``'s continuous batch."""

    def __init__(self, engine, tokenizer, default_max_tokens: int, image_inputs=None):
        self.engine, self.tokenizer, self.default_max_tokens = engine, tokenizer, default_max_tokens
        self.image_inputs = image_inputs  # a VLM's rlhf.data.images.ImageInputs (None: a text-only model)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        """``multi_modal_data={"image": PIL or list}``: the images of the prompt's (expanded) placeholders."""
        images = request_images(self.image_inputs, prompt_token_ids, (multi_modal_data or {}).get("image"))
        ep = episode_stats.current()
        seed = sampling_params.seed
        if ep is not None:
            seed = episode_stats.seed_for(seed, ep.index, ep.turns)
        params = to_params(sampling_params, self.default_max_tokens, seed)
        t0 = time.perf_counter()
        try:
            c = await scheduler_for(self.engine).generate(prompt_token_ids, params, images)
        finally:
            if ep is not None:
                ep.turns += 1
                ep.gen_s += time.perf_counter() - t0
        return request_output(prompt_token_ids, c, self.tokenizer, bool(sampling_params.skip_special_tokens))
