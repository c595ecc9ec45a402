"""The library's errors, one hierarchy (the bottom layer: imports nothing of the library).

Every error this library raises on purpose is an ``RLHFError``; each kind also keeps the builtin base it always
had, so ``except ValueError`` / ``except RuntimeError`` callers still catch it.  ``Refusal`` marks bad input whose
message already says what to change (or already carries the user code's traceback, a reward function that
raised): fail-fast (``rlhf.distributed.failfast.is_input_error``) prints it as one line, without our traceback,
and exits 2 before any process group exists.  Kinds, grouped as the job meets them:

=========================  ===================  ==========  ===========================================
class                      builtin base         refusal     raised where
=========================  ===================  ==========  ===========================================
ConfigError                ValueError           yes         config validation (``.flag``: the flag)
HierarchicalError          ValueError           no          dotted (OpenRLHF 0.11 hierarchical) flags
InputError                 ValueError           yes         trainers' start-up checks of the inputs
DataError                  ValueError           yes         reading datasets
ModelKindError             ValueError           yes         a checkpoint of the wrong kind (``.flag``)
TopologyError              ValueError           yes         the placement of roles on ranks
MemoryPlanError            ValueError           yes         the memory planner's start-up check
CombineError               ValueError           no          ``rlhf.tools.lora_combiner``
RewardError                RuntimeError         yes         a reward function that failed / broke its contract
RewardTimeout              (Exception)          no          a reward call past its deadline
TeacherServerError         RuntimeError         no          a --teacher_url answer that breaks vLLM's format
AgentContractError         ValueError           no          an agent's return value (``.field``, ``.kind``)
CheckpointError            RuntimeError         no          a checkpoint that cannot be used
ExportError                RuntimeError         no          an export that would overwrite foreign files
WeightTransferError        RuntimeError         no          the trainer -> vLLM weight-transfer group
WeightSyncTimeout          RuntimeError         no          a weight sync that did not finish in time
=========================  ===================  ==========  ===========================================

A new kind: subclass ``RLHFError`` (and ``Refusal`` when its message alone tells the user the fix) plus the builtin
its callers catch.  Pattern: torchtitan and veRL keep plain builtins; this follows Python's own ``OSError``
family (one base, a subclass per cause, matched with ``isinstance`` instead of by name).
"""
from __future__ import annotations


class RLHFError(Exception):
    """Base of every error the library raises on purpose."""


class Refusal(RLHFError):
    """Bad input refused; the message names the flag (or file) and a value that works.  Fail-fast prints it as one
    line and exits 2 before any process group exists (1 after)."""


# ---- input and configuration: raised before any process group ---------------------------------------------------
class ConfigError(Refusal, ValueError):
    """A flag's value that cannot work; ``flag`` names it (without dashes)."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(message)


class HierarchicalError(RLHFError, ValueError):
    """A dotted flag (``--actor.model_name_or_path``) that is unknown, short of values or set twice."""


class InputError(Refusal, ValueError):
    """Bad input found before any process group exists: the message names the flag and the fix."""


class DataError(Refusal, ValueError):
    """A dataset that cannot be read or has the wrong shape."""


class ModelKindError(Refusal, ValueError):
    """A checkpoint of the wrong kind for its flag (a reward model given as --pretrain, ...); ``flag`` names it."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(message)


class TopologyError(Refusal, ValueError):
    """Roles that do not fit the ranks (world size, colocation, tensor-parallel sizes)."""


class MemoryPlanError(Refusal, ValueError):
    """The memory planner's estimate does not fit the device."""


class CombineError(RLHFError, ValueError):
    """``rlhf.tools.lora_combiner``: an adapter folder or output path that cannot be used."""


# ---- rewards and agents ----------------------------------------------------------------------------------------
class RewardError(Refusal, RuntimeError):
    """A reward function that failed to import, raised, or returned the wrong shape; carries its traceback."""


class RewardTimeout(RLHFError):
    """A reward call ran past its deadline (retried, then scored invalid)."""


class TeacherServerError(RLHFError, RuntimeError):
    """The teacher server's answer is missing or does not follow vLLM's completion response (rlhf.rl.teacher_client)."""


class AgentContractError(RLHFError, ValueError):
    """A value an agent returned that breaks the contract; the episode is counted as failed (its reward NaN:
    excluded from the loss, counted in reward_invalid), the first of each kind (``field``) said once."""

    def __init__(self, message: str, field_: str = "result", got=None):
        super().__init__(message)
        self.field = field_
        self.kind = f"{field_}:{type(got).__name__}"


# ---- checkpoints and exports -----------------------------------------------------------------------------------
class CheckpointError(RLHFError, RuntimeError):
    """A checkpoint cannot be used (damaged, or saved by a different run); the message names it and a fix."""


class ExportError(CheckpointError):
    """The export cannot go where it was asked without overwriting files this project did not write."""


# ---- weight transfer (trainer -> rollout engines) ---------------------------------------------------------------
class WeightTransferError(RLHFError, RuntimeError):
    """The weight-transfer group could not form, or a transfer failed or timed out on the engine's side."""


class WeightSyncTimeout(RLHFError, RuntimeError):
    """A weight sync did not finish within --dist_timeout_s on the trainer's side."""
