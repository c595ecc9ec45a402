"""Memory planning: per-rank, per-stage peak device memory from a model's config.json and the job's flags
(``python -m rlhf.plan --memory ...``; the trainers' start-up check, rlhf/config/preflight.py).

Files: job.py (the job, from the flags), plan_types.py (the plan's records and table), memory.py (the stage model:
each stage's peak), fixes.py (the flag sets that fit), report.py (the text), startup.py (the start-up check);
terms.py (the formulas), dims.py (a model's dimensions)."""
from rlhf.planning.dims import KNOWN, ModelDims, write_config
from rlhf.planning.fixes import device_budget, flags_text, plan_with_fixes, suggest
from rlhf.planning.job import DEFAULT_GPU_GB, Job, job_from_flags
from rlhf.planning.memory import CUDA_RESERVE, plan_memory, role_dims
from rlhf.planning.plan_types import GroupPlan, MemoryPlan, RoleModel, Stage
from rlhf.planning.report import report
from rlhf.planning.startup import MemoryPlanError, startup_check

__all__ = ["KNOWN", "ModelDims", "write_config", "Job", "MemoryPlan", "job_from_flags", "plan_memory", "report",
           "suggest", "GroupPlan", "Stage", "RoleModel", "role_dims", "plan_with_fixes", "device_budget", "flags_text",
           "DEFAULT_GPU_GB", "CUDA_RESERVE", "MemoryPlanError", "startup_check"]
