"""Training and rollout engines.  The package's short names load on first use (PEP 562 ``__getattr__``), so that
reading the rollout-engine registry (rlhf.config.schema's ``--rollout_engine`` choices) imports no engine code."""
import importlib

_EXPORTS = {
    "HFEngine": "rlhf.engines.hf_engine",
    "Batch": "rlhf.engines.rollout",
    "RolloutEngine": "rlhf.engines.rollout",
    "SamplingParams": "rlhf.engines.rollout",
    "response_mask": "rlhf.engines.rollout",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rlhf.engines' has no attribute {name!r}")
