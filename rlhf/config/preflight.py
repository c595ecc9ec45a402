"""Checks that would otherwise fail late (after loading, or after all of training), run at start.

``preflight(cfg, kind)`` runs on every rank before ``init_process_group`` and raises ``ConfigError`` naming the
flag and a fix: model directories of the wrong kind, --flash_attn without CUDA, unwritable --save_path /
--ckpt_path / --log_dir, --load_checkpoint with no checkpoint to load, a resume the backend cannot do on this
number of ranks, a --train_batch_size the world size does not divide, a layout the memory plan says cannot fit.
"""
from __future__ import annotations

import os
import tempfile
from typing import List, Optional

from rlhf.config.parallel_checks import check_tensor_parallel
from rlhf.config.validate import ConfigError
from rlhf.console import print0

RL_KINDS = ("ppo", "grpo")


def preflight(cfg, kind: str, world_size: Optional[int] = None) -> List[str]:
    """Raise ConfigError on the first problem; return the notices (printed on rank 0)."""
    world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    notices: List[str] = []
    check_models(cfg, kind)
    from rlhf.config.teacher_checks import check_teacher

    check_teacher(cfg, kind)  # the teacher's vocabulary is the student's
    check_flash_attn(cfg)
    check_writable(cfg)
    notices += check_resume(cfg, world)
    notices += check_lock(cfg)
    check_batch_world(cfg, kind, world)
    check_sequence_parallel(cfg, kind, world)
    check_tensor_parallel(cfg, kind, world)  # --tp_size, --fsdp_shard_size (rlhf.config.parallel_checks)
    notices += check_memory(cfg, kind, world)  # last: the layout it plans has passed the other checks
    for n in notices:
        print0(n)
    return notices


def check_sequence_parallel(cfg, kind: str, world: int) -> None:
    """--ring_attn_size against the model's heads and the world (each role's ranks: the placement)."""
    from rlhf.distributed.sequence_parallel import check_sp, model_heads
    from rlhf.models.load import resolve_pretrain

    sp, m = cfg.topology.ring_attn_size, cfg.model
    if sp > 1:  # every model that splits sequences: the policy, and in RL the reference, critic and reward model
        paths = [resolve_pretrain(m.pretrain)] + ([m.ref_pretrain, m.critic_pretrain, m.reward_pretrain]
                                                  if kind in RL_KINDS else [m.ref_pretrain])
        try:
            for path in paths:
                check_sp(sp, kind, m.packing_samples, None if kind in RL_KINDS else world, model_heads(path))
        except ValueError as e:
            raise ConfigError("ring_attn_size", str(e)) from None


def check_memory(cfg, kind: str, world: int) -> List[str]:
    """The memory plan (rlhf/planning): refuse a layout with a stage that cannot fit the device, naming the stage,
    the numbers and flags that fit (--skip_memory_check starts anyway).  Without CUDA only with --gpu_memory_gb."""
    from rlhf.planning import MemoryPlanError

    try:
        return memory_notices(cfg, kind, world)
    except MemoryPlanError as e:
        raise ConfigError("skip_memory_check", str(e)) from None


def memory_notices(cfg, kind: str, world: int, on_cuda: Optional[bool] = None,
                   device_bytes: Optional[float] = None) -> List[str]:
    """The planner's start-up check (``rlhf.planning.startup.startup_check``, which raises MemoryPlanError) built
    from the config here, at the top: the job from its five flag groups, and in RL the placement (a topology the
    placement rejects is left to the checks that report it: no plan)."""
    from rlhf.planning import job_from_flags, startup_check

    placement = None
    if kind in RL_KINDS:
        from rlhf.distributed.groups import nnodes_from_env
        from rlhf.distributed.placement import TopologyError, job_role_needs, make_placement

        try:
            placement = make_placement(cfg.topology, world, cfg.topology.nnodes_hint or nnodes_from_env(),
                                       parallel=cfg.parallel, **job_role_needs(cfg))
        except TopologyError:
            return []
    job = job_from_flags(kind, cfg.model, cfg.data, cfg.topology, cfg.rollout, cfg.optim, cfg.parallel)
    from rlhf.distributed.placement import flag_groups

    return startup_check(job, cfg.model, cfg.topology, world, placement, on_cuda, device_bytes, flag_groups(cfg))


def check_models(cfg, kind: str) -> None:
    from rlhf.models.load import ModelKindError, check_model_dir

    m = cfg.model
    todo = []
    if m.pretrain:
        todo.append(("pretrain", m.pretrain, "any" if kind == "rm" else "causal", True))
    if kind in RL_KINDS:
        if m.reward_pretrain:
            todo.append(("reward_pretrain", m.reward_pretrain, "reward", False))
        if m.critic_pretrain:
            todo.append(("critic_pretrain", m.critic_pretrain, "any", False))
    if m.ref_pretrain and kind in RL_KINDS + ("dpo",):
        todo.append(("ref_pretrain", m.ref_pretrain, "causal", False))
    for flag, path, want, tok in todo:
        try:
            check_model_dir(path, want, flag, need_tokenizer=tok, value_head_prefix=m.value_head_prefix)
        except ModelKindError as e:
            raise ConfigError(e.flag, str(e)) from None


def check_flash_attn(cfg) -> None:
    if not cfg.model.flash_attn:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("flash_attn", "--flash_attn needs CUDA (flash_attention_2 has no CPU kernel); drop the flag "
                                        "on this machine (attention then uses sdpa)")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        raise ConfigError("flash_attn", "--flash_attn needs the flash-attn package: pip install 'rlhf[flash]', or "
                                        "drop the flag (attention then uses sdpa)") from None


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def writable_problem(path: str, need_dir_itself: bool = True) -> Optional[str]:
    """None when ``path`` (a directory, created later) can be written; else why not.

    The nearest existing ancestor must be a directory we can create a file in (tested with a real file: root
    passes os.access everywhere, a read-only mount does not)."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} exists and is not a directory"
    base = _nearest_existing(path if need_dir_itself else os.path.dirname(path))
    if not os.path.isdir(base):
        return f"{base} is a file, so {path} cannot be created under it"
    try:
        fd, probe = tempfile.mkstemp(prefix=".rlhf-write-test-", dir=base)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"cannot write in {base} ({e.strerror or e})"
    return None


def check_writable(cfg) -> None:
    c, lg = cfg.checkpoint, cfg.logging
    # save_path is replaced by a sibling save_path.tmp: its parent must be writable
    for flag, path, itself in (("save_path", c.save_path, False), ("ckpt_path", c.ckpt_path, True),
                               ("log_dir", lg.log_dir, True)):
        why = writable_problem(path, itself)
        if why:
            raise ConfigError(flag, f"--{flag} {path} is not writable: {why}; give a directory you can write "
                                    f"(it is checked now so the run does not fail after training)")
    check_export_targets(cfg)


def check_export_targets(cfg) -> None:
    """--save_path (and <save_path>_critic with --save_value_network) may hold anything (OpenRLHF's scripts put
    --ckpt_path and logs under it); the export replaces only an earlier export's files, so files it would overwrite
    that no export wrote are refused now, not after training (``checkpoint.check_export_target``)."""
    from rlhf import checkpoint as ckpt

    c = cfg.checkpoint
    targets = [c.save_path] + ([c.save_path.rstrip("/") + "_critic"] if c.save_value_network else [])
    for path in targets:
        try:
            ckpt.check_export_target(path, "save_path")
        except ckpt.CheckpointError as e:
            raise ConfigError("save_path", str(e)) from None


def check_resume(cfg, world: int) -> List[str]:
    from rlhf import checkpoint as ckpt

    c = cfg.checkpoint
    if not c.load_checkpoint:
        return []
    try:  # sizes only here, on every rank; the trainer's resume verifies the hashes (rank 0) before loading
        latest, notices = ckpt.pick_checkpoint(c.ckpt_path, c.strict_resume, hashes=False)
        if latest is not None:
            man = ckpt.read_manifest(latest) or {}
            notices += ckpt.compare_identity(latest, man.get("identity", {}), ckpt.run_identity(cfg))
    except ckpt.CheckpointError as e:
        flag = "strict_resume" if "strict_resume" in str(e) else "load_checkpoint"
        raise ConfigError(flag, str(e)) from None
    if latest is None:
        if os.path.isdir(c.ckpt_path):
            entries = sorted(e for e in os.listdir(c.ckpt_path) if e != ckpt.LOCK_FILE)
            seen = f"it holds {', '.join(entries[:6])}" if entries else "it is empty"
            partial = [e for e in entries if e.startswith(".tmp-")]
            if partial:
                seen += " (.tmp-* are saves cut short)"
        else:
            seen = "it does not exist"
        msg = f"--load_checkpoint: no checkpoint (global_step_N/) in --ckpt_path {c.ckpt_path} ({seen})"
        if not c.start_fresh_if_no_checkpoint:
            raise ConfigError("ckpt_path", f"{msg}, and --no_start_fresh_if_no_checkpoint refuses to start from step "
                                           f"0. Check --ckpt_path, or drop --no_start_fresh_if_no_checkpoint")
        # OpenRLHF starts from step 0 then (openrlhf/trainer/ppo_trainer.py ``init_checkpoint_states``, the cli's
        # ``if args.load_checkpoint and os.path.exists(ckpt_path)``); a damaged checkpoint is refused above
        return notices + [f"[resume] {msg}: starting from step 0"]
    saved = ckpt.saved_world_size(latest)
    if saved and saved != world:
        if cfg.topology.backend == "deepspeed":
            raise ConfigError("load_checkpoint", f"{latest} was saved by {saved} ranks and this run has {world}: "
                                                 f"DeepSpeed ZeRO checkpoints load only on the same number of ranks. "
                                                 f"Run with {saved} ranks (torchrun --nproc_per_node {saved}), or "
                                                 f"--backend fsdp2 checkpoints, which reshard")
        extra = f"; ranks {saved}..{world - 1} get rng seeds derived from the step and rank" if world > saved else ""
        return notices + [f"[resume] {latest} was saved by {saved} ranks, this run has {world}: model and optimizer shards "
                f"are resharded (torch.distributed.checkpoint){extra}"]
    return notices


def check_lock(cfg) -> List[str]:
    """Rank 0 of a run that saves or resumes holds --ckpt_path's lock for its whole life (see
    ``checkpoint.acquire_lock``); a folder held by another live run is refused naming the holder."""
    from rlhf import checkpoint as ckpt

    c = cfg.checkpoint
    if os.environ.get("RANK", "0") != "0" or not (c.save_steps > 0 or c.load_checkpoint):
        return []
    try:
        return ckpt.acquire_lock(c.ckpt_path)
    except ckpt.CheckpointError as e:
        raise ConfigError("ckpt_path", str(e)) from None


def check_batch_world(cfg, kind: str, world: int) -> None:
    o = cfg.optim
    if kind in RL_KINDS or world <= 1:
        return
    step = o.micro_train_batch_size * world
    if o.train_batch_size % step:
        fix = -(-o.train_batch_size // step) * step
        raise ConfigError("train_batch_size", f"--train_batch_size {o.train_batch_size} must be a multiple of "
                                              f"--micro_train_batch_size {o.micro_train_batch_size} x {world} ranks; "
                                              f"e.g. --train_batch_size {fix}")
