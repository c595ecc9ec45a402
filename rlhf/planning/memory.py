"""The memory plan of a job: per rank group and per stage, the peak device memory, built from the terms in
``rlhf.planning.terms`` (each a pure function with its formula) and the placement (``rlhf.distributed.placement``,
the one place that decides which roles sit on which rank).

A stage's peak = the states of every role resident during it + what the stage itself allocates (activations, the
LM head's chunks, a KV cache, vLLM's share) + a fixed runtime reserve on CUDA (context, cuBLAS workspace, NCCL
buffers).  Which roles are resident follows the phase scheduler (rlhf/distributed/phases.py): colocated with
--vllm_enable_sleep or --deepspeed_enable_sleep, only the stage's role (and the one it shares with) is awake and the
others sleep on the host; otherwise every role of the rank stays on the device and vLLM keeps its whole share.

Stages: shard (FSDP2: the roles' parameters as they load, plus the one full tensor a load moves at a time),
load (every role's parameters, then vLLM takes its share: vLLM refuses to start otherwise), then the step's stages
as rlhf.stage_table declares them, each by its memory kind: RL rollout, reward, ref, values, old_logprobs,
critic_update, actor_update, weight_sync (the rows of ``RL_STAGES`` the RL loop's stage classes take); supervised
ref (DPO), train.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from rlhf.planning import terms
from rlhf.planning.dims import ModelDims
from rlhf.planning.job import DEFAULT_GPU_GB, Job
from rlhf.planning.plan_types import GroupPlan, MemoryPlan, RoleModel, Stage
from rlhf.planning.terms import GiB, States
from rlhf.stage_table import RL_STAGES, SUPERVISED_STAGES, awake, with_declared_forwards

CUDA_RESERVE = 1.5 * GiB       # CUDA context + cuBLAS workspace + NCCL buffers per rank (assumed; measured on the


                               # GPU check: see README "Memory planner")
CPU_HEAD_COPY_MIN = 1 << 20    # rlhf/engines/sampling.py SMALL_HEAD: smaller heads get no transposed copy


SYNC_BUCKET = 256 << 20        # WeightSync's default bucket (rlhf/distributed/weight_sync.py), two in flight


# ---- the stages ------------------------------------------------------------------------------------------------
def role_states(job: Job, rm: RoleModel) -> States:
    d = rm.dims
    if job.backend == "deepspeed":
        return terms.deepspeed_states(rm.n, rm.ranks, job.bf16, job.zero_stage, rm.trainable, d.layer_params,
                                      job.adam_offload and rm.trainable, rm.adapters)
    tp, shard = fsdp_layout(job, rm.ranks)  # --tp_size splits every layer, FSDP2 shards the rest over the shard group
    if job.ep_size > 1 and rm.lm and d.experts:  # --ep_size (actor, ref): experts / ep per rank, outside FSDP2
        return terms.ep_states(job, rm, shard)
    return terms.fsdp2_states(rm.n // tp, shard, job.c, job.zero_stage, rm.trainable, d.layer_params // tp,
                              (d.root_params if rm.lm else d.embed_params + 2 * d.hidden) // tp,
                              job.adam_offload and rm.trainable, job.grad_accum_no_sync and rm.trainable, rm.adapters)


def fsdp_layout(job: Job, ranks: int) -> Tuple[int, int]:
    """(tp, ranks a model's FSDP2 shards span) of a model role on ``ranks``: TP over --tp_size, FSDP2 over the
    other ranks / tp, or only over --fsdp_shard_size of them (HSDP: replicated across the shard groups)."""
    tp = max(1, job.tp_size) if job.backend == "fsdp2" else 1
    fsdp = max(1, ranks // tp)
    return tp, (job.fsdp_shard_size if 0 < job.fsdp_shard_size < fsdp else fsdp)


def _tokens(job: Job, micro: int, max_tokens: Optional[int]) -> Tuple[int, int]:
    """(b, s) of one micro-batch at the longest sequences: micro x seq, or with --use_dynamic_batch as many
    full-length rows as the token budget holds (at least one: a longer row gets a micro-batch of its own)."""
    if job.use_dynamic_batch:  # the budget is per GPU: an SP group's micro-batch holds budget x SP tokens
        budget = (max_tokens if max_tokens is not None else job.train_max_tokens_per_gpu) * max(1, job.ring_attn_size)
        return max(1, budget // job.seq), job.seq
    return micro, job.seq


def head_fused(job: Job) -> bool:
    """Whether the LM head runs fused (rlhf/models/lm_head.py ``fusable_head``): not over ZeRO-3 partitioned weights
    (DeepSpeed --zero_stage 3), where the model's own forward computes every token's logits."""
    return not (job.backend == "deepspeed" and job.zero_stage >= 3)


def _forward(job: Job, d: ModelDims, b: int, s: int, grad: bool, lm: bool, dp: int = 1) -> Dict[str, float]:
    sp, tp = max(1, job.ring_attn_size), fsdp_layout(job, 1)[0]
    c = job.c
    if grad:
        act = terms.activation_bytes(d, b, s, c, job.attn, job.gradient_checkpointing, sp, tp)
    else:
        act = terms.inference_activation_bytes(d, b, s, c, job.attn, sp, tp)
    out = {"activations": act}
    head = 0.0
    if lm:
        fused = head_fused(job)
        tokens = -(-b * s // sp)
        rows = tokens * job.response_len // max(1, job.seq) if fused else tokens  # unfused: every token's logits
        head = terms.lm_head_bytes(rows, -(-d.vocab // tp), c, job.logprob_chunk_size, max(0, job.lm_head_keep_mb) << 20, grad,
                                   fused)
        if grad:  # the head runs while the activations are kept for backward
            out["logits"] = head
        elif head > act:  # no graph: the blocks' buffers are gone when the head runs; the larger one is the peak
            out = {"logits": head}
    if grad and job.backend == "fsdp2":  # the root's gradients come last, when the activations are freed
        root = terms.root_grad_bytes(d, c, c < 4 or job.adam_offload or dp > 1, lm)
        if root > act + head:
            out = {"root:grads": root}
    return out


def _rollout_parts(job: Job, d: ModelDims, tp: int, device_bytes: float, on_cuda: bool = True) -> Dict[str, float]:
    if job.rollout_engine == "vllm":
        return {"rollout:vllm": terms.vllm_share_bytes(job.vllm_gpu_memory_utilization, device_bytes)}
    # HF engine (rlhf/engines/hf_engine.py): its own model copy, a KV cache for a micro-batch, one decode step's
    # logits and the prefill's activations; on CPU also the transposed head copy (rollout/sampling.py logits_head)
    # The peak is the later of two moments: the prefill (the prompts' KV + one block's buffers over P tokens)
    # or the last decode step (the whole KV cache + one step's logits).
    b, s, P = job.micro_rollout_batch_size, job.seq, job.prompt_max_len
    kv = terms.kv_cache_bytes(d, b, s, job.c)
    prefill = terms.kv_cache_bytes(d, b, P, job.c) + terms.inference_activation_bytes(d, b, P, job.c, "sdpa")
    out = {"rollout:params": float(job.c * d.params), "rollout:kv": kv,
           "rollout:logits": float(b * d.vocab * (job.c + 8)), "rollout:activations": max(0.0, prefill - kv)}
    if not on_cuda and d.vocab * d.hidden >= CPU_HEAD_COPY_MIN:
        out["rollout:head_copy"] = float(job.c * d.vocab * d.hidden)
    return out


def _resident(job: Job, name: str, st: States, asleep: bool, trainable: bool) -> Dict[str, float]:
    """A sleeping role holds nothing, except a frozen DeepSpeed ZeRO-3 model: its sleep only empties the gathered
    parameters' cache, the partitions stay (rlhf/engines/deepspeed_engine.py ``sleep``)."""
    if asleep and not (job.backend == "deepspeed" and not trainable and job.zero_stage >= 3):
        return {}
    return {f"{name}:params": st.params, f"{name}:grads": st.grads, f"{name}:optimizer": st.optimizer}


def weights_only_wake(job: Job, sleeping: bool) -> bool:
    """Whether a role woken from sleep for a forward-only stage (reward, ref, values, old log-probs) leaves its
    optimizer state on the host: FSDP2's ``wake`` brings the weights only and ``step`` brings the optimizer state
    (rlhf/engines/fsdp2.py ``wake`` / ``_onload_optimizer``; veRL's ``load_fsdp_optimizer`` in ``update_actor``
    only).  DeepSpeed's wake reloads every state (``reload_states``).  Without sleep everything stays resident.
    The weight sync follows the actor's update with the actor still awake, so its optimizer state is there."""
    return sleeping and job.backend == "fsdp2"


def group_stages(job: Job, roles: Dict[str, RoleModel], rollout_tp: int, device_bytes: float,
                 on_cuda: bool = True, scheduled: bool = True) -> Tuple[List[Stage], float]:
    """The stages of one rank holding ``roles`` (role -> RoleModel; "rollout" -> the actor's model) and its host
    bytes per rank.  Colocated with sleep, a stage keeps only its own role (and the one it shares) awake.
    ``scheduled``: the phase scheduler puts roles to sleep at all, which the RL trainer does only when every role
    shares every rank (rlhf/rl/trainer.py: ``enabled=self.plan.colocated and (...)``); the supervised
    trainers never do."""
    states = {r: role_states(job, m) for r, m in roles.items() if r != "rollout"}
    reserve = {"runtime": CUDA_RESERVE} if on_cuda else {}
    sleeping = scheduled and job.sleeps and len(roles) > 1
    stages: List[Stage] = []

    def resident(awake: Tuple[str, ...], first_step: bool = False, updating: str = "",
                 forward_only: bool = False, engine_apart: bool = True) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for r, st in states.items():
            part = _resident(job, r, st, sleeping and r not in awake, roles[r].trainable)
            if first_step:  # at load nothing has stepped: no gradients, no optimizer state yet
                part = {k: v for k, v in part.items() if k.endswith(":params")}
            if forward_only and r in awake and weights_only_wake(job, sleeping):
                part.pop(f"{r}:optimizer", None)
            if r != updating:  # gradients live from the first backward to the step's zero_grad(set_to_none=True)
                part.pop(f"{r}:grads", None)
            out.update(part)
        if "rollout" in roles and engine_apart and not sleeping:  # an engine that never sleeps holds its share
            out.update(_rollout_parts(job, roles["rollout"].dims, rollout_tp, device_bytes, on_cuda))
        return out

    def add(name: str, awake: Tuple[str, ...], extra: Dict[str, float], updating: str = "", first_step: bool = False,
            forward_only: bool = False, engine_apart: bool = True):
        """``engine_apart``: the rollout engine's memory is not in ``extra`` (every stage but shard, load and
        the rollout itself)."""
        parts = dict(reserve)
        parts.update(resident(awake, first_step=first_step or name == "load", updating=updating,
                              forward_only=forward_only, engine_apart=engine_apart))
        for k, v in extra.items():
            parts[k] = parts.get(k, 0.0) + v
        stages.append(Stage(name, parts))

    if job.backend == "fsdp2" and states:  # the roles load one after another, before the rollout engine starts
        # (so "rollout" counts as awake: no vLLM share yet): the last role's one-tensor transient at most.  A role
        # on one rank reads its checkpoint itself and moves it tensor by tensor (``module.to`` / ``fully_shard``):
        # no broadcast buffer (rlhf/engines/train.py ``loads_on_first``: FSDP2 over more than one rank)
        transient = max(terms.load_transient_bytes(m.dims, terms.stored_bytes(job.c, m.trainable, m.adapters > 0))
                        if m.ranks > 1 else 0.0 for r, m in roles.items() if r != "rollout")
        add("shard", tuple(states) + ("rollout",), {"load:transient": transient} if transient else {},
            first_step=True, engine_apart=False)
    load_extra = {}
    if "rollout" in roles:
        load_extra = _rollout_parts(job, roles["rollout"].dims, rollout_tp, device_bytes, on_cuda)
    add("load", tuple(states) + ("rollout",), load_extra, engine_apart=False)
    b_inf, s_inf = _tokens(job, job.micro_rollout_batch_size, job.rollout_max_tokens_per_gpu)
    b_tr, s_tr = _tokens(job, job.micro_train_batch_size, job.train_max_tokens_per_gpu)
    # the step's stages as declared (rlhf.stage_table), each planned by its memory kind where its role is here
    rows = (with_declared_forwards(RL_STAGES, [n for n, _ in _declared_forwards(job)]) if job.kind == "rl"
            else SUPERVISED_STAGES)
    for row in rows:
        r, kind, on = row.role, row.memory, awake(row)
        if kind == "rollout" and "rollout" in roles:
            add(row.name, on, _rollout_parts(job, roles["rollout"].dims, rollout_tp, device_bytes, on_cuda),
                engine_apart=False)
        elif kind in ("forward", "pair_forward") and r in roles:
            m = roles[r]
            if kind == "forward":
                fwd = _forward(job, m.dims, b_inf, s_inf, False, m.lm)
            else:  # DPO: the chosen + rejected rows of a training micro-batch, every position's logits
                fwd = _forward(job, m.dims, 2 * job.micro_train_batch_size, job.seq, False, True)
            add(row.name, on, {f"{r}:gathered": states[r].gathered, **fwd}, forward_only=kind == "forward")
        elif kind == "update" and r in roles and roles[r].trainable:
            m = roles[r]
            b = 2 * b_tr if job.kind in ("dpo", "rm") else b_tr
            fwd = _forward(job, m.dims, b, s_tr, True, m.lm, m.ranks)
            add(row.name, on, {f"{r}:gathered": states[r].gathered, **fwd}, updating=r)
        elif kind == "sync" and ("rollout" in roles or "actor" in roles):
            add(row.name, on, _sync_parts(job, roles, rollout_tp, sleeping))
    # host memory per rank: every sleeping role's resident states (all asleep during the rollout), the
    # optimizer offload, and vLLM's level-1 sleep copy of its weights (start-up, eval)
    host = sum(st.host for st in states.values())
    if sleeping:
        host += sum(st.params + st.optimizer for st in states.values())  # gradients are freed after each step
        if "rollout" in roles and job.rollout_engine == "vllm":
            host += terms.vllm_weight_bytes(roles["rollout"].dims.params, rollout_tp)
    return stages, host


def _declared_forwards(job: Job) -> List[Tuple[str, str]]:
    """(role, stage) of the role table's declared forward stages, after the reference's (rlhf.rl.stages
    ``declared_forwards``); RL only (the table's import brings torch)."""
    if job.kind != "rl":
        return []
    from rlhf.distributed.role_table import ROLE_TABLE

    return [(d.name, d.name) for d in ROLE_TABLE.values() if d.forward]


def _sync_copies(job: Job, actor: RoleModel) -> bool:
    """Whether the sync's gather makes new tensors (``weight_sync.full_tensor``): a sharded FSDP2 model (over
    several ranks, or under --bf16 / --adam_offload, rlhf/engines/fsdp2.py ``sharded``) all-gathers, ZeRO-3
    copies each gathered parameter out, a LoRA layer is merged into a new tensor; a plain model already in the
    sync dtype (one rank in fp32, DeepSpeed ZeRO < 3) hands its parameters over as they are."""
    if actor.adapters:
        return True
    if job.backend == "deepspeed":
        return job.zero_stage >= 3
    return actor.ranks > 1 or job.c < 4 or job.adam_offload


def _sync_parts(job: Job, roles: Dict[str, RoleModel], rollout_tp: int, sleeping: bool) -> Dict[str, float]:
    """The weight sync on one rank (rlhf/distributed/weight_sync.py): every weight is gathered in the engine's
    dtype (c: bf16 under --bf16, ``full_tensor(p, dtype)``) straight into buckets of SYNC_BUCKET
    (``terms.sync_bucket_bytes``); what each side holds is ``terms.sync_buffer_bytes``:

        actor + rollout (colocated)   "colocated"
        actor, rollout apart          "sender" (the actor group's first rank packs and sends)
        rollout apart                 "receiver"

    plus, on actor ranks, the gather's own transient (``terms.sync_gathering_bytes``) and, under --lora_rank, the
    fp32 merge of the largest adapted weight (``terms.lora_merge_bytes``)."""
    actor = roles.get("actor") or roles.get("rollout")
    d, c = actor.dims, job.c
    bucket = terms.sync_bucket_bytes(d, c, SYNC_BUCKET)
    vllm = job.rollout_engine == "vllm"
    side = "colocated" if ("actor" in roles and "rollout" in roles) else "sender" if "actor" in roles else "receiver"
    copies = "actor" in roles and _sync_copies(job, roles["actor"])
    out: Dict[str, float] = {"sync:buffer": terms.sync_buffer_bytes(side, bucket, c * d.layer_params, copies, vllm)}
    if "actor" in roles:
        a = roles["actor"]
        zero3 = job.backend == "deepspeed" and job.zero_stage >= 3
        cast_shard = job.backend == "fsdp2" and terms.stored_bytes(c, True, a.adapters > 0) != c
        out["sync:gathering"] = terms.sync_gathering_bytes(d, c, a.ranks, cast_shard, zero3)
        if a.adapters:
            out["sync:lora_merge"] = terms.lora_merge_bytes(d, c, job.target_modules, copies)
    # rollout ranks of their own hold vLLM's whole share while they receive buckets: ``resident`` counts it
    # already (the rollout role is not asleep there), so only a sleeping engine's woken weights are added
    if "rollout" in roles and vllm and sleeping:
        out["rollout:vllm"] = terms.vllm_weight_bytes(d.params, rollout_tp)
    return {k: v for k, v in out.items() if v}


def _load_host(job: Job, roles: Dict[str, RoleModel]) -> float:
    """Host bytes at load on the rank that reads the checkpoints of ``roles`` (FSDP2: each role's first rank;
    the roles load one after another and each host copy is emptied as it is sent: the largest one)."""
    if job.backend != "fsdp2":
        return 0.0
    return max((terms.load_host_bytes(m.n, terms.stored_bytes(job.c, m.trainable, m.adapters > 0), m.adapters)
                for r, m in roles.items() if r != "rollout"), default=0.0)


def plan_memory(job: Job, dims: Dict[str, ModelDims], placement=None, world: int = 1,
                device_bytes: float = DEFAULT_GPU_GB * GiB, on_cuda: bool = True) -> MemoryPlan:
    """The plan for every distinct rank group.  ``dims``: role -> ModelDims (actor, and where they differ, ref,
    critic, reward; missing ones are the actor's).  RL needs ``placement``; supervised jobs use ``world``."""
    actor = dims["actor"]
    adapters = terms.lora_adapter_params(actor, job.lora_rank, job.target_modules) if job.lora_rank > 0 else 0
    if job.kind != "rl":
        roles = {"actor": RoleModel(actor, world, True, job.kind != "rm", adapters)}
        if job.kind == "dpo":
            roles["ref"] = RoleModel(dims.get("ref", actor), world, False, True)
        stages, host = group_stages(job, roles, 1, device_bytes, on_cuda, scheduled=False)
        return MemoryPlan(job, device_bytes, [GroupPlan(list(range(world)), list(roles), stages, host,
                                                        _load_host(job, roles))],
                          ranks_per_node=min(world, 8), dims=actor)
    from rlhf.distributed.role_table import ROLE_TABLE  # (imports torch: only where an RL placement exists)

    groups: Dict[Tuple[str, ...], List[int]] = {}
    for rank in range(placement.world_size):
        groups.setdefault(tuple(placement.roles_of(rank)), []).append(rank)
    out = []
    for held, ranks in groups.items():
        roles = {}
        for r in held:
            n = len(placement.ranks[r])
            if r == "rollout":
                roles[r] = RoleModel(actor, n, False, True)
            else:
                lm = r in ("actor", "ref") or bool(ROLE_TABLE[r].forward)  # a declared forward: log-probs
                roles[r] = RoleModel(dims.get(r, actor), n, r in ("actor", "critic"), lm,
                                     adapters if r == "actor" else 0)
        stages, host = group_stages(job, roles, job.vllm_tensor_parallel_size, device_bytes, on_cuda,
                                    scheduled=placement.colocated)
        sources = {r: m for r, m in roles.items() if r != "rollout" and placement.ranks[r][0] in ranks}
        out.append(GroupPlan(ranks, list(held), stages, host, _load_host(job, sources)))
    return MemoryPlan(job, device_bytes, out, ranks_per_node=placement.gpus_per_node, dims=actor)


def role_dims(model, **groups) -> Dict[str, ModelDims]:
    """Each role's dimensions from its config.json, the paths in ``model`` (the --model flag group): --pretrain
    (the built-in kit when unset), --ref_pretrain, --critic_pretrain (default --pretrain), --reward_pretrain, and
    each declared role's ``pretrain`` flag (rlhf.distributed.role_table), read from ``model`` or the flag group
    it declares (``groups``: ``teacher=cfg.teacher``)."""
    from rlhf.distributed.role_table import ROLE_TABLE
    from rlhf.models.load import resolve_pretrain
    from rlhf.planning.dims import dims_of

    m = model
    actor = dims_of(resolve_pretrain(m.pretrain))
    out = {"actor": actor}
    for role, path in (("ref", m.ref_pretrain), ("critic", m.critic_pretrain), ("reward", m.reward_pretrain)):
        if path:
            out[role] = dims_of(path)
    for decl in ROLE_TABLE.values():  # a declared role loading a model flag (rlhf.distributed.role_table)
        g = m if decl.flags == "model" else groups.get(decl.flags)
        if decl.pretrain and g is not None and getattr(g, decl.pretrain):
            out[decl.name] = dims_of(getattr(g, decl.pretrain))
    return out
