"""--tp_size, --fsdp_shard_size and --ep_size against the backend, the trainer, the models' heads and every role's ranks: a
ConfigError naming the flag and a value that works, before any process group (rlhf.config.preflight)."""
from __future__ import annotations

from rlhf.errors import ConfigError, TopologyError

RL_KINDS = ("ppo", "grpo")


def check_tensor_parallel(cfg, kind: str, world: int) -> None:
    check_expert_parallel(cfg, kind, world)
    p, m = cfg.parallel, cfg.model
    tp, shard = int(p.tp_size), int(p.fsdp_shard_size)
    if tp < 1:
        raise ConfigError("tp_size", f"--tp_size must be >= 1, got {tp}; e.g. --tp_size 1")
    if shard < 0:
        raise ConfigError("fsdp_shard_size", f"--fsdp_shard_size must be >= 0, got {shard}; 0 shards over every "
                                             f"data-parallel rank")
    if tp == 1 and shard == 0:
        return
    flag = "tp_size" if tp > 1 else "fsdp_shard_size"
    if cfg.topology.backend != "fsdp2":  # DeepSpeed's AutoTP is not wired here: refused, not mapped
        raise ConfigError(flag, f"--{flag} {tp if tp > 1 else shard} needs --backend fsdp2 (DeepSpeed AutoTP / "
                                f"hpZ are not used here); use --backend fsdp2 or --{flag} {1 if tp > 1 else 0}")
    if kind not in RL_KINDS:
        raise ConfigError(flag, f"--{flag}: train_ppo / train_grpo only here (the {kind} trainer shards over "
                                f"FSDP2 alone); use --{flag} {1 if tp > 1 else 0}")
    if tp > 1 and m.lora_rank > 0:
        raise ConfigError("tp_size", f"--tp_size {tp} with --lora_rank {m.lora_rank}: LoRA layers have no TP plan "
                                     f"here; use --tp_size 1 or --lora_rank 0")
    if tp > 1:
        _check_heads(cfg, tp)
    from rlhf.distributed.groups import nnodes_from_env
    from rlhf.distributed.placement import make_placement, role_needs

    try:
        make_placement(cfg.topology, world, cfg.topology.nnodes_hint or nnodes_from_env(), parallel=p,
                       **role_needs(cfg.algorithm, m))
    except TopologyError as e:
        if "--tp_size" in str(e) or "--fsdp_shard_size" in str(e):
            raise ConfigError("fsdp_shard_size" if "--fsdp_shard_size" in str(e) else "tp_size", str(e)) from None


def _check_heads(cfg, tp: int) -> None:
    """Every model of the job (policy, reference, critic, reward) has a plan and heads divisible by tp x sp."""
    from rlhf.distributed.sequence_parallel import model_heads
    from rlhf.distributed.tensor_parallel import TP_FAMILIES, check_heads
    from rlhf.models.load import resolve_pretrain

    m = cfg.model
    for path in {resolve_pretrain(m.pretrain), m.ref_pretrain, m.critic_pretrain, m.reward_pretrain} - {None, ""}:
        kind = _model_type(path)
        if kind is not None and kind not in TP_FAMILIES:
            raise ConfigError("tp_size", f"--tp_size {tp}: no tensor-parallel plan for the {kind!r} architecture "
                                         f"of {path} (plans: {', '.join(TP_FAMILIES)}); use --tp_size 1")
        heads = model_heads(path)
        if heads is not None:
            try:
                check_heads(heads[0], heads[1], tp, cfg.topology.ring_attn_size)
            except ValueError as e:
                raise ConfigError("tp_size", f"{path}: {e}") from None


def _model_type(path: str):
    import json
    import os

    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        return None
    with open(f) as fh:
        c = json.load(fh)
    return c.get("text_config", c).get("model_type")


def check_expert_parallel(cfg, kind: str, world: int) -> None:
    """--ep_size: FSDP2, PPO/GRPO, alone (no TP, HSDP, SP or LoRA), an MoE policy (and reference) whose experts it
    divides, and the actor's and reference's ranks it divides."""
    p, m, t = cfg.parallel, cfg.model, cfg.topology
    ep = int(p.ep_size)
    if ep < 1:
        raise ConfigError("ep_size", f"--ep_size must be >= 1, got {ep}; e.g. --ep_size 1")
    if ep == 1:
        return
    no = "use --ep_size 1 or "
    if t.backend != "fsdp2":
        raise ConfigError("ep_size", f"--ep_size {ep} needs --backend fsdp2; {no}--backend fsdp2")
    if kind not in RL_KINDS:
        raise ConfigError("ep_size", f"--ep_size: train_ppo / train_grpo only here (not {kind}); use --ep_size 1")
    for flag, val, off in (("tp_size", int(p.tp_size), 1), ("fsdp_shard_size", int(p.fsdp_shard_size), 0),
                           ("ring_attn_size", int(t.ring_attn_size or 1), 1), ("lora_rank", int(m.lora_rank), 0),
                           ("adam_offload", int(bool(t.adam_offload)), 0)):
        if val != off:
            raise ConfigError("ep_size", f"--ep_size {ep} with --{flag} {val} is not supported here; {no}--{flag} {off}")
    from rlhf.models.load import resolve_pretrain

    for path in {resolve_pretrain(m.pretrain), m.ref_pretrain} - {None, ""}:
        n = _experts(path)
        if n == 0:
            raise ConfigError("ep_size", f"--ep_size {ep}: {path} is not a mixture-of-experts model (no num_experts "
                                         f"in its config.json); use --ep_size 1")
        if n is not None and n % ep:
            ok = [k for k in range(1, n + 1) if n % k == 0]
            raise ConfigError("ep_size", f"--ep_size {ep} must divide the {n} experts of {path}; use one of {ok}")
    from rlhf.distributed.groups import nnodes_from_env
    from rlhf.distributed.placement import make_placement, role_needs

    try:
        make_placement(t, world, t.nnodes_hint or nnodes_from_env(), parallel=p, **role_needs(cfg.algorithm, m))
    except TopologyError as e:
        if "--ep_size" in str(e):
            raise ConfigError("ep_size", str(e)) from None


def _experts(path: str):
    """The expert count in ``path``'s config.json (Qwen3-MoE/Qwen2-MoE ``num_experts``, Mixtral
    ``num_local_experts``); 0: a dense model; None: no config.json to read."""
    import json
    import os

    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        return None
    with open(f) as fh:
        c = json.load(fh)
    c = c.get("text_config", c)
    return int(c.get("num_experts") or c.get("num_local_experts") or 0)
