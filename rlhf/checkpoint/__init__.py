"""Crash-safe checkpoint directories: ckpt_path/global_step_N/, written under a temporary name and renamed.

A directory only gets its final name after every rank finished writing, so a
crash mid-save leaves a ``.tmp-global_step_N-<run>`` that resume ignores (and the next
save removes).  Every checkpoint holds ``manifest.json``: the size and a fast hash of every file (each rank hashes
the files it wrote, rank 0 assembles them before the rename) and the run's identity (``run_identity``).
``pick_checkpoint`` verifies the newest checkpoint against its manifest and falls back to the newest intact one;
``resume_path`` does so collectively, every rank hashing a share (``verify_shared``).
``acquire_lock`` keeps two runs off one --ckpt_path.

Files: layout.py (folder names, listing), save.py, manifest.py (sizes and hashes), resume.py (which checkpoint,
verified collectively), identity.py (run identity checks), lock.py, export.py (HuggingFace exports).
"""
from rlhf.checkpoint.errors import CheckpointError
from rlhf.checkpoint.export import (
    EXPORT_RECORD,
    ExportError,
    begin_export,
    check_export_target,
    drop_tied_copies,
    export_conflicts,
    export_record,
    install_export,
    save_hf,
)
from rlhf.checkpoint.identity import check_stream, compare_identity, run_identity, stream_flags
from rlhf.checkpoint.layout import STATE_FILE, STEP_RE, derived_seed, list_checkpoints, load_trainer_state, saved_world_size, step_dirs
from rlhf.checkpoint.lock import LOCK_FILE, acquire_lock, release_lock, remove_cut_short_saves
from rlhf.checkpoint.manifest import MANIFEST, check_hashes, file_digest, hash_files, read_manifest, verify_checkpoint, write_manifest
from rlhf.checkpoint.resume import hash_shares, load_rank_state, pick_checkpoint, resume_path, verify_shared
from rlhf.checkpoint.save import rng_state, save_checkpoint, set_rng_state
