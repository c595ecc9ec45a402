"""The two ways an OpenAI-client agent trains here, both as OpenRLHF executors (so ``ExecuteAdapter`` runs them
like any ``--agent_func_path`` file, and both give the Batch the executors give):

* a native file that defines only ``async def run_agent(client, prompt, label, **kw) -> {"reward": ...}``:
  ``run_agent_executor`` wraps it in an executor whose ``execute`` opens a session on this process's endpoint, binds
  an ``openai.AsyncOpenAI`` client to it (``X-Session-Id`` header), awaits ``run_agent`` and returns the session
  stitched into one sample with the reward it returned;
* OpenRLHF's examples/python/agent_func_openai_server_executor.py, unchanged: it runs its own uvicorn server on a
  thread of its own and awaits ``llm_engine.generate`` there, and its ``execute`` takes no ``images``;
  ``thread_safe_executor`` gives it an llm_engine that runs each call on the engine's loop (``LoopBridge``) and
  calls its ``execute`` without ``images``.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import threading
import traceback
from typing import Any, Callable, Dict, Optional

from rlhf.agents import episode_stats
from rlhf.agents.base import AgentContractError, _number, agent_file, episode_failed, say_once
from rlhf.agents.endpoint.hub import LoopBridge, Settings
from rlhf.agents.endpoint.protocol import SESSION_HEADER
from rlhf.agents.endpoint.sessions import stitched
from rlhf.agents.openrlhf_agent import AgentExecutorBase, adapter_for

RUN_AGENT = ("run_agent's contract: `async def run_agent(client, prompt, label, **kw)` returning a dict "
             "{'reward': a number (None: --remote_rm_url scores the episode), optional 'scores': a number, optional "
             "'extra_logs': dict}; `client` is an "
             "openai.AsyncOpenAI bound to this episode's session; kw: model, session_id, max_tokens (per call), "
             "max_length (the episode's token budget)")


def check_run_agent(fn, path: str) -> None:
    """Refused at load (before any process group): run_agent must be ``async def`` taking client, prompt, label."""
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{path}: run_agent must be `async def run_agent(client, prompt, label, **kw)` (got "
                         f"{type(fn).__name__} {getattr(fn, '__name__', fn)!r}, not a coroutine function)")
    try:
        inspect.signature(fn).bind(None, "", None, model="", session_id="", max_tokens=1, max_length=1)
    except TypeError as e:
        raise ValueError(f"{path}: run_agent cannot take (client, prompt, label, model=..., session_id=..., "
                         f"max_tokens=..., max_length=...): {e}. {RUN_AGENT}") from None


def _reward(res, where: str):
    if not isinstance(res, dict):
        raise AgentContractError(f"{where} returned {type(res).__name__} {str(res)[:120]!r}, not a dict. {RUN_AGENT}",
                                 "result", res)
    reward = _number(res.get("reward"))
    if reward is None:
        raise AgentContractError(f"{where} returned 'reward' = {res.get('reward')!r}; expected a number. "
                                 f"{RUN_AGENT}", "reward", res.get("reward"))
    score = _number(res["scores"]) if res.get("scores") is not None else reward
    if score is None:
        raise AgentContractError(f"{where} returned 'scores' = {res['scores']!r}; expected a number or none. "
                                 f"{RUN_AGENT}", "scores", res["scores"])
    return reward, score


class EndpointExecutor(AgentExecutorBase):
    """OpenRLHF's executor contract over a native ``run_agent`` (set by ``run_agent_executor``)."""

    run_agent: Callable = None
    source: str = "<agent file>"
    settings: Settings = Settings()

    def __init__(self):
        self.slot = f"engine-{id(self):x}"  # this executor's engine (one per rollout engine of the process)

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        from openai import AsyncOpenAI

        from rlhf.agents.endpoint.server import endpoint

        if images:
            raise ValueError("--agent_func_path: image observations are not supported here (text agents only)")
        hub, server = endpoint(hf_tokenizer, self.settings)
        hub.attach(self.slot, llm_engine, asyncio.get_running_loop())
        s = hub.open_session(self.slot, max_length, sampling_params, tool_call_parser=self.settings.tool_call_parser)
        # max_retries=0: OpenAI's client retries 409 / 5xx, which would replay a refused call into the session
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0,
                             default_headers={SESSION_HEADER: s.id})
        where = f"{self.source}: run_agent"
        reward = score = math.nan
        logs: Dict[str, Any] = {}
        by_source = False  # reward None: the job's reward function scores the stitched sample
        try:
            res = await type(self).run_agent(client, prompt, label, model=hub.model_name, session_id=s.id,
                                             max_tokens=sampling_params.max_tokens, max_length=max_length)
            by_source = isinstance(res, dict) and res.get("reward") is None and self.settings.score is not None
            if not by_source:
                reward, score = _reward(res, where)
            logs = res.get("extra_logs") or {}
        except AgentContractError as e:
            episode_failed(e, where)
            hub.table.count(failed_episodes=1)
        except Exception as e:  # the agent's own error: this episode fails, the others run on
            hub.table.count(failed_episodes=1)
            say_once(f"{where}:{type(e).__name__}", f"[agent] {where} raised {type(e).__name__}: {e} (session "
                     f"{s.id}); this episode is counted as failed (reward NaN: out of the loss, counted in "
                     f"reward_invalid). Said once per kind:\n{traceback.format_exc(limit=4)}")
        finally:
            hub.finish(s.id)
            await client.close()
            count_turns(s)
        out = self.sample(s, prompt, label, hf_tokenizer, reward, score, logs)
        if by_source and s.turns:
            out = score_missing({**out, "reward": None}, label, hf_tokenizer, self.settings.score, where)
        return out

    @staticmethod
    def sample(s, prompt, label, tokenizer, reward: float, score: float, logs) -> Dict[str, Any]:
        """OpenRLHF's execute result from a finished session; a session without a model call: the prompt alone,
        reward NaN (an episode that produced nothing to train on is counted failed)."""
        out = stitched(s)
        if not s.turns:
            say_once("endpoint:nocall", f"[agent] session {s.id}: run_agent made no model call; the episode is "
                                        f"counted as failed (reward NaN). Said once")
            out["observation_tokens"] = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            out["rollout_log_probs"], reward = None, math.nan
        return {"prompt": prompt, "label": label, "images": None, "reward": reward,
                "scores": reward if math.isnan(reward) else score, "extra_logs": logs, **out}


def count_turns(s) -> None:
    """The session's calls into its episode's stats (agent/turns_*, agent/gen_s): the calls ran on the server's
    thread, outside the episode task whose context holds them (``episode_stats.current()``)."""
    ep = episode_stats.current()
    if ep is not None:
        ep.turns, ep.gen_s = len(s.turns), s.gen_s


def run_agent_executor(fn, path: str, settings: Optional[Settings] = None) -> type:
    """An EndpointExecutor class running ``fn`` (checked here, at load)."""
    check_run_agent(fn, path)
    return type("RunAgentExecutor", (EndpointExecutor,),
                {"run_agent": staticmethod(fn), "source": path, "settings": settings or Settings()})


def run_agent_adapter(fn, path: str, settings: Optional[Settings] = None) -> type:
    """The executor (this project's contract, ``ExecuteAdapter``) of a run_agent file; its ``take_metrics()`` gives
    the endpoint's ``endpoint/*`` metrics of the episodes since the last call (requests per session, stitched
    sample lengths, drift repairs, 4xx, failed episodes)."""
    from rlhf.agents.endpoint.server import take_metrics

    base = adapter_for(run_agent_executor(fn, path, settings))
    return type(base.__name__, (base,), {"take_metrics": lambda self: {**base.take_metrics(self), **take_metrics()}})


def takes_images(cls) -> bool:
    params = inspect.signature(cls.execute).parameters.values()
    return any(p.name == "images" or p.kind is p.VAR_KEYWORD for p in params)


def score_missing(res, label, tokenizer, score: Optional[Callable], where: str):
    """An execute result with no reward (OpenRLHF's openai-server executor returns ``reward: None`` unless its
    run_agent gives one): OpenRLHF then scores the sample with the job's reward model / function
    (openrlhf/trainer/ppo_utils/experience_maker.py: ``rewards is None`` -> the reward model group).  Here the job's
    reward function (--remote_rm_url, or builtin:arithmetic) scores it: query = the whole observation text, as
    OpenRLHF decodes the sequence; else the result is left as it is (result_to_row names the missing reward)."""
    if not isinstance(res, dict) or res.get("reward") is not None or not res.get("observation_tokens"):
        return res
    if score is None:
        raise ValueError(f"{where} returned no reward (reward None): OpenRLHF scores such samples with the job's "
                         f"reward model; here give a reward function to score them: --remote_rm_url "
                         f"reward_func.py (or an http URL, or builtin:arithmetic)")
    obs, ranges = list(res["observation_tokens"]), list(res.get("action_ranges") or [])
    start = ranges[0][0] if ranges else len(obs)
    prompt = tokenizer.decode(obs[:start], skip_special_tokens=False)
    out = score([prompt + tokenizer.decode(obs[start:], skip_special_tokens=True)], [prompt], [label])
    reward = float(out["rewards"][0])
    scores = out.get("scores")
    return {**res, "reward": reward, "scores": float(scores[0]) if scores is not None else reward}


_HOME: Optional[asyncio.AbstractEventLoop] = None
_HOME_LOCK = threading.Lock()


def home_loop() -> asyncio.AbstractEventLoop:
    """A loop that lives as long as the process (a daemon thread), for executors that keep loop-bound state across
    rollout steps: OpenRLHF's openai-server executor builds its ``AsyncOpenAI`` client once, in its first
    ``execute``, as on OpenRLHF's vLLM actor, whose loop never ends; each rollout step here runs on a fresh loop."""
    global _HOME
    with _HOME_LOCK:
        if _HOME is None:
            _HOME = asyncio.new_event_loop()
            threading.Thread(target=_HOME.run_forever, daemon=True, name="rlhf-agent-executor-loop").start()
        return _HOME


def thread_safe_executor(cls: type, settings: Optional[Settings] = None) -> type:
    """``cls`` if its ``execute`` takes ``images`` (OpenRLHF's contract); else (OpenRLHF's openai-server executor,
    whose ``execute`` has no ``images``, whose server awaits ``llm_engine.generate`` on a thread of its own, and
    whose client lives as long as the executor) a subclass of the same name whose ``execute`` runs the original
    without ``images`` on ``home_loop()``, hands it an llm_engine bound to the engine's loop (one ``LoopBridge``
    per executor, re-bound at every episode: the file keeps the first llm_engine it gets for the life of its
    server) and scores a result without a reward with ``settings.score`` (``score_missing``)."""
    if takes_images(cls):
        return cls
    score = settings.score if settings is not None else None

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        if images:
            raise ValueError("--agent_func_path: image observations are not supported here (text agents only)")
        bridge = self.__dict__.setdefault("_rlhf_llm_engine", LoopBridge())
        bridge.bind(llm_engine, asyncio.get_running_loop())
        run = cls.execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, bridge)
        res = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run, home_loop()))
        return score_missing(res, label, hf_tokenizer, score, f"{agent_file(cls)}: {cls.__name__}.execute")

    return type(cls.__name__, (cls,), {"execute": execute, "__module__": cls.__module__, "__doc__": cls.__doc__,
                                       "__wrapped__": cls})
