"""Loading a user's ``--agent_func_path`` file: its ``AgentInstance`` / ``AgentExecutor``, native or OpenRLHF's,
checked before training starts.  Apart from base.py so the native contract (base.py) and OpenRLHF's
(openrlhf_agent.py, built on base.py) import in one direction: load -> openrlhf_agent -> base."""
from __future__ import annotations

import importlib.util
import inspect
import os

from rlhf.agents import openrlhf_agent as orl
from rlhf.agents.base import AgentExecutorBase, AgentInstanceBase


def load_agent(path: str, endpoint=None):
    """(AgentInstance class, AgentExecutor class) from a user file, checked before training starts.

    A file that defines ``async def run_agent(client, prompt, label, **kw)`` and no AgentInstance / AgentExecutor
    trains through this process's OpenAI-compatible endpoint (rlhf.agents.endpoint; ``endpoint``: its Settings).

    An OpenRLHF agent file loads unchanged: while it executes, ``openrlhf.utils.agent`` resolves to
    rlhf.agents.openrlhf_agent (import time only; see ``openrlhf_names``).  Its ``AgentExecutor`` -- a subclass of
    OpenRLHF's AgentExecutorBase / MultiTurnAgentExecutor implementing ``execute(...)`` -- is run through
    ``ExecuteAdapter``; OpenRLHF requires only AgentExecutor (openrlhf/trainer/ray/vllm_engine.py)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ValueError(f"--agent_func_path {path}: no such file")
    spec = importlib.util.spec_from_file_location("rlhf_user_agent", path)
    mod = importlib.util.module_from_spec(spec)
    with orl.openrlhf_names():
        spec.loader.exec_module(mod)
    exe = getattr(mod, "AgentExecutor", None)
    if exe is None and getattr(mod, "AgentInstance", None) is None and hasattr(mod, "run_agent"):
        from rlhf.agents.endpoint.executor import run_agent_adapter

        missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
        if missing:  # the in-job endpoint serves the client: refused here, before any process group
            raise ValueError(f"{path} defines run_agent, which trains through the in-job OpenAI endpoint; it needs "
                             f"{', '.join(missing)}: pip install -e \".[agents]\" (fastapi, openai)")

        return None, run_agent_adapter(mod.run_agent, path, endpoint)
    for name in ("AgentInstance", "AgentExecutor")[orl.is_openrlhf_executor(exe):]:  # OpenRLHF's awaits it
        check_sync_init(getattr(mod, name, None), name, path)
    if orl.is_openrlhf_executor(exe):
        if inspect.isabstract(exe):
            raise ValueError(f"{path}: AgentExecutor must implement async execute(prompt, label, sampling_params, "
                             f"max_length, hf_tokenizer, llm_engine, images=None) (OpenRLHF's AgentExecutorBase)")
        from rlhf.agents.endpoint.executor import thread_safe_executor

        return getattr(mod, "AgentInstance", None), orl.adapter_for(thread_safe_executor(exe, endpoint))
    inst = getattr(mod, "AgentInstance", None)
    if inst is None or not (isinstance(inst, type) and issubclass(inst, AgentInstanceBase)):
        raise ValueError(f"{path} must define class AgentInstance(AgentInstanceBase)")
    if inst.step is AgentInstanceBase.step:
        raise ValueError(f"{path}: AgentInstance must implement step(states)")
    exe = getattr(mod, "AgentExecutor", AgentExecutorBase)
    if not issubclass(exe, AgentExecutorBase):
        raise ValueError(f"{path}: AgentExecutor must subclass AgentExecutorBase")
    return inst, exe


def check_sync_init(cls, name: str, path: str) -> None:
    """``async def __init__`` cannot work: calling the class returns a coroutine from ``__init__``, which Python
    refuses with a bare ``TypeError: __init__() should return None, not 'coroutine'``.  Said at load, with the fix.
    Not asked of an OpenRLHF file's AgentInstance: OpenRLHF ran it as a Ray actor, which awaits such an
    ``__init__``, and so does the shim's MultiTurnAgentExecutor (``openrlhf_agent.new_instance``)."""
    init = getattr(cls, "__init__", None) if isinstance(cls, type) else None
    if init is not None and inspect.iscoroutinefunction(init):
        raise ValueError(f"{path}: {name}.__init__ is `async def`; Python cannot await a constructor (calling "
                         f"{name}() fails with \"TypeError: __init__() should return None, not 'coroutine'\", under "
                         f"OpenRLHF too). Make __init__ a plain `def` and do the async set-up in "
                         f"`async def reset(self, states, **kwargs)`, which is awaited at the start of each episode")
