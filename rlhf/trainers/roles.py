"""Build the role objects this rank holds (actor, ref, critic, reward, rollout) from the plan."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from rlhf.backends.base import EngineSpec, make_engine
from rlhf.distributed import Groups
from rlhf.models.load import load_causal_lm, load_reward_model, load_tokenizer, resolve_pretrain
from rlhf.rollout.hf_engine import HFEngine


@dataclass
class Roles:
    actor: Optional[object] = None       # TrainEngine
    ref: Optional[object] = None         # TrainEngine (frozen)
    critic: Optional[object] = None      # TrainEngine
    reward: Optional[object] = None      # TrainEngine (frozen) holding the sequence-classification RM
    reward_stats: tuple = (0.0, 1.0)
    rollout: Optional[object] = None     # RolloutEngine
    agent: Optional[object] = None       # AgentExecutor driving the rollout engine (--agent_func_path)

    def sleepables(self) -> Dict[str, object]:
        return {k: v for k, v in (("actor", self.actor), ("ref", self.ref), ("critic", self.critic),
                                  ("reward", self.reward), ("rollout", self.rollout)) if v is not None}


def meta_init(topo, groups: Groups, role: str) -> bool:
    """Load real weights on rank 0 only when the role spans the whole world under FSDP2 (hybrid engine)."""
    import torch.distributed as dist

    return topo.backend == "fsdp2" and groups.group(role) is dist.group.WORLD and groups.plan.world_size > 1


def build_roles(cfg, groups: Groups, device, total_steps: int, need_ref: bool, need_critic: bool) -> Roles:
    m, o, t = cfg.model, cfg.optim, cfg.topology
    path = resolve_pretrain(m.pretrain)
    roles = Roles()
    spec_common = dict(train_batch_size=o.train_batch_size, micro_batch_size=o.micro_train_batch_size,
                       total_steps=max(1, total_steps), bf16=m.bf16, zero_stage=t.zero_stage, max_norm=o.max_norm,
                       weight_decay=o.weight_decay, betas=o.adam_betas, warmup_ratio=o.lr_warmup_ratio,
                       scheduler=o.lr_scheduler, offload=t.deepspeed_enable_sleep)

    def engine(role, spec, load):
        """The role's engine over its ranks; ``load(on_meta)`` builds the model (weights on rank 0 only if meta)."""
        meta = meta_init(t, groups, role)
        return make_engine(t.backend, load(meta and groups.rank != 0), spec, group=groups.group(role), device=device,
                           broadcast_from_rank0=meta)

    def frozen(role):
        spec = EngineSpec(lr=0.0, trainable=False, **spec_common)
        spec.train_batch_size = spec.micro_batch_size * groups.role_size(role)
        return spec

    if groups.has("actor"):
        roles.actor = engine("actor", EngineSpec(lr=o.actor_learning_rate, **spec_common), lambda on_meta: load_causal_lm(
            path, m.bf16, m.flash_attn, m.gradient_checkpointing, m.lora_rank, m.lora_alpha, m.target_modules,
            on_meta=on_meta))
    if need_ref and groups.has("ref"):
        roles.ref = engine("ref", frozen("ref"), lambda on_meta: load_causal_lm(
            m.ref_pretrain or path, m.bf16, m.flash_attn, on_meta=on_meta))
    if need_critic and groups.has("critic"):
        from rlhf.models.critic import CriticModel

        roles.critic = engine("critic", EngineSpec(lr=o.critic_learning_rate, **spec_common), lambda on_meta:
                              CriticModel.from_pretrained(m.critic_pretrain or path, m.gradient_checkpointing,
                                                          on_meta=on_meta))
    if m.reward_pretrain and groups.has("reward"):
        def load_rm(on_meta):
            rm, roles.reward_stats = load_reward_model(m.reward_pretrain, m.bf16, m.flash_attn, on_meta=on_meta)
            return rm

        roles.reward = engine("reward", frozen("reward"), load_rm)
    if groups.has("rollout"):
        roles.rollout = build_rollout_engine(cfg, path, groups, device)
        if cfg.rollout.agent_func_path:
            from rlhf.agents.base import load_agent

            inst, exe = load_agent(cfg.rollout.agent_func_path)
            roles.agent = exe(inst, cfg.rollout.max_steps, cfg.data.generate_max_len * cfg.rollout.max_steps,
                              roles.rollout, load_tokenizer(path))
    return roles


def build_rollout_engine(cfg, path: str, groups: Groups, device):
    """The rollout engine of this rank.  vLLM: inside the trainer's process when every rank of the job holds an
    engine (hybrid engine), else (rollout ranks of their own, or other roles on ranks of their own) in vLLM's own
    processes, started by each engine's first rank (its other ranks lend their devices and build nothing)."""
    r, t = cfg.rollout, cfg.topology
    kind = r.rollout_engine
    if kind == "auto":
        from rlhf.rollout.vllm_engine import auto_engine

        kind, why = auto_engine(path, torch.cuda.is_available())
        if groups.rank == 0:
            print(f"[rollout] --rollout_engine auto -> {kind} ({why})", flush=True)
    tok = load_tokenizer(path)
    if kind == "vllm":
        from rlhf.rollout.vllm_engine import VLLMEngine

        plan = groups.plan
        ranks = plan.engines[plan.engine_of(groups.rank)]
        # in-process vLLM takes the whole default group as its world: only when every rank holds an engine
        separate = plan.roles["rollout"] != list(range(plan.world_size))
        return VLLMEngine(path, t.vllm_tensor_parallel_size, mode="separate" if separate else "colocated",
                          max_model_len=cfg.data.prompt_max_len + cfg.data.generate_max_len, seed=cfg.optim.seed,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          dtype="bfloat16" if cfg.model.bf16 else "float32",
                          gpu_memory_utilization=r.vllm_gpu_memory_utilization, enable_sleep=t.vllm_enable_sleep,
                          sleep_level=r.vllm_sleep_level, enforce_eager=r.enforce_eager or device.type == "cpu",
                          tp_group=groups.engine, tp_src=ranks[0], driver=groups.rank == ranks[0],
                          device_ids=[k % plan.gpus_per_node for k in ranks],
                          log=print if groups.rank == ranks[0] else (lambda *_: None))
    model = load_causal_lm(path)
    model.config.use_cache = True
    return HFEngine(model, tok, device, micro_batch_size=r.micro_rollout_batch_size * r.n_samples_per_prompt)
