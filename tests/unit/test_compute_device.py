"""Inputs, labels, masks and loss terms go to the engine's compute device, never to the parameters' device.

Under --adam_offload FSDP2 keeps the sharded parameters in host memory and copies each unit to the GPU for its
all-gather (torch/distributed/fsdp/_fully_shard/_fsdp_api.py ``CPUOffloadPolicy``: "offloads parameters,
gradients, and optimizer states to CPU ... copies parameters to GPU before all-gather"), so
``next(model.parameters()).device`` is the CPU while the forward runs on the GPU: a batch moved there is on the wrong
device.  On a CPU machine both are the CPU, so the fault cannot show; here the parameters' reported device is made
to differ: a probe parameter on the meta device comes first in ``model.parameters()`` (where the shards live), the
engine's ``compute_device`` is the CPU (where the forward runs), and a forward pre-hook rejects any input that is
not on the compute device, as the GPU forward would.  ``engine.backward`` rejects a loss anywhere else.
Every path that feeds a model is covered: SFT, RM and DPO steps (and RM's score statistics after training), the
PPO actor and critic updates, and the actor / critic / reward-model inference forwards.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

COMPUTE = torch.device("cpu")


class Misplaced(AssertionError):
    pass


def params_elsewhere(model: torch.nn.Module, seen: list) -> torch.nn.Module:
    """``model`` whose parameters report the meta device (a probe registered first: what
    ``next(model.parameters())`` returns) while it computes on COMPUTE; its forward refuses inputs elsewhere."""
    model.register_parameter("offload_probe", torch.nn.Parameter(torch.empty(0, device="meta"), requires_grad=False))
    assert next(model.parameters()).device.type == "meta"

    def check(mod, args, kwargs):
        tensors = [(i, t) for i, t in enumerate(args)] + list(kwargs.items())
        bad = [(k, str(t.device)) for k, t in tensors if torch.is_tensor(t) and t.device != COMPUTE]
        if bad:
            raise Misplaced(f"forward inputs {bad} are not on the engine's compute device {COMPUTE} (the device "
                            f"was read from the parameters, which --adam_offload keeps on the host)")
        seen.append(type(mod).__name__)

    model.register_forward_pre_hook(check, with_kwargs=True)
    return model


def checked_backward(engine, seen: list):
    real = engine.backward

    def backward(loss, micro_step, last=None):
        if loss.device != COMPUTE:
            raise Misplaced(f"loss on {loss.device}, not on the engine's compute device {COMPUTE}")
        seen.append("backward")
        return real(loss, micro_step, last)

    engine.backward = backward


# ---- supervised: SFT, RM, DPO as the CLI builds them ---------------------------------------------------------------

def _supervised(kit, tmp_path, kind):
    from rlhf.config import parse
    from rlhf.supervised.tasks import DPOTask, RMTask, SFTTask
    from rlhf.supervised.trainer import SupervisedTrainer

    task, data = {"sft": (SFTTask, "sft"), "rm": (RMTask, "pref"), "dpo": (DPOTask, "pref")}[kind]
    argv = ["--pretrain", kit, "--dataset", os.path.join(kit, "data", f"{data}_train.jsonl"), "--max_global_steps",
            "1", "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_samples", "8",
            "--save_path", str(tmp_path / "m"), "--log_dir", str(tmp_path / "logs"), "--no_progress_bar"]
    return SupervisedTrainer(parse(kind, argv), task, data)


@pytest.mark.parametrize("kind", ["sft", "rm", "dpo"])
def test_supervised_batches_go_to_the_engines_compute_device(tiny_kit, tmp_path, kind):
    from rlhf.distributed import comm

    tr = _supervised(tiny_kit, tmp_path, kind)
    try:
        seen: list = []
        params_elsewhere(tr.engine.model, seen)
        if kind == "dpo":
            assert tr.task.ref is not None, "DPO without precomputed log-probs runs its reference model"
            params_elsewhere(tr.task.ref.model, seen)
        checked_backward(tr.engine, seen)
        logs = tr.accumulate(tr.batches_for(0))
        tr.engine.step()
        assert logs["loss"] and all(v == v for v in logs["loss"]), logs
        if kind == "rm":  # the score statistics saved beside the model: one more pass over the samples
            os.makedirs(tr.cfg.checkpoint.save_path, exist_ok=True)
            tr.task.after_fit(tr)
            with open(os.path.join(tr.cfg.checkpoint.save_path, "reward_norm.json")) as fh:
                assert json.load(fh)["std"] > 0
        assert "backward" in seen and len(seen) > 2, f"the checks never ran: {seen}"
        if kind == "dpo":
            assert seen.count(type(tr.task.ref.model).__name__) >= 2, "the reference forward was not checked"
    finally:
        tr.watchdog.stop()
        comm.destroy()


# ---- RL: the actor / critic updates and the inference forwards ---------------------------------------------------

def _engine(model, lr=1e-3):
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    return FSDP2Engine(model, EngineSpec(lr=lr, train_batch_size=8, micro_batch_size=2, total_steps=2,
                                         warmup_ratio=0.0))


def _rl_config(packing: bool):
    from rlhf.config.schema import TrainConfig

    cfg = TrainConfig()
    cfg.optim.train_batch_size, cfg.optim.micro_train_batch_size, cfg.optim.max_epochs = 8, 2, 1
    cfg.model.packing_samples = packing
    cfg.algorithm.use_kl_loss, cfg.algorithm.kl_estimator, cfg.algorithm.entropy_loss_coef = True, "k3", 0.01
    cfg.algorithm.enable_is_correction = True
    cfg.data.generate_max_len = 12
    return cfg


def _role(name, engine):
    from rlhf.distributed.mesh import mesh_of
    from rlhf.roles.base import ModelRole

    role = ModelRole(name, mesh_of(name, [0], 0, {"dp": 1}))
    role.engine = engine
    return role


def _batch(exp):
    from rlhf.batch import Batch

    return Batch(sequences=exp.sequences, attention_mask=exp.attention_mask, action_mask=exp.action_mask,
                 rollout_logprobs=exp.rollout_logprobs, prompt_len=exp.sequences.size(1) - exp.action_mask.size(1))


@pytest.mark.parametrize("packing", [False, True])
def test_actor_update_and_logprobs_on_the_compute_device(tiny_kit, packing):
    from helpers.batching_checks import skewed_experience, update_role

    from rlhf.models.load import load_causal_lm
    from rlhf.roles.actor import Actor

    exp = skewed_experience()
    eng = _engine(load_causal_lm(tiny_kit))
    seen: list = []
    params_elsewhere(eng.model, seen)
    checked_backward(eng, seen)
    lp = _role("actor", eng).logprobs(_batch(exp), 1.0, 2, 1024, packing)
    assert lp.shape == exp.action_mask.shape and torch.isfinite(lp).all() and (lp[exp.action_mask.bool()] < 0).all()
    logs = update_role(Actor, _rl_config(packing), eng, 0, 1).update(exp, kl_coef=0.1, step=1)
    assert torch.isfinite(torch.tensor(logs["policy_loss"])) and seen.count("backward") == 4, (logs, seen)


def test_critic_update_and_values_on_the_compute_device(tiny_kit):
    from helpers.batching_checks import skewed_experience, update_role

    from rlhf.models.critic import CriticModel
    from rlhf.roles.critic import Critic

    exp = skewed_experience()
    eng = _engine(CriticModel.from_pretrained(tiny_kit))
    seen: list = []
    params_elsewhere(eng.model, seen)
    checked_backward(eng, seen)
    v = _role("critic", eng).values(_batch(exp), 2)
    assert v.shape == exp.action_mask.shape and torch.isfinite(v).all()
    logs = update_role(Critic, _rl_config(False), eng, 0, 1).update(exp, kl_coef=0.0, step=1)
    assert torch.isfinite(torch.tensor(logs["value_loss"])) and seen.count("backward") == 4, (logs, seen)


def test_reward_model_scores_on_the_compute_device(tiny_kit):
    from helpers.batching_checks import skewed_experience

    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.load import load_reward_model
    from rlhf.rewards.reward_model import score_sequences

    exp = skewed_experience()
    rm, _ = load_reward_model(os.path.join(tiny_kit, "reward"))
    want = score_sequences(rm, exp.sequences, exp.attention_mask, (0.5, 2.0))
    eng = FSDP2Engine(rm, EngineSpec(lr=0.0, train_batch_size=2, micro_batch_size=2, total_steps=1, trainable=False))
    seen: list = []
    params_elsewhere(eng.model, seen)
    got = _role("reward", eng).scores(_batch(exp), 2, (0.5, 2.0))
    assert seen, "the reward model's forward was not checked"
    assert torch.allclose(got, want, atol=1e-6), (got, want)


def test_compute_device_is_the_engines_device_else_the_collective_device():
    """The contract: an engine's ``device`` (FSDP2Engine's, what it was built for), else comm.device() (the
    DeepSpeed engine keeps none of its own); never a parameter's."""
    from rlhf.distributed import comm
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec, TrainEngine

    eng = FSDP2Engine(torch.nn.Linear(4, 4), EngineSpec(lr=0.1, train_batch_size=1, micro_batch_size=1, total_steps=1))
    eng.device = torch.device("meta")  # as if built for another device: the parameters stay on the CPU
    assert eng.compute_device == torch.device("meta") and next(eng.model.parameters()).device.type == "cpu"

    class NoDevice(TrainEngine):
        backward = step = save_checkpoint = load_checkpoint = full_state_dict = sleep = wake = None

    assert NoDevice().compute_device == comm.device()


@pytest.mark.gpu
def test_adam_offload_sft_and_actor_steps_on_cuda(tiny_kit, tmp_path):
    """On a GPU, --adam_offload --bf16 as the CLI builds it: the shards stay in host memory (CPUOffloadPolicy),
    every forward input and loss is on CUDA, and an SFT step and a PPO actor step (log-probs + update) run."""
    from helpers.batching_checks import skewed_experience, update_role

    from rlhf.config import parse
    from rlhf.distributed import comm
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.load import load_causal_lm
    from rlhf.roles.actor import Actor
    from rlhf.supervised.tasks import SFTTask
    from rlhf.supervised.trainer import SupervisedTrainer

    argv = ["--pretrain", tiny_kit, "--dataset", os.path.join(tiny_kit, "data", "sft_train.jsonl"), "--bf16",
            "--adam_offload", "--max_global_steps", "1", "--train_batch_size", "4", "--micro_train_batch_size", "2",
            "--max_samples", "8", "--save_path", str(tmp_path / "m"), "--log_dir", str(tmp_path / "logs"),
            "--no_progress_bar"]
    tr = SupervisedTrainer(parse("sft", argv), SFTTask, "sft")
    try:
        seen = set()

        def record(mod, args, kwargs):
            seen.update(str(t.device.type) for t in list(args) + list(kwargs.values()) if torch.is_tensor(t))

        tr.engine.model.register_forward_pre_hook(record, with_kwargs=True)
        assert tr.engine.compute_device.type == "cuda"
        assert next(tr.engine.model.parameters()).to_local().device.type == "cpu", "--adam_offload: host shards"
        logs = tr.accumulate(tr.batches_for(0))
        tr.engine.step()
        assert seen == {"cuda"} and all(v == v for v in logs["loss"]), (seen, logs)
        exp = skewed_experience()
        eng = FSDP2Engine(load_causal_lm(tiny_kit), EngineSpec(lr=1e-5, train_batch_size=8, micro_batch_size=2,
                                                               total_steps=2, bf16=True, adam_offload=True),
                          device=tr.engine.compute_device)
        seen.clear()
        eng.model.register_forward_pre_hook(record, with_kwargs=True)
        lp = _role("actor", eng).logprobs(_batch(exp), 1.0, 2, 1024, False)
        assert torch.isfinite(lp).all()
        out = update_role(Actor, _rl_config(False), eng, 0, 1).update(exp, kl_coef=0.1, step=1)
        assert seen == {"cuda"} and out["policy_loss"] == out["policy_loss"], (seen, out)
    finally:
        tr.watchdog.stop()
        comm.destroy()


def test_hub_kernels_stay_off_unless_asked():
    """transformers >= 5.2x turns ``use_kernels`` on by default when the ``kernels`` package is installed
    (transformers/modeling_utils.py ``from_pretrained``; integrations/hub_kernels.py ``_kernels_enabled`` reads
    USE_HUB_KERNELS, default YES), and ``model.train()`` then kernelizes on the parameters' device, which fails on
    the meta probe above and under --adam_offload puts the host's kernels in: rlhf sets USE_HUB_KERNELS=0 unless the
    user set it, in every process that imports it (child processes inherit it)."""
    import subprocess
    import sys

    code = ("import os; os.environ.pop('USE_HUB_KERNELS', None); import rlhf; print(os.environ['USE_HUB_KERNELS'])")
    env = {k: v for k, v in os.environ.items() if k != "USE_HUB_KERNELS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "0", f"importing rlhf must turn transformers' hub kernels off by default, got {out!r}"
    env["USE_HUB_KERNELS"] = "1"
    out = subprocess.run([sys.executable, "-c", "import os, rlhf; print(os.environ['USE_HUB_KERNELS'])"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "1", "a user's USE_HUB_KERNELS must win"
    try:
        from transformers.integrations.hub_kernels import _kernels_enabled
    except ImportError:
        return
    enabled = _kernels_enabled() if callable(_kernels_enabled) else _kernels_enabled
    assert not enabled, "transformers reads hub kernels as enabled in this process"
