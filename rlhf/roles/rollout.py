"""The rollout role: the engines of the placement's rollout ranks, prompts split over engines, every TP rank of an
engine given the same prompts, and the rows gathered to every rank."""
from __future__ import annotations

from typing import Optional

from rlhf.batch import Batch, row_fields
from rlhf.distributed import RoleMesh
from rlhf.distributed.batch_gather import gather_batch
from rlhf.distributed.sharding import shard_rows
from rlhf.engines.rollout import SamplingParams
from rlhf.roles.base import Role


class RolloutRole(Role):
    """The rollout engines: ``engine_ranks`` lists each engine's TP ranks; prompts are split over engines, every
    TP rank of an engine gets the same prompts, and the engine's first rank reports its rows."""

    def __init__(self, name: str, mesh: RoleMesh):
        super().__init__(name, mesh)
        self.engine_ranks = mesh.ranks_along("tp")
        self.agent = None  # AgentExecutor driving the engine (--agent_func_path)
        self.routes = False  # its batches carry routed_experts (--router_replay R3; build_roles)

    @property
    def engine_index(self) -> Optional[int]:
        for i, e in enumerate(self.engine_ranks):
            if self.rank in e:
                return i
        return None

    def sync_follows(self) -> None:
        """A weight sync comes before the next generate: the engine's next sleep may discard its weights."""
        if self.engine is not None:
            self.engine.sync_follows()

    def prompt_rows(self, n_prompts: int, engine: int) -> slice:
        return shard_rows(n_prompts, engine, len(self.engine_ranks))

    def generate(self, prompts, params: SamplingParams) -> Optional[Batch]:
        """This rank's engine generates for its engine's prompts (no world collective: the rollout ranks may
        run this while other roles train).  Returns the rows on the engine's first rank, else None."""
        e = self.engine_index
        if e is None:
            return None
        mine = prompts[self.prompt_rows(len(prompts), e)]
        if not mine:  # fewer prompts than engines: this engine idles (all its TP ranks alike)
            return None
        first = self.engine_ranks[e][0] == self.rank
        if self.agent is not None:
            return self.run_agent(mine, params, first)
        imgs = [p.images for p in mine]  # a vision-language prompt's (pixel_values, image_grid_thw), else None
        batch = self.engine.generate([p.ids for p in mine], params, **({"images": imgs} if any(imgs) else {}))
        return batch if first else None

    def run_agent(self, mine, params: SamplingParams, first: bool) -> Optional[Batch]:
        """The agent runs on the engine's first rank only (its environment steps once per episode); the engine's
        other TP ranks take part in each of its generate calls (colocated: vLLM's TP ranks run in lock-step) or,
        with vLLM in its own processes, have nothing to do."""
        if not first:
            self.engine.serve()
            return None
        try:
            return self.agent.run_items(mine, params)
        finally:
            self.engine.end_requests()

    def take_agent_metrics(self) -> dict:
        """The agent's metrics (``tool/*``) of the episodes it ran since the last call: on an engine's first rank
        with an agent; {} elsewhere (the step's metrics are means over the ranks that report them)."""
        return self.agent.take_metrics() if self.agent is not None else {}

    def gather(self, local: Optional[Batch], n_prompts: int, n_samples: int, pad_id: int,
               with_rewards: bool = False, with_images: bool = False) -> Batch:
        """The full batch on every rank, re-padded to a common prompt and response width (``gather_batch``: one
        max of the widths, one gather of the int fields, one of the float fields; every rank, whatever it holds).
        ``with_rewards``: the rows carry the environment's rewards and scores (agents)."""
        owned: Optional[slice] = None
        e = self.engine_index
        if local is not None:
            pr = self.prompt_rows(n_prompts, e)
            owned = slice(pr.start * n_samples, pr.stop * n_samples)
            assert local.sequences.size(0) == owned.stop - owned.start, \
                f"engine {e} returned {local.sequences.size(0)} rows for {owned.stop - owned.start}"
        names = row_fields("rollout", "routing" if self.routes else None) + (
            ["rewards", "scores"] if with_rewards else []) + (["pixel_values", "image_grid_thw"] if with_images else [])
        return gather_batch(local, owned, n_prompts * n_samples, names, pad_id)
