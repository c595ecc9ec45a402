"""Every role of an RL job from the placement (``build_roles``): the model roles through ``model_role``, the rollout
engines through the engine registry, the agent executor where --agent_func_path asks."""
from __future__ import annotations

import torch

from rlhf.distributed import Groups
from rlhf.engines.rollout_registry import EngineArgs, EnginePlace, auto_engine, build_engine
from rlhf.engines.train import spec_from_config
from rlhf.models import moe
from rlhf.models.lm_head import use_fp32_head
from rlhf.models.load import load_causal_lm, load_reward_model, load_tokenizer, resolve_pretrain
from rlhf.roles.actor import Actor
from rlhf.roles.base import ModelRole, Roles, frozen_spec, model_role
from rlhf.roles.critic import Critic, load_critic
from rlhf.roles.reference import build_reference
from rlhf.roles.registry import declared_roles
from rlhf.roles.rollout import RolloutRole
from rlhf.roles.routing import route_log
from rlhf.roles.update_batches import update_settings


def build_roles(cfg, groups: Groups, device, total_steps: int) -> Roles:
    """Role objects on every rank from the plan; engines built on the members only.  The RL roles' assembly: it
    reads six groups of the config (model, optim, topology, algorithm, rollout, data) and hands each role builder
    the groups or values that one reads; nothing below it gets ``cfg``."""
    from rlhf.config.batching_checks import dynamic_budgets

    m, o, t = cfg.model, cfg.optim, cfg.topology
    path = resolve_pretrain(m.pretrain)
    settings = update_settings(o, m, cfg.rollout, cfg.data.generate_max_len, dynamic_budgets(cfg)[0])

    def trainable(lr):
        return lambda role: spec_from_config(cfg.model, cfg.optim, cfg.topology, lr, total_steps)

    actor = model_role(Actor, "actor", groups, t.backend, device, trainable(o.actor_learning_rate),
                       lambda on_meta: load_causal_lm(path, m.bf16, m.flash_attn, m.gradient_checkpointing, m.lora_rank,
                                                      m.lora_alpha, m.target_modules, on_meta=on_meta,
                                                      freeze_visual=cfg.vision.freeze_visual_encoder),
                       algo=cfg.algorithm, settings=settings)
    ref = build_reference(m, o, t, groups, path, device, total_steps)
    if m.lm_head_fp32:  # the actor's and the reference's log-probs from float32 logits
        for r in (actor, ref):
            if r is not None and r.engine is not None:
                use_fp32_head(r.engine.model)
    critic = model_role(Critic, "critic", groups, t.backend, device, trainable(o.critic_learning_rate),
                        lambda on_meta: load_critic(m, cfg.algorithm.normalize_reward, path, on_meta),
                        algo=cfg.algorithm, settings=settings)
    stats = {}

    def load_rm(on_meta):
        rm, stats["v"] = load_reward_model(m.reward_pretrain, m.bf16, m.flash_attn, on_meta=on_meta,
                                            value_head_prefix=m.value_head_prefix)
        return rm

    reward = model_role(ModelRole, "reward", groups, t.backend, device, frozen_spec(m, o, t, total_steps), load_rm)
    from rlhf.distributed.placement import flag_groups

    declared = declared_roles(m, o, t, groups, device, total_steps, **flag_groups(cfg))  # the table's, with a builder
    if cfg.rollout.async_train:  # the rollout ranks of their own generate meanwhile (rlhf.rl.async_queue)
        for r in (actor, ref, critic, reward, *declared.values()):
            if r is not None:
                r.gather_group = groups.group("trainers")
    rollout = RolloutRole("rollout", groups.mesh("rollout"))
    if rollout.is_member:
        rollout.engine = build_rollout_engine(cfg.rollout, cfg.topology, path, groups, device, bf16=m.bf16,
                                              seed=cfg.optim.seed,
                                              max_model_len=engine_len(cfg.agent, cfg.rollout, cfg.data),
                                              lora_rank=m.lora_rank if m.lora_sync == "adapter" else 0)
        if cfg.rollout.agent_func_path:
            from rlhf.agents.load import load_agent

            inst, exe = load_agent(cfg.rollout.agent_func_path, endpoint_settings(cfg.agent, cfg.rollout, rollout))
            rollout.agent = exe(inst, cfg.rollout.max_steps, cfg.data.generate_max_len * cfg.rollout.max_steps,
                                rollout.engine, load_tokenizer(path))
            from rlhf.data.images import ImageInputs  # a VLM: episodes carry images (rlhf.agents.episode_images)

            rollout.agent.image_inputs = ImageInputs.from_model_dir(path, cfg.vision.image_key,
                                                                    cfg.vision.max_images_per_prompt)
        elif cfg.agent.tools_path:  # tool episodes (rlhf.agents.tool_agent)
            from rlhf.agents.tool_setup import build_tool_executor

            rollout.agent = build_tool_executor(cfg.agent, cfg.rollout, cfg.data.generate_max_len, rollout.engine,
                                                load_tokenizer(path))
    set_routing(cfg.parallel, actor, ref, rollout)
    set_expert_kernels(cfg.parallel.experts_implementation, critic, reward, rollout)
    from rlhf.rewards.reward_model import reward_model_stats

    return Roles(actor=actor, rollout=rollout, ref=ref, critic=critic, reward=reward, **declared,
                 reward_stats=reward_model_stats(cfg.algorithm.normalize_reward, stats.get("v")))


def engine_len(a, r, d) -> int:
    """The rollout engine's context: ``rl_max_len``, or with --tools_path the prompt and a whole episode
    (--prompt_max_len + --max_episode_tokens: its turns and tool messages)."""
    if not a.tools_path:
        return rl_max_len(d)
    from rlhf.agents.tool_setup import episode_tokens

    return d.prompt_max_len + episode_tokens(a, d.generate_max_len, r.max_steps)


def set_routing(par, actor, ref, rollout) -> None:
    """MoE (``par``: the parallel group): the actor's and reference's expert kernels (--experts_implementation)
    and routing (--router_replay: rlhf.roles.routing); under R3 the rollout engines record their routing."""
    for r in (actor, ref):
        if r is not None and r.engine is not None and moe.routers(r.engine.model):
            moe.set_experts(r.engine.model, par.experts_implementation)
            r.route = route_log(par.router_replay, r.engine.model, actor=r is actor)
        elif r is not None and r.engine is not None and par.router_replay != "off":
            raise RuntimeError(f"--router_replay {par.router_replay}: the {r.name} model has no MoE router (no "
                               f"module with 'gate' and 'experts'); drop the flag for a dense model")
    actor.records_routing = par.router_replay == "R2"
    rollout.routes = par.router_replay == "R3"
    if rollout.routes and rollout.engine is not None and not rollout.engine.record_routing():
        raise RuntimeError(f"--router_replay R3: the rollout engine {type(rollout.engine).__name__} does not return "
                           f"the experts it routed each token to (or the model has no MoE router); use "
                           f"--rollout_engine hf with an MoE model, or --router_replay R2")


def endpoint_settings(a, r, rollout: RolloutRole):
    """The in-job endpoint's Settings on this engine's first rank (rlhf.agents.endpoint): --agent_endpoint_host;
    --agent_endpoint_port P > 0 binds P + the engine's index (each engine its own port), 0 a free port; the
    engine's context limit (``RolloutEngine.max_model_len``); --remote_rm_url scores an OpenRLHF executor's
    result that carries no reward (as OpenRLHF's reward model group does)."""
    from rlhf.agents.endpoint.hub import Settings
    from rlhf.rewards.reward_func import make_reward_source

    port = a.agent_endpoint_port + rollout.engine_index if a.agent_endpoint_port else 0
    return Settings(a.agent_endpoint_host, port, rollout.engine.max_model_len,
                    make_reward_source(r.remote_rm_url, r.reward_timeout_s, retries=r.remote_rm_retries),
                    tool_call_parser=a.tool_call_parser)


def set_expert_kernels(implementation: str, critic, reward, rollout) -> None:
    """--experts_implementation for the roles ``set_routing`` leaves: the critic, the reward model and the rollout
    engine's own copy of the policy (the HF engine; vLLM keeps its fused MoE).  A dense model: nothing."""
    for r in (critic, reward):
        if r is not None and r.engine is not None:
            moe.set_experts(r.engine.model, implementation)
    if rollout.engine is not None:
        rollout.engine.set_experts_implementation(implementation)


def rl_max_len(d) -> int:
    """Prompt + response tokens of one sample: --prompt_max_len + --generate_max_len, within RL's --max_len (OpenRLHF's
    prompt + response budget, its vLLM max_model_len; rlhf.config.openrlhf_meaning); ``d``: the data group."""
    return min(d.prompt_max_len + d.generate_max_len, d.max_len)


def lora_versions(r) -> int:
    """Adapter versions an engine keeps (--lora_sync adapter): under --async_train the K queued batches' versions
    and the current one (--async_queue_size + 1), else 1."""
    return r.async_queue_size + 1 if r.async_train else 1


def engines_in_process(r, path: str) -> bool:
    """Do the rollout engines load weights in the trainer's process (the ``hf`` engine; vLLM on rollout ranks of
    their own runs in processes of its own)?  The same answer on every rank (``auto_engine`` is)."""
    kind = r.rollout_engine if r.rollout_engine != "auto" else auto_engine(path, torch.cuda.is_available())[0]
    return kind == "hf"


def build_rollout_engine(r, t, path: str, groups: Groups, device, *, bf16: bool, seed: int, max_model_len: int,
                         lora_rank: int = 0):
    """The rollout engine of this rank, from the registry (rlhf.engines.rollout_registry): --rollout_engine, or what
    ``auto`` picks (said once, by rank 0), built from the engine's flags (``r`` the rollout config, ``t`` the
    topology; ``seed`` --seed: engine i gets seed + i) and its place in the placement."""
    kind = r.rollout_engine
    if kind == "auto":
        kind, why = auto_engine(path, torch.cuda.is_available())
        if groups.rank == 0:
            print(f"[rollout] --rollout_engine auto -> {kind} ({why})", flush=True)
    plan = groups.plan
    index = plan.engine_of(groups.rank)
    place = EnginePlace(groups.rank, plan.engine_ranks[index], tp_group=groups.mesh("rollout").group_of("tp"),
                        # in-process vLLM takes the whole default group as its world: only when every rank holds one
                        separate=plan.ranks["rollout"] != list(range(plan.world_size)),
                        gpus_per_node=plan.gpus_per_node)
    args = EngineArgs(path, device, max_model_len, seed=seed + index, bf16=bf16,
                      micro_batch_size=r.micro_rollout_batch_size, tp_size=t.vllm_tensor_parallel_size,
                      gpu_memory_utilization=r.vllm_gpu_memory_utilization, enable_sleep=t.vllm_enable_sleep,
                      sleep_level=r.vllm_sleep_level, enforce_eager=r.enforce_eager, place=place,
                      lora_rank=lora_rank, lora_versions=lora_versions(r))
    return build_engine(kind, args)
