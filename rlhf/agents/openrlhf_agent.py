"""OpenRLHF's agent interface (``openrlhf.utils.agent``), so an OpenRLHF ``agent_func.py`` loads unchanged.

``load_agent`` makes ``import openrlhf.utils.agent`` resolve to this module while the agent file executes
(``openrlhf_names``; nothing is installed and a real ``openrlhf`` is not shadowed afterwards).  The contract
follows OpenRLHF's openrlhf/utils/agent.py and openrlhf/trainer/ray/vllm_engine.py (read at OpenRLHF main,
2026-08, version.txt 0.11.0; the agent interface is unchanged since):

* ``AgentInstanceBase``: ``async reset(states)`` / ``async step(states)``; step returns ``rewards`` (a tensor or
  number), ``scores``, ``environment_feedback``, ``done``, optionally ``sampling_params`` and ``extra_logs``;
* ``AgentExecutorBase``: ``async execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
  images=None)`` returning ``observation_tokens`` (prompt + actions + feedback), ``action_ranges`` ([start, end)
  spans of model tokens in it), ``rollout_log_probs`` (one per observation token, or None), ``reward``,
  ``scores``, optionally ``truncated`` and ``extra_logs``; the file's ``AgentExecutor`` is built with no
  arguments and ``execute`` runs once per sample;
* ``llm_engine``: ``await llm_engine.generate(prompt_token_ids, sampling_params, multi_modal_data=None)`` returns
  a vLLM ``RequestOutput``-like object: ``outputs[0].token_ids / .text / .logprobs`` (a list of {token id: obj
  with .logprob}) / ``.finish_reason`` ("length" or "stop");
* ``MultiTurnAgentExecutor(AgentInstance)``: OpenRLHF's multi-turn loop (the reward is the sum of the step
  rewards; the score the last step's ``scores``); images (a VLM): the prompt's, then each step's
  ``environment_images``, go with every turn and come back as the result's ``images`` (rlhf.agents.episode_images).

``ExecuteAdapter`` runs such an executor under this project's executor contract (``run(prompt_ids, prompts,
labels, params) -> Batch``): every ``execute`` is its own asyncio task and each of its ``generate`` calls one
request to the engine's continuous batch (``rlhf.agents.llm_engine.AsyncEngine``, re-exported here), so no
episode waits for another's turn or environment step.  An ``execute`` that raises ends its episode only (the
prompt, no action, reward NaN: counted in ``agent/episode_errors`` and reward_invalid).
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
import types
from abc import ABC, abstractmethod
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlhf.agents import episode_stats
from rlhf.agents.base import (
    AgentContractError,
    AgentInstanceBase,
    agent_file,
    check_observation,
    check_step_result,
    episode_failed,
    say_once,
)
from rlhf.agents.base import AgentExecutorBase as NativeExecutorBase
from rlhf.agents.episode_images import expand_images, row_tensors
from rlhf.agents.llm_engine import AsyncEngine
from rlhf.agents.scheduler import EngineStepError
from rlhf.data.images import open_images
from rlhf.engines.rollout import Batch, SamplingParams, batch_from_rows

__all__ = ["AgentInstanceBase", "AgentExecutorBase", "MultiTurnAgentExecutor", "ExecuteAdapter", "openrlhf_names",
           "AsyncEngine"]

MODULE = "openrlhf.utils.agent"


class AgentExecutorBase(ABC):
    """OpenRLHF's executor contract: one ``execute`` call per sample (openrlhf/utils/agent.py)."""

    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError("AgentExecutorBase.execute is not implemented")


def _scalar(x) -> float:
    return float(x.item() if hasattr(x, "item") else x)


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's MultiTurnAgentExecutor: reset, then generate / step until done or the budget max_length (prompt
    + response tokens) is spent; reward = sum of the step rewards, scores = the last step's (OpenRLHF: total_reward
    when the step gives none); feedback tokens get log-prob 0 and lie outside ``action_ranges``."""

    def __init__(self, agent_instance_cls):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError("AgentInstance must inherit from AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        images = list(images or [])  # the episode's images so far (PIL): the prompt's, then the environment's
        vis = llm_engine.image_inputs if images else None
        agent = await new_instance(self.agent_instance_cls)
        where = f"{agent_file(self.agent_instance_cls)}: {self.agent_instance_cls.__name__}"
        try:
            observation = check_observation(await agent.reset({"observation": prompt, "label": label}),
                                            f"{where}.reset")
        except AgentContractError as e:
            return self._failed(prompt, label, hf_tokenizer, e, f"{where}.reset", vis, images)
        tokens = expand_images(vis, hf_tokenizer(text=observation, add_special_tokens=False)["input_ids"], images)
        room = max_length - (getattr(sampling_params, "max_tokens", None) or 1)
        if len(tokens) > room and not images:  # OpenRLHF keeps the tail (never cut into images)
            tokens = tokens[-room:]
            observation = hf_tokenizer.decode(tokens, skip_special_tokens=False)
        ranges: List[Tuple[int, int]] = []
        total, scores, logs, truncated = 0.0, None, {}, False
        logprobs = [0.0] * len(tokens) if sampling_params.logprobs is not None else None
        while True:
            sampling_params.max_tokens = max_length - len(tokens)
            if sampling_params.max_tokens <= 0:
                truncated = True
                break
            mm = {"multi_modal_data": {"image": list(images)}} if images else {}
            out = (await llm_engine.generate(tokens, deepcopy(sampling_params), **mm)).outputs[0]
            action = list(out.token_ids)
            ranges.append((len(tokens), len(tokens) + len(action)))
            res = await agent.step({"observation_text": observation, "action_text": out.text, "label": label,
                                    "sampling_params": sampling_params})
            try:
                reward, score, feedback, done = check_step_result(res, f"{where}.step", feedback_required=True)
            except AgentContractError as e:  # the episode so far, its reward NaN: counted as failed
                episode_failed(e, f"{where}.step")
                total = scores = math.nan
                break
            total += reward
            scores = total if score is None else score
            logs = res.get("extra_logs", {})
            new = list(res.get("environment_images") or [])  # OpenRLHF: one placeholder per image in the feedback
            vis = llm_engine.image_inputs if new else vis
            fb = expand_images(vis, hf_tokenizer(text=feedback, add_special_tokens=False)["input_ids"], new)
            images += new
            observation = observation + out.text + feedback
            tokens = tokens + action + fb
            if logprobs is not None:
                logprobs += [lp[t].logprob for t, lp in zip(action, out.logprobs)] + [0.0] * len(fb)
            if res.get("sampling_params"):
                sampling_params = res["sampling_params"]
            if done:
                break
        return {"prompt": prompt, "label": label, "images": images, "reward": total,
                "scores": _scalar(scores if scores is not None else total), "observation_tokens": tokens,
                "action_ranges": ranges, "rollout_log_probs": logprobs, "extra_logs": logs, "truncated": truncated}

    @staticmethod
    def _failed(prompt, label, hf_tokenizer, err: AgentContractError, key: str, vis=None, images=None
                ) -> Dict[str, Any]:
        """A failed episode: the prompt (its images kept), no action, reward NaN (excluded from the loss, counted
        invalid)."""
        episode_failed(err, key)
        tokens = expand_images(vis, hf_tokenizer(text=prompt, add_special_tokens=False)["input_ids"], images)
        return {"prompt": prompt, "label": label, "images": images, "reward": math.nan, "scores": math.nan,
                "observation_tokens": tokens, "action_ranges": [], "rollout_log_probs": None, "extra_logs": {},
                "truncated": False}


async def new_instance(cls):
    """``cls()``; an ``async def __init__`` is awaited, as OpenRLHF ran it when its agent files were written with one
    (examples/python/agent_func_gem_multiturn.py, added at OpenRLHF 0db2677): each AgentInstance was a Ray actor
    (openrlhf/utils/agent.py there: ``ray.remote(agent_instance_cls)``, then ``.remote()``), and Ray runs an async
    actor's methods, ``__init__`` included, as coroutines on the actor's event loop (python/ray/_raylet.pyx
    ``execute_task``: ``if inspect.iscoroutinefunction(function.method): async_function = function``).  OpenRLHF
    since 6298708 calls ``self.agent_instance_cls()``, which raises "__init__() should return None, not
    'coroutine'" for that file."""
    if inspect.iscoroutinefunction(cls.__init__):
        inst = cls.__new__(cls)
        await inst.__init__()
        return inst
    return cls()


MATH_UTILS = "rlhf.compat.openrlhf_math_utils"  # OpenRLHF's openrlhf/utils/math_utils.py, vendored verbatim
SERVED_UTILS = ("extract_boxed_answer", "grade_answer")  # what OpenRLHF's openrlhf/utils/__init__.py exports of it


def _math_utils():
    return importlib.import_module(MATH_UTILS)  # sympy and pylatexenc: imported only when a file asks for them


def _utils_getattr(name: str):
    """``openrlhf.utils``'s names this project serves, imported on first use (PEP 562 module ``__getattr__``)."""
    if name in SERVED_UTILS:
        return getattr(_math_utils(), name)
    if name == "math_utils":
        return _math_utils()
    raise AttributeError(f"module 'openrlhf.utils' has no attribute {name!r}: rlhf serves only "
                         f"openrlhf.utils.agent and openrlhf.utils.{{{', '.join(SERVED_UTILS)}, math_utils}} "
                         f"(install openrlhf to use its other modules)")


def _math_getattr(name: str):
    return getattr(_math_utils(), name)


@contextmanager
def openrlhf_names():
    """While the block runs, ``openrlhf.utils.agent`` is this module, and ``openrlhf.utils``'s math helpers
    (``extract_boxed_answer``, ``grade_answer``, ``openrlhf.utils.math_utils``: OpenRLHF's own code, vendored) are
    importable, as OpenRLHF's examples/python/math_reward_func.py and agent files import them.  Parent packages are
    stubbed only where no real ``openrlhf`` is importable (a real one serves its own math helpers); afterwards
    sys.modules is as before, so other code still gets a real installed openrlhf."""
    me = sys.modules[__name__]
    real = "openrlhf" in sys.modules or importlib.util.find_spec("openrlhf") is not None
    entries: Dict[str, types.ModuleType] = {MODULE: me}
    if not real:
        pkg, utils = types.ModuleType("openrlhf"), types.ModuleType("openrlhf.utils")
        math_utils = types.ModuleType("openrlhf.utils.math_utils")
        pkg.__path__, utils.__path__ = [], []
        pkg.utils, utils.agent = utils, me
        utils.__getattr__, math_utils.__getattr__ = _utils_getattr, _math_getattr
        entries.update({"openrlhf": pkg, "openrlhf.utils": utils, "openrlhf.utils.math_utils": math_utils})
    saved = {k: sys.modules.get(k) for k in entries}
    sys.modules.update(entries)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = old


@dataclass
class OpenRLHFSamplingParams:
    """The vLLM SamplingParams fields OpenRLHF's executors read and set (samples_generator.py builds it with
    logprobs=1 under IS correction; here rollout log-probs are always recorded) and skip_special_tokens=False."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: Optional[int] = None
    min_tokens: int = 1
    skip_special_tokens: bool = False
    logprobs: Optional[int] = 1
    n: int = 1
    seed: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = field(default_factory=tuple)


def result_to_row(res: Dict[str, Any], max_length: int, where: str = "--agent_func_path: AgentExecutor.execute"):
    """(prompt ids, response ids, action mask, log-probs, truncated, reward, score) from one ``execute`` result:
    the prompt is observation_tokens before the first action range; the action mask is 1 inside the ranges."""
    if not isinstance(res, dict):
        raise ValueError(f"{where} returned {type(res).__name__} {str(res)[:120]!r}, not a dict (OpenRLHF's contract: "
                         f"observation_tokens, action_ranges, rollout_log_probs, reward, scores)")
    for k in ("observation_tokens", "action_ranges", "reward"):
        if res.get(k) is None:
            raise ValueError(f"{where} must return {k!r} (OpenRLHF's contract: "
                             f"observation_tokens, action_ranges, rollout_log_probs, reward, scores)")
    obs, ranges = list(res["observation_tokens"]), [tuple(r) for r in res["action_ranges"]]
    start = ranges[0][0] if ranges else len(obs)
    mask = [0] * (len(obs) - start)
    for s, e in ranges:
        for j in range(max(s, start), min(e, len(obs))):
            mask[j - start] = 1
    lps = res.get("rollout_log_probs")
    lps = [0.0] * len(mask) if lps is None else [float(x) * m for x, m in zip(lps[start:], mask)]
    reward = _scalar(res["reward"])
    score = _scalar(res["scores"]) if res.get("scores") is not None else reward
    truncated = bool(res.get("truncated", False)) or len(obs) >= max_length
    return obs[:start], obs[start:], mask, lps, truncated, reward, score


class ExecuteAdapter(NativeExecutorBase):
    """This project's executor contract over an OpenRLHF executor class (built with no arguments, as OpenRLHF
    does): ``execute`` runs once per sample, all samples concurrently; max_length = prompt tokens + this
    executor's response budget."""

    openrlhf_cls: type = None  # set by adapter_for

    def __init__(self, agent_cls, max_steps: int, max_length: int, engine, tokenizer):
        super().__init__(agent_cls, max_steps, max_length, engine, tokenizer)
        self.executor = self.openrlhf_cls()

    async def _run(self, prompt_ids, prompts, labels, params: SamplingParams, images=None) -> Batch:
        eng = AsyncEngine(self.engine, self.tokenizer, params.max_new_tokens, self.image_inputs)
        sp = OpenRLHFSamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                    max_tokens=params.max_new_tokens, seed=params.seed,
                                    stop_token_ids=tuple(params.stop_token_ids))
        jobs, budgets, pics = [], [], []
        for ids, text, lab, im in zip(prompt_ids, prompts, labels, images or [None] * len(prompts)):
            for _ in range(params.n):
                budgets.append(len(ids) + self.max_length)
                pics.append(list(im or []))
                jobs.append(self._episode(len(jobs), list(ids), text, lab, deepcopy(sp), budgets[-1], eng, im))
        where = f"{agent_file(self.openrlhf_cls)}: {self.openrlhf_cls.__name__}.execute"
        results = await self.run_episodes(jobs)
        rows = [result_to_row(r, b, where) for r, b in zip(results, budgets)]
        p, r, am, lp, tr, rw, sc = (list(c) for c in zip(*rows))
        out = batch_from_rows(p, r, lp, tr, self.tokenizer.pad_token_id, action_masks=am, rewards=rw, scores=sc)
        if self.image_inputs is not None:  # each row's episode images (the prompt's, then the environment's)
            per = [row_tensors(self.image_inputs, res.get("images", im) if isinstance(res, dict) else im)
                   for res, im in zip(results, pics)]
            out.pixel_values, out.image_grid_thw = [t[0] for t in per], [t[1] for t in per]
        return out

    def run_items(self, items, params: SamplingParams) -> Batch:
        """``run`` with each prompt's images (PIL, from its files) for ``execute(..., images=...)``."""
        imgs = [open_images(list(p.images[2])) if p.images is not None else None for p in items]
        return asyncio.run(self._run([p.ids for p in items], [p.prompt for p in items], [p.label for p in items],
                                     params, imgs if any(i is not None for i in imgs) else None))

    async def _episode(self, k: int, ids, text, lab, sp, budget: int, eng, images=None):
        """One ``execute`` as episode ``k``; an exception ends this episode only (said once per kind)."""
        with episode_stats.episode(k) as st:
            try:
                res = await self.executor.execute(prompt=text, label=lab, sampling_params=sp, max_length=budget,
                                                  hf_tokenizer=self.tokenizer, llm_engine=eng,
                                                  images=list(images) if images else None)
                st.extra.update(extra_log_values(res, f"{agent_file(self.openrlhf_cls)}: "
                                                      f"{self.openrlhf_cls.__name__}.execute"))
                return res, st
            except EngineStepError:  # the engine itself failed: the run ends (fail-fast), not one episode
                raise
            except Exception as e:  # noqa: BLE001  (the agent file's code: its failure is this episode's)
                st.error = True
                where = f"{agent_file(self.openrlhf_cls)}: {self.openrlhf_cls.__name__}.execute"
                say_once(f"{where}:{type(e).__name__}", f"[agent] {where} raised {type(e).__name__}: {e}. This "
                                                        f"episode is counted as failed (reward NaN); said once, "
                                                        f"later ones are counted only.")
                return {"observation_tokens": ids, "action_ranges": [], "rollout_log_probs": None,
                        "reward": math.nan, "scores": math.nan}, st


def extra_log_values(res, where: str) -> Dict[str, float]:
    """An ``execute`` result's ``extra_logs`` as numbers, logged as ``agent/<key>`` (mean over the step's episodes),
    as OpenRLHF logs every key of a sample's ``extra_logs`` (openrlhf/trainer/ppo_utils/samples_generator.py:
    a tensor gives ``value.flatten()[0].item()``, then ``info[key] = torch.tensor([value])``, averaged into the
    step's logs).  A value that is not a number is said once and left out."""
    logs = res.get("extra_logs") if isinstance(res, dict) else None
    out: Dict[str, float] = {}
    for k, v in (logs.items() if isinstance(logs, dict) else ()):
        try:
            out[str(k)] = float(v.flatten()[0].item() if isinstance(v, torch.Tensor) else v)
        except (TypeError, ValueError, IndexError):
            say_once(f"{where}:extra_logs:{k}", f"[agent] {where} returned extra_logs[{k!r}] = {str(v)[:80]!r}, "
                                                f"not a number: not logged (OpenRLHF logs numbers only)")
    return out


def adapter_for(executor_cls: type) -> type:
    """A subclass of ExecuteAdapter that builds ``executor_cls``."""
    return type(f"{executor_cls.__name__}Adapter", (ExecuteAdapter,), {"openrlhf_cls": executor_cls})


def is_openrlhf_executor(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, AgentExecutorBase)
