"""Memory planning: per-rank, per-stage peak device memory from a model's config.json and the job's flags
(``python -m rlhf.plan --memory ...``; the trainers' start-up check, rlhf/config/preflight.py)."""
from .dims import KNOWN, ModelDims, write_config
from .memory import Job, MemoryPlan, job_from_flags, plan_memory, report, suggest

__all__ = ["KNOWN", "ModelDims", "write_config", "Job", "MemoryPlan", "job_from_flags", "plan_memory", "report",
           "suggest"]
