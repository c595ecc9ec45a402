"""Roles own their lifecycle (issue 43 item 3): a role is Stateful (state_dict / load_state_dict into a directory,
export), a run's checkpoint holds exactly the roles with optimizer state, and the trainers' save / resume / export
iterate over the roles.  The protocol imitated: torch/distributed/checkpoint/stateful.py ``Stateful``."""
from __future__ import annotations

import contextlib
import os

import torch
from helpers.models import tiny_llama


def _engine(model, trainable=True):
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    return FSDP2Engine(model, EngineSpec(lr=1e-2, train_batch_size=2, micro_batch_size=2, total_steps=2,
                                         trainable=trainable, warmup_ratio=0.0))


def test_roles_are_stateful_and_only_trained_roles_are_checkpointed(one_rank_gloo, tmp_path):
    from rlhf.distributed.mesh import mesh_of
    from rlhf.models.critic import CriticModel
    from rlhf.roles.actor import Actor
    from rlhf.roles.base import ModelRole, Roles
    from rlhf.roles.critic import Critic
    from rlhf.roles.reference import Reference

    one = lambda name: mesh_of(name, [0], 0, {"dp": 1})  # noqa: E731
    actor, critic = Actor("actor", one("actor")), Critic("critic", one("critic"))
    ref, reward = Reference("ref", one("ref")), ModelRole("reward", one("reward"))
    actor.engine = _engine(tiny_llama(1))
    critic.engine = _engine(CriticModel(tiny_llama(1).model, 32))
    roles = Roles(actor=actor, ref=ref, critic=critic, reward=reward)
    assert roles.trained() == [actor, critic], "a checkpoint holds the roles with optimizer state, actor first"

    before = {k: v.clone() for k, v in actor.engine.model.state_dict().items()}
    actor.state_dict(str(tmp_path / "actor"))
    assert os.listdir(tmp_path / "actor"), "the engine's checkpoint was not written under the role's directory"
    with torch.no_grad():
        for p in actor.engine.model.parameters():
            p.add_(1.0)
    actor.load_state_dict(str(tmp_path / "actor"))
    after = actor.engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "load_state_dict did not restore the weights"

    critic.export(str(tmp_path / "m_critic"), None)  # backbone (HF) + value head, what --critic_pretrain reads
    assert os.path.exists(tmp_path / "m_critic" / "value_head.pt")
    actor.export(str(tmp_path / "m"), None)
    assert os.path.exists(tmp_path / "m" / "config.json")

    other = Actor("actor", mesh_of("actor", [1], 0, {"dp": 1}))  # not a member: every call passes (no engine here)
    other.state_dict(str(tmp_path / "x"))
    other.load_state_dict(str(tmp_path / "x"))
    other.export(str(tmp_path / "x"), None)
    assert not os.path.exists(tmp_path / "x")


def _recorder(name, seen):
    """A trained role on rank 0 that records the calls instead of running an engine."""
    from rlhf.roles.base import ModelRole

    class Recorder(ModelRole):
        trains = True

        def state_dict(self, path):
            seen.append(("state_dict", path))

        def load_state_dict(self, path):
            seen.append(("load_state_dict", path))

        def export(self, path, tokenizer):
            seen.append(("export", path))

    from rlhf.distributed.mesh import mesh_of

    return Recorder(name, mesh_of(name, [0], 0, {"dp": 1}))


def test_rl_save_and_export_iterate_over_the_roles(tmp_path, monkeypatch):
    """The RL trainer writes each trained role under its name and exports the actor (and, with
    --save_value_network, the critic at ``<save_path>_critic``) without naming them."""
    from rlhf import checkpoint as ckpt
    from rlhf.config.schema import TrainConfig
    from rlhf.rl.trainer import RLTrainer
    from rlhf.roles.base import Roles

    seen: list = []
    tr = RLTrainer.__new__(RLTrainer)
    tr.cfg, tr.tokenizer, tr.step = TrainConfig(), None, 3
    tr.cfg.checkpoint.save_path, tr.cfg.checkpoint.ckpt_path = str(tmp_path / "m"), str(tmp_path / "ck")
    tr.roles = Roles(actor=_recorder("actor", seen), critic=_recorder("critic", seen))
    tr.watchdog = type("W", (), {"phase": lambda self, name: contextlib.nullcontext()})()
    tr.finish()
    assert seen == [("export", str(tmp_path / "m"))], seen
    tr.cfg.checkpoint.save_value_network = True
    seen.clear()
    tr.finish()
    assert seen == [("export", str(tmp_path / "m")), ("export", str(tmp_path / "m_critic"))], seen

    seen.clear()
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda root, step, write, *a, **kw: write(str(tmp_path / "tmp")))
    tr.kl_ctl = type("K", (), {"value": 0.1})()
    tr.reward_norm = tr.async_rollout = None
    tr.save()
    assert seen == [("state_dict", str(tmp_path / "tmp" / "actor")), ("state_dict", str(tmp_path / "tmp" / "critic"))]


def test_supervised_placement_puts_every_role_on_every_rank():
    from rlhf.distributed.placement import supervised_placement

    plan = supervised_placement(4, 4, 2, with_ref=True)
    assert plan.ranks["actor"] == plan.ranks["ref"] == [0, 1, 2, 3] and plan.colocated
    assert not plan.ranks["critic"] and not plan.ranks["rollout"] and not plan.engine_ranks
    assert plan.sp_groups == {"actor": [[0, 1], [2, 3]], "ref": [[0, 1], [2, 3]]}
    assert supervised_placement(2, 2, 1, with_ref=False).ranks["ref"] == []
