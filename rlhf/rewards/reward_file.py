"""OpenRLHF reward files (``--remote_rm_url path/reward_func.py``): the path resolved, the file loaded as a
module with OpenRLHF's helpers importable, and its ``reward_func``'s signature checked.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Callable

from rlhf.rewards.result import RewardError


def resolve_reward_path(path: str) -> str:
    """``--remote_rm_url path.py`` as an absolute path: ``~`` expanded, a relative path joined to the job's working
    directory (where torchrun was started; slurm/common.sh starts there from $SLURM_SUBMIT_DIR), once, at load: the
    module's ``__file__`` and every later message name that file even if something changes the directory after."""
    return os.path.abspath(os.path.expanduser(path))


def load_reward_func(path: str) -> Callable:
    """Import ``reward_func`` from a file and check its signature before any training starts.  The file may import
    ``openrlhf.utils`` (served while it loads, see the module docstring)."""
    from rlhf.agents.openrlhf_agent import openrlhf_names

    given, path = path, resolve_reward_path(path)
    if not os.path.isfile(path):
        where = "" if os.path.isabs(os.path.expanduser(given)) else \
            f" (a relative path resolves against the job's working directory {os.getcwd()})"
        raise RewardError(f"--remote_rm_url {given}: no such file {path}{where}; give a reward_func.py path or an "
                          f"http(s) URL")
    spec = importlib.util.spec_from_file_location(f"rlhf_user_reward_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        with openrlhf_names():
            spec.loader.exec_module(mod)
    except Exception as e:
        hint = ""
        if isinstance(e, ImportError) and "openrlhf" in str(e):
            hint = (" (rlhf serves openrlhf.utils.agent and openrlhf.utils' extract_boxed_answer, grade_answer and "
                    "math_utils; for other openrlhf modules install openrlhf)")
        if isinstance(e, ModuleNotFoundError) and e.name == "pylatexenc":
            hint = " (OpenRLHF's math_utils needs it: pip install pylatexenc, or pip install 'rlhf[math]')"
        raise RewardError(f"importing {path} failed: {type(e).__name__}: {e}{hint}") from e
    fn = getattr(mod, "reward_func", None)
    if fn is None or not callable(fn):
        raise RewardError(f"{path} defines no callable reward_func(queries, prompts, labels, **kwargs)")
    check_signature(fn, path)
    return fn


def check_signature(fn: Callable, where: str) -> None:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_var = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 3 and not has_var:
        raise RewardError(f"{where}: reward_func{sig} must accept (queries, prompts, labels, **kwargs)")
    required = [p for p in positional[3:] if p.default is p.empty]
    if required:
        raise RewardError(f"{where}: reward_func{sig} has extra required arguments {[p.name for p in required]}")
