"""transformers' per-rank noise while a model loads or saves, quieted: progress bars, the load report, the
DeepSpeed import ``save_pretrained`` triggers.  A low layer (utils) so models/ and the checkpoint code share it."""
from __future__ import annotations

import contextlib

import transformers


@contextlib.contextmanager
def quiet_progress():
    """No "Loading checkpoint shards" / "Writing model shards" bar from every rank while a model loads or saves;
    the caller's setting comes back."""
    hub = transformers.utils.logging
    was = hub.is_progress_bar_enabled()
    hub.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hub.enable_progress_bar()


@contextlib.contextmanager
def load_report(show: bool):
    """transformers 5 logs a "LOAD REPORT" table (missing / unexpected keys) as a warning of
    ``transformers.modeling_utils`` (transformers/utils/loading_report.py ``log_state_dict_report``); every rank
    loads the same files, so one copy (rank 0's) says it all.  ``show=False`` drops that one record for the load
    (a filter, not the logger's level: transformers runs extra checks when that level is raised, with warnings of
    their own); errors still raise."""
    if show:
        yield
        return
    import logging

    log = logging.getLogger("transformers.modeling_utils")
    drop = _DropLoadReport()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


class _DropLoadReport:
    """A logging filter (any object with ``filter(record)``): every record but the load report passes."""

    @staticmethod
    def filter(record) -> bool:
        return "LOAD REPORT" not in str(record.msg)


@contextlib.contextmanager
def quiet_save():
    """``save_pretrained`` without its side effects on every saving rank: no "Writing model shards" bar, and no
    DeepSpeed import.  transformers unwraps the model with accelerate's ``extract_model_from_parallel``
    (accelerate/utils/other.py), which imports deepspeed whenever it is installed, to test for a DeepSpeedEngine;
    that import logs "Setting accelerator to CPU" on a CPU machine and costs seconds, under --backend fsdp2 too.
    The model handed to save_pretrained here is the bare module, never a DeepSpeedEngine, so the probe answers
    "not installed" for the call (when deepspeed is imported already, nothing changes)."""
    import sys

    other = None
    if "deepspeed" not in sys.modules:
        try:
            import accelerate.utils.other as other
        except ImportError:
            other = None
    probe = getattr(other, "is_deepspeed_available", None)
    if probe is not None:
        other.is_deepspeed_available = lambda: False
    try:
        with quiet_progress():
            yield
    finally:
        if probe is not None:
            other.is_deepspeed_available = probe
