"""An RL run's state on disk: the checkpoint (each trained role's state and the trainer's own), its restore on
resume, the first weight sync of a colocated engine, and the final export.  All collective.

The trainer's own state is the step, the KL coefficient, the running reward norm and the async queue's places in
its prompt streams; each role writes and reads its share in its directory (``ModelRole.state_dir``).  As OpenRLHF
``openrlhf/trainer/ppo_trainer.py`` (``save_logs_and_checkpoints``: each model's ``save_checkpoint`` plus the
trainer's ``client_states``; ``fit`` reads ``consumed_samples`` back).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from rlhf import checkpoint as ckpt
from rlhf.distributed import comm


def run_state(step: int, kl_coef: float, reward_norm, queue) -> dict:
    """The trainer's own state (collective with --async_train: the queue's ``state`` gathers every engine's)."""
    return {"step": step, "kl_coef": kl_coef,
            "reward_norm": reward_norm.state_dict() if reward_norm else None,
            "async_queue": queue.state() if queue is not None else None}


def save_run(c, step: int, roles, state: dict, identity: dict, tokenizer) -> None:
    """Step ``step``'s checkpoint under --ckpt_path (``c``: ``CheckpointConfig``): the trained roles, ``state``
    and the run's ``identity``; with --save_hf_ckpt also the actor as an HF model in it."""
    def write(tmp):
        for role in roles.trained():
            role.state_dict(os.path.join(tmp, role.state_dir))

    path = ckpt.save_checkpoint(c.ckpt_path, step, write, state, c.max_ckpt_num, identity=identity)
    if c.save_hf_ckpt:
        export_actor(roles, tokenizer, os.path.join(path, "hf"))


def export_actor(roles, tokenizer, path: str) -> None:
    """The actor ranks gather the full weights, the first actor rank writes them; every rank waits."""
    roles.actor.export(path, tokenizer)
    comm.barrier()


def restore_run(path: str, roles, kl_ctl, reward_norm, queue) -> int:
    """Load the checkpoint at ``path`` into the trained roles, the KL controller, the reward norm and the async
    queue, and this rank's random state; returns the step it was saved at."""
    for role in roles.trained():
        role.load_state_dict(os.path.join(path, role.state_dir))
    st = ckpt.load_trainer_state(path)
    kl_ctl.value = st["kl_coef"]
    if reward_norm is not None and st.get("reward_norm"):
        reward_norm.load_state_dict(st["reward_norm"])
    if queue is not None:
        queue.restore(st.get("async_queue"))
    ckpt.load_rank_state(path)
    return st["step"]


def needs_first_sync(engine: Optional[object]) -> bool:
    """Collective: whether any rank's rollout engine waits for the actor's weights (colocated vLLM starts on dummy
    weights, VLLMEngine ``dummy_weights``); ``engine`` None on ranks without one (they take part as actor ranks)."""
    need = torch.tensor([1.0 if engine is not None and engine.needs_weights else 0.0])
    return float(comm.all_reduce(need, "max")) > 0


def exports(c, roles) -> list:
    """(role, directory) of the final export: the actor at --save_path, with --save_value_network the critic's
    backbone and value head at ``<save_path>_critic`` (OpenRLHF's directory; --critic_pretrain reads it back)."""
    out = [(roles.actor, c.save_path)]
    if c.save_value_network and roles.critic is not None:
        out.append((roles.critic, c.save_path.rstrip("/") + "_critic"))
    return out


def export_final(c, roles, tokenizer) -> None:
    """Each exported role's members gather and write it, then every rank waits for the write."""
    for role, path in exports(c, roles):
        role.export(path, tokenizer)
        comm.barrier()
