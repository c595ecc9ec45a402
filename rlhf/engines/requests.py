"""One generation request and its completion: the per-request side of the rollout-engine contract
(``RolloutEngine.step_requests``), as vLLM's V1 engine takes them (vllm/v1/engine/llm_engine.py ``add_request`` /
``step``: a request joins the running batch when added and leaves when it finishes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

from rlhf.batch import Batch

SamplingParams = Any  # rlhf.engines.rollout.SamplingParams (not imported: rollout's default step uses this module)


@dataclass
class Request:
    """One sequence to continue: ``params.n`` must be 1 (an episode asks for one continuation per turn); the
    request's ``params.seed`` seeds its own sampler (vLLM's per-request seed), so its tokens do not depend on
    which other requests share its steps."""
    request_id: str
    prompt_ids: List[int]
    params: SamplingParams
    images: Any = None  # a VLM prompt's (pixel_values, image_grid_thw): its placeholders are already expanded

    def __post_init__(self):
        if self.params.n != 1:
            raise ValueError(f"request {self.request_id}: a per-request generate takes n=1 (got n={self.params.n}); "
                             f"submit n requests instead")
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: an empty prompt (give at least one token id)")


@dataclass
class Completion:
    """A finished request: its new token ids, their log-probs under the sampling distribution, and why it ended
    (``stop``: a stop token, kept as the last token; ``length``: its max_new_tokens or the engine's max_model_len)."""
    request_id: str
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: str


@dataclass
class StepResult:
    """One engine step: the requests that finished in it, how many requests it ran (its occupancy) and the
    admitted requests the engine refused, (request id, why): each fails alone."""
    finished: List[Completion] = field(default_factory=list)
    running: int = 0
    failed: List[Tuple[str, str]] = field(default_factory=list)


def setting(p: SamplingParams) -> Tuple:
    """The sampling setting a batched ``generate`` call shares (everything but n)."""
    return (p.temperature, p.top_p, p.top_k, p.max_new_tokens, tuple(p.stop_token_ids), p.seed)


def completions_from_batch(requests: Sequence[Request], out: Batch) -> List[Completion]:
    """Row i of a ``generate`` Batch as request i's completion (its action-masked tokens and log-probs)."""
    done = []
    for i, r in enumerate(requests):
        m = out.action_mask[i].bool()
        trunc = out.truncated is not None and bool(out.truncated[i])
        done.append(Completion(r.request_id, out.sequences[i, out.prompt_len:][m].tolist(),
                               out.rollout_logprobs[i][m].tolist(), "length" if trunc else "stop"))
    return done


def run_whole(engine, requests: Sequence[Request]) -> StepResult:
    """The requests run to their end now, through ``engine.generate`` (one call per sampling setting): the step of
    an engine without a running batch (``RolloutEngine.step_requests``'s default)."""
    groups: Dict[Tuple, List[Request]] = {}
    for r in requests:
        groups.setdefault(setting(r.params), []).append(r)
    done: List[Completion] = []
    for reqs in groups.values():
        imgs = [r.images for r in reqs]  # passed only when some request has images (RolloutEngine.generate)
        out = engine.generate([r.prompt_ids for r in reqs], reqs[0].params,
                              **({"images": imgs} if any(i is not None for i in imgs) else {}))
        if out is None:
            raise RuntimeError("the rollout engine returned no rows on this rank (a non-first TP rank of a vLLM "
                               "engine): run the agent through RolloutRole.generate")
        done += completions_from_batch(reqs, out)
    return StepResult(done, len(requests))
