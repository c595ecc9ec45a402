"""Rollout-engine contract: prompts in, padded sequences + masks + sampling log-probs out."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import List, Optional, Sequence, Set, Tuple

import torch

from rlhf.batch import Batch


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: Tuple[int, ...] = ()
    seed: Optional[int] = None


class RolloutEngine(abc.ABC):
    """Everything the trainer asks of a rollout engine; nothing else is probed.  An abstract base: an engine missing
    an abstract method fails when it is built.  The other members have a documented default that means "not
    supported" (an engine that overrides nothing generates, loads weights in its trainer process, has no partial
    memory states, serves no TP peers and has no context limit).

    veRL's contract is the model (verl/workers/rollout/base.py ``BaseRollout``: ``resume(tags)`` /
    ``update_weights`` / ``release``, read at volcengine/verl b178a3c): ``wake(tags)`` is its ``resume(tags)``,
    ``sleep`` its ``release``, ``load_weights`` + ``reset_prefix_cache`` its ``update_weights``.  Engines come from
    ``rlhf.engines.rollout_registry`` (veRL's ``_ROLLOUT_REGISTRY``).

    Memory states (``memory_state``): ``full`` (ready to generate), ``weights`` (weights only: a weight sync may
    load), ``asleep`` (woken before its next use).  The phase scheduler keeps no copy: it asks the role, which asks
    its engine (rlhf.distributed.phases)."""

    # the longest sequence (prompt + response tokens) the engine takes; None: no limit but --generate_max_len
    max_model_len: Optional[int] = None

    # ---- generation ----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams,
                 images: Optional[list] = None) -> Optional[Batch]:
        """params.n samples per prompt, rows prompt-major; None on a rank that reports no rows (non-first TP rank
        of an engine in its own processes).  ``images``: a vision-language model's prompts' (pixel_values,
        image_grid_thw) (None for a prompt without), passed only when some prompt has images (rlhf.data.images;
        its placeholder tokens are already expanded in the prompt ids)."""

    def step_requests(self, admit, abort=()):
        """Per-request generation (continuous batching; ``rlhf.agents.scheduler`` drives it): admit ``admit``
        (``rlhf.engines.requests.Request``, n=1 each: they join the running batch), drop the running requests
        named in ``abort``, run one engine step over the running requests and return a ``StepResult`` (the
        requests that finished in it, how many ran).  A request's tokens and log-probs are those a ``generate``
        of it alone gives (its own seed).  Colocated TP > 1: every TP rank must see the same admit / abort lists in
        the same order; the first rank's scheduler decides and the engine broadcasts them to the ranks in
        ``serve``.  Default (an engine without a running batch): the admitted requests run to their end now
        through ``generate``, one call per sampling setting (``requests.run_whole``)."""
        from rlhf.engines.requests import run_whole

        return run_whole(self, admit)

    def serve(self) -> None:
        """On a non-first TP rank while the first rank runs an agent (a data-dependent number of generate or
        step_requests calls): take part in each of its calls until it calls ``end_requests``.  Default: return at once (the engine's
        other ranks have nothing to do)."""

    def end_requests(self) -> None:
        """On the first TP rank, after its agent: release the ranks in ``serve``.  Default: nothing to release."""

    def record_routing(self) -> bool:
        """From now on every generated batch carries ``routed_experts`` (Batch: the MoE experts each token went to,
        --router_replay R3).  Default: False, this engine cannot."""
        return False

    def set_experts_implementation(self, implementation: str) -> None:
        """--experts_implementation for the engine's own copy of an MoE policy (transformers' expert kernels:
        eager | batched_mm | grouped_mm; ``auto`` keeps the model's).  Default: nothing (vLLM runs its own fused MoE)."""

    # ---- weights -------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def load_weights(self, named_tensors) -> None:
        """Load (engine name, full tensor) pairs, one bucket at a time."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """After the last bucket: cached prompts' KV came from the old weights."""

    @property
    def needs_weights(self) -> bool:
        """Built without real weights (vLLM's dummy start): the trainer syncs before the first generate.
        Default: False (the engine read the checkpoint)."""
        return False

    @property
    def tied_weights_apart(self) -> bool:
        """Does a tied weight (``lm_head.weight`` = ``embed_tokens.weight``) have to arrive under each of its names
        (``rlhf.distributed.weight_sync._export``)?  Default: False, the first name sets both."""
        return False

    def shared_weight_names(self) -> Set[str]:
        """The names under which this engine's model holds a weight it also holds under another name (tied): when
        the sync sends every name for another engine, this one skips these.  Default: none."""
        return set()

    @property
    def direct_weights(self) -> bool:
        """Do the engine's own workers receive the weights over a weight-transfer group
        (``rlhf.distributed.transport``), instead of ``load_weights`` in this process?  Default: False."""
        return False

    def weight_workers(self) -> int:
        """Ranks this trainer rank speaks for in the weight-transfer group (``direct_weights``).  Default: 0."""
        return 0

    def join_weight_group(self, host: str, port: int, rank_offset: int, world: int, backend: str,
                          timeout_s: float) -> List[int]:
        """Make the engine's workers join the weight-transfer group at ``rank_offset``; only where
        ``direct_weights``."""
        raise NotImplementedError(f"{type(self).__name__} loads weights in this process (direct_weights is False)")

    def receive_weights(self, pieces) -> int:
        """One weight sync received by the engine's workers (``transport.Piece`` list); only where
        ``direct_weights``."""
        raise NotImplementedError(f"{type(self).__name__} loads weights in this process (direct_weights is False)")

    @property
    def lora_adapters(self) -> bool:
        """Does the engine run a LoRA adapter unmerged (``--lora_sync adapter``: the base once, then ``load_adapter``
        per sync; ``rlhf.distributed.lora_sync``)?  Default: False, the sync sends merged weights."""
        return False

    def load_adapter(self, version: int, named_tensors, config: dict, keep: int = 1) -> None:
        """Adapter version ``version`` (peft's saved names -> full A / B tensors; ``config`` peft's LoRA config as
        JSON): generate with it from now on, keep the newest ``keep`` versions.  Only where ``lora_adapters``."""
        raise NotImplementedError(f"{type(self).__name__} takes merged weights only (lora_adapters is False)")

    def receive_adapter(self, version: int, pieces, config: dict, keep: int = 1) -> None:
        """``load_adapter`` with the tensors received by the engine's own workers (``direct_weights``)."""
        raise NotImplementedError(f"{type(self).__name__} loads weights in this process (direct_weights is False)")

    # ---- memory --------------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def sleep(self) -> None:
        """Release device memory until wake (where the platform cannot, ``memory_state`` still says asleep)."""

    @abc.abstractmethod
    def wake(self, tags=None) -> None:
        """Bring back weights (tags ["weights"]) or everything (None)."""

    @abc.abstractmethod
    def memory_state(self) -> str:
        """``full`` | ``weights`` | ``asleep``."""

    def sync_follows(self) -> None:
        """A weight sync comes before the next generate: the next sleep may discard the weights.  Default: ignored
        (an engine that keeps its weights when it sleeps)."""

    def close(self) -> None:
        """Stop processes the engine started (default: none)."""


def response_mask(responses: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """1 up to and including the first stop token of each row, 0 after it."""
    is_stop = torch.zeros_like(responses, dtype=torch.bool)
    for s in stop_ids:
        is_stop |= responses == s
    after = (is_stop.long().cumsum(1) - is_stop.long()) > 0
    return (~after).long()


def batch_from_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], logprobs, truncated,
                    pad_id: int, action_masks=None, rewards=None, scores=None) -> Batch:
    """The padded layout from per-row token lists: prompts left-padded to the longest, responses right-padded
    (at least one slot).  ``action_masks`` defaults to 1 on every response token (agents pass theirs: only
    model tokens are actions); ``logprobs`` are per response token."""
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    B = len(prompts)
    seq = torch.full((B, P + R), pad_id, dtype=torch.long)
    att = torch.zeros((B, P + R), dtype=torch.long)
    am = torch.zeros((B, R), dtype=torch.long)
    lp = torch.zeros((B, R), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq[i, P - len(p):P] = torch.tensor(list(p), dtype=torch.long)
        att[i, P - len(p):P] = 1
        n = len(r)
        if n:
            seq[i, P:P + n] = torch.tensor(list(r), dtype=torch.long)
            att[i, P:P + n] = 1
            am[i, :n] = 1 if action_masks is None else torch.tensor(list(action_masks[i]), dtype=torch.long)
            lp[i, :n] = torch.tensor(list(logprobs[i]), dtype=torch.float32)
    as_t = lambda x, dt: None if x is None else torch.tensor(list(x), dtype=dt)  # noqa: E731
    return Batch(sequences=seq, attention_mask=att, action_mask=am, rollout_logprobs=lp, prompt_len=P,
                 truncated=as_t(truncated, torch.bool), rewards=as_t(rewards, torch.float32),
                 scores=as_t(scores, torch.float32))
