"""Asynchronous rollout on rollout ranks of their own: a pool of prompt groups in flight, generated in rounds, with
partial rollout, oversampling, streaming rewards and bounded staleness (issue 29).

One ``RolloutStream`` lives on the first rank of each rollout engine.  ``produce(step, train_at)`` returns the
groups of one train batch (this engine's share of --rollout_batch_size) and keeps everything else for later:

- **Rounds.**  Each round tops the pool up to ``capacity`` groups in flight (--vllm_generate_batch_size prompts
  over the engines: oversampling) and generates for every unfinished sample, ``chunk`` new tokens at most (the
  whole --generate_max_len without --partial_rollout, so every round finishes everything it started, like
  OpenRLHF's generate call).  A sample continues from its own tokens: its prompt plus what it generated so far
  is the next round's prompt, so it can span weight syncs (**partial rollout**).  Every token records the
  weight version that produced it (``versions``: the step whose weights generated it), and its log-prob under
  those weights, so the per-token behaviour log-probs stay exact for IS correction.
- **Rows per call.**  One engine call per round, every row n=1 with the largest remaining budget; a row that
  generated past its own budget is cut there.  Sampling is autoregressive, so the cut row is exactly what a call
  with its own budget would have drawn.
- **Quota.**  Rounds run until ``quota`` complete groups are buffered: a function of the generated tokens, never
  of a clock, so every run with the same seed makes the same batches (SPMD: what is trained is decided from the
  gathered batch, the same on every rank).  Extra complete groups wait in the buffer (OpenRLHF
  ``SamplesGenerator._sample_buffer``, openrlhf/trainer/ppo_utils/samples_generator.py); unfinished ones stay in
  flight (partial rollout) and continue under the next weights.
- **Streaming rewards.**  ``score(groups)`` scores each group the round it completes (the reward function or
  server, on this rank), so reward latency hides behind generation; ``keep(group)`` (dynamic filtering) drops a
  group there and the next round draws a new prompt in its place: filtering costs no extra rounds of the whole
  batch.  A group filtered out is kept as a spare: if ``max_draws`` prompts were drawn for one batch and it is
  still short, spares fill it (they stay masked out of the loss, as the synchronous refill does).
- **Agent episodes** (--agent_func_path).  ``episodes(groups, params)`` runs every group in flight to the end of
  its episodes in one round (the agent's turns and environment steps, the environment's rewards on each group):
  an episode is never cut at a sync, so there is no partial rollout here; oversampling, streamed filtering and
  bounded staleness work as for single-turn samples.  Environment feedback tokens carry action-mask 0 (``mask``).
- **Bounded staleness.**  A batch produced at ``step`` is trained at ``train_at``; a sample's age there is
  ``train_at - versions[0]`` (its oldest token).  A group in flight or buffered that would be older than
  ``max_staleness`` at ``train_at`` is restarted from its prompt (in flight) or dropped (buffered): counted in
  the stats, never trained.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from rlhf.batch import Batch, cat, row_fields
from rlhf.engines.rollout import SamplingParams, batch_from_rows


@dataclass
class Sample:
    tokens: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    mask: Optional[List[int]] = None  # agent episodes: 1 on model tokens, 0 on environment feedback (None: all 1)

    def reset(self) -> None:
        self.tokens, self.logprobs, self.versions, self.done, self.truncated = [], [], [], False, False
        self.mask = None


@dataclass
class Group:
    """One prompt's ``n`` samples; ``index`` is its place in the prompt stream (what every rank maps back to the
    prompt), ``reward`` its rows' reward fields (a ``Batch`` of rewards, scores, valid, extra_logs) once complete."""
    index: int
    prompt_ids: List[int]
    samples: List[Sample]
    reward: Optional[Batch] = None

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    def oldest(self) -> Optional[int]:
        v = [s.versions[0] for s in self.samples if s.versions]
        return min(v) if v else None


@dataclass
class StreamStats:
    rounds: int = 0
    generated_tokens: int = 0
    restarted_groups: int = 0      # in flight, would have been too stale: generated again from the prompt
    dropped_stale_groups: int = 0  # buffered, would have been too stale
    filtered_groups: int = 0       # dropped by dynamic filtering as they completed
    drawn_prompts: int = 0

    def as_metrics(self) -> Dict[str, float]:
        return {f"async/{k}": float(v) for k, v in self.__dict__.items()}


class RolloutStream:
    """The pool of one rollout engine (see the module docstring).  ``draw()`` returns the next (stream index,
    prompt ids) of this engine's prompt stream; ``engine.generate`` follows rlhf.engines.rollout.RolloutEngine."""

    def __init__(self, engine, draw: Callable[[], tuple], *, n: int, capacity: int, quota: int,
                 max_new_tokens: int, chunk: Optional[int], max_staleness: int,
                 score: Optional[Callable[[List[Group]], None]] = None, keep: Optional[Callable[[Group], bool]] = None,
                 max_draws: Optional[int] = None, pad_id: int = 0,
                 episodes: Optional[Callable[[List[Group], SamplingParams], None]] = None):
        if capacity < quota:
            raise ValueError(f"capacity {capacity} groups < quota {quota}: nothing could fill a batch")
        if episodes is not None and (chunk or score is not None):
            raise ValueError("agent episodes run whole and are scored by their environment: no chunk, no score")
        self.engine, self.draw, self.n = engine, draw, n
        self.capacity, self.quota, self.max_new = capacity, quota, max_new_tokens
        self.chunk = max_new_tokens if not chunk else min(chunk, max_new_tokens)
        self.max_staleness, self.score, self.keep = max_staleness, score, keep
        self.max_draws = max_draws if max_draws is not None else 8 * max(quota, 1)
        self.pad_id, self.episodes = pad_id, episodes
        self.max_len = engine.max_model_len  # prompt + response limit of the engine (None: none)
        self.flight: List[Group] = []
        self.buffer: List[Group] = []
        self.spares: List[Group] = []

    # ---- state ---------------------------------------------------------------------------------------------------
    def _left(self, g: Group, s: Sample) -> int:
        """New tokens ``s`` may still take: --generate_max_len, and the engine's context (a continuation prompt is
        prompt + tokens so far; vLLM refuses a prompt of max_model_len tokens and stops a generation there)."""
        left = self.max_new - len(s.tokens)
        return min(left, self.max_len - len(g.prompt_ids) - len(s.tokens)) if self.max_len else left

    def _too_old(self, g: Group, train_at: int) -> bool:
        v = g.oldest()
        return v is not None and train_at - v > self.max_staleness

    def _enforce_staleness(self, train_at: int, stats: StreamStats) -> None:
        for g in self.flight:
            if self._too_old(g, train_at):
                for s in g.samples:
                    s.reset()
                stats.restarted_groups += 1
        keep = [g for g in self.buffer if not self._too_old(g, train_at)]
        stats.dropped_stale_groups += len(self.buffer) - len(keep)
        self.buffer = keep
        self.spares = [g for g in self.spares if not self._too_old(g, train_at)]

    # ---- one round -----------------------------------------------------------------------------------------------
    def _top_up(self, stats: StreamStats, draws: int) -> int:
        while len(self.flight) < self.capacity and draws < self.max_draws:
            index, ids = self.draw()
            self.flight.append(Group(index, list(ids), [Sample() for _ in range(self.n)]))
            stats.drawn_prompts += 1
            draws += 1
        return draws

    def _episode_round(self, version: int, params: SamplingParams, stats: StreamStats) -> None:
        """Agents: every group in flight runs its episodes to the end (``episodes``), with the weights of
        ``version``; the environment sets each group's reward."""
        self.episodes(self.flight, params)
        for g in self.flight:
            if g.reward is None:
                raise RuntimeError(f"the agent's episodes of prompt {g.index} came back without rewards")
            for s in g.samples:
                s.versions, s.done = [version] * len(s.tokens), True
                stats.generated_tokens += sum(s.mask) if s.mask is not None else len(s.tokens)

    def _round(self, version: int, params: SamplingParams, stats: StreamStats) -> None:
        if self.episodes is not None:
            self._episode_round(version, params, stats)
        else:
            self._sample_round(version, params, stats)
        stats.rounds += 1
        done = [g for g in self.flight if g.complete]
        self.flight = [g for g in self.flight if not g.complete]
        if done and self.score is not None:
            self.score(done)
        for g in done:
            if self.keep is None or self.keep(g):
                self.buffer.append(g)
            else:
                self.spares.append(g)
                stats.filtered_groups += 1

    def _sample_round(self, version: int, params: SamplingParams, stats: StreamStats) -> None:
        rows = [(g, s) for g in self.flight for s in g.samples if not s.done]
        budget = [self._left(g, s) for g, s in rows]
        call = SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                              max_new_tokens=min(self.chunk, max(budget)), stop_token_ids=params.stop_token_ids,
                              seed=params.seed)
        out: Batch = self.engine.generate([g.prompt_ids + s.tokens for g, s in rows], call)
        P = out.prompt_len
        for i, ((g, s), left) in enumerate(zip(rows, budget)):
            k = int(out.action_mask[i].sum())
            toks = out.sequences[i, P:P + k].tolist()
            lps = out.rollout_logprobs[i, :k].tolist()
            stopped = not bool(out.truncated[i])
            if k > left:  # generated past its own budget: cut where a call with that budget would have stopped
                toks, lps, stopped = toks[:left], lps[:left], False
            s.tokens += toks
            s.logprobs += lps
            s.versions += [version] * len(toks)
            stats.generated_tokens += len(toks)
            if stopped or self._left(g, s) <= 0:
                s.done, s.truncated = True, not stopped

    # ---- one batch -----------------------------------------------------------------------------------------------
    def produce(self, version: int, train_at: int, params: SamplingParams,
                round_params: Optional[Callable[[int], SamplingParams]] = None) -> tuple:
        """(groups, stats): ``quota`` complete groups for the batch trained at ``train_at``, generated with the
        weights of ``version`` (this step's) where new tokens were needed.  ``round_params(r)`` gives round r its
        own sampling seed (default: ``params`` for every round)."""
        stats = StreamStats()
        self._enforce_staleness(train_at, stats)
        draws = 0
        while len(self.buffer) < self.quota:
            draws = self._top_up(stats, draws)
            if not self.flight:  # --max_draws reached for this batch: spares (masked in the loss) fill it
                short = self.quota - len(self.buffer)
                self.buffer += self.spares[:short]
                self.spares = self.spares[short:]
                if len(self.buffer) < self.quota:
                    raise RuntimeError(f"the rollout stream drew {draws} prompts for one batch and completed only "
                                       f"{len(self.buffer)} of {self.quota} groups")
                break
            self._round(version, round_params(stats.rounds) if round_params else params, stats)
        take, self.buffer = self.buffer[:self.quota], self.buffer[self.quota:]
        return take, stats


def groups_to_batch(groups: Sequence[Group], pad_id: int) -> Batch:
    """The padded batch of these groups' samples (prompt-major rows), with ``versions`` (B, R) (-1 on padding) and
    the streamed rewards when every group carries them."""
    rows = [(g, s) for g in groups for s in g.samples]
    masks = None
    if any(s.mask is not None for _, s in rows):  # agent episodes: environment tokens are not actions
        masks = [s.mask if s.mask is not None else [1] * len(s.tokens) for _, s in rows]
    b = batch_from_rows([g.prompt_ids for g, _ in rows], [s.tokens for _, s in rows],
                        [s.logprobs for _, s in rows], [s.truncated for _, s in rows], pad_id, action_masks=masks)
    v = torch.full((len(rows), b.num_actions), -1, dtype=torch.long)
    for i, (_, s) in enumerate(rows):
        if s.versions:
            v[i, :len(s.versions)] = torch.tensor(s.versions, dtype=torch.long)
    b.versions = v
    b.group_index = torch.tensor([g.index for g, _ in rows], dtype=torch.long)
    if groups and all(g.reward is not None for g in groups):
        rewards = cat([g.reward for g in groups], pad_id)
        for name in row_fields("reward"):
            setattr(b, name, getattr(rewards, name))
    return b


def sample_ages(versions: torch.Tensor, action_mask: torch.Tensor, step: int) -> torch.Tensor:
    """(B,) age of each sample at training step ``step``: step - version of its oldest token (0 for an empty
    response)."""
    big = torch.iinfo(torch.long).max
    v = torch.where(action_mask.bool() & (versions >= 0), versions, torch.full_like(versions, big))
    oldest = v.min(1).values
    return torch.where(oldest == big, torch.zeros_like(oldest), step - oldest)


def age_metrics(versions: torch.Tensor, action_mask: torch.Tensor, step: int) -> Dict[str, float]:
    """How far off-policy the trained batch is: mean / max sample age (oldest token), the mean token age, and the
    fraction of samples whose tokens came from more than one weight version (partial rollouts)."""
    m = action_mask.bool() & (versions >= 0)
    ages = sample_ages(versions, action_mask, step).float()
    tok_age = (step - versions)[m].float()
    vmax = torch.where(m, versions, torch.full_like(versions, -1)).max(1).values
    vmin = torch.where(m, versions, torch.full_like(versions, torch.iinfo(torch.long).max)).min(1).values
    spans = (m.any(1) & (vmax != vmin)).float()
    return {"async/age_mean": float(ages.mean()) if ages.numel() else 0.0,
            "async/age_max": float(ages.max()) if ages.numel() else 0.0,
            "async/token_age_mean": float(tok_age.mean()) if tok_age.numel() else 0.0,
            "async/partial_frac": float(spans.mean()) if spans.numel() else 0.0}
