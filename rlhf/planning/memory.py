"""The memory plan of a job: per rank group and per stage, the peak device memory, built from the terms in
``rlhf.planning.terms`` (each a pure function with its formula) and the placement (``rlhf.distributed.placement``,
the one place that decides which roles sit on which rank).

A stage's peak = the states of every role resident during it + what the stage itself allocates (activations, the
LM head's chunks, a KV cache, vLLM's share) + a fixed runtime reserve on CUDA (context, cuBLAS workspace, NCCL
buffers).  Which roles are resident follows the phase scheduler (rlhf/distributed/phases.py): colocated with
--vllm_enable_sleep or --deepspeed_enable_sleep, only the stage's role (and the one it shares with) is awake and the
others sleep on the host; otherwise every role of the rank stays on the device and vLLM keeps its whole share.

Stages (RL): shard (FSDP2: the roles' parameters as they load, plus the one full tensor a load moves at a time),
load (every role's parameters, then vLLM takes its share: vLLM refuses to start otherwise), rollout, reward, ref,
values, old_logprobs, critic_update, actor_update, weight_sync.  Supervised: shard, load, ref (DPO), train.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, List, Optional, Tuple

from rlhf.errors import MemoryPlanError

from . import terms
from .dims import ModelDims
from .terms import GiB, States

DEFAULT_GPU_GB = 80.0          # H100 80GB
CUDA_RESERVE = 1.5 * GiB       # CUDA context + cuBLAS workspace + NCCL buffers per rank (assumed; measured on the
                               # GPU check: see README "Memory planner")
CPU_HEAD_COPY_MIN = 1 << 20    # rlhf/rollout/sampling.py SMALL_HEAD: smaller heads get no transposed copy
SYNC_BUCKET = 256 << 20        # WeightSync's default bucket (rlhf/distributed/weight_sync.py), two in flight


@dataclass
class Job:
    """Every flag the planner reads, flat, named as the flags (so a suggestion is a set of flag values)."""
    kind: str = "rl"                      # rl | sft | rm | dpo
    bf16: bool = False
    flash_attn: bool = False
    gradient_checkpointing: bool = False
    packing_samples: bool = False
    logprob_chunk_size: int = 1024
    lm_head_keep_mb: int = 1024
    prompt_max_len: int = 1024
    rl_max_len: int = 0                   # RL: prompt + response budget (--max_len given in RL); 0 = P + R
    generate_max_len: int = 1024
    max_len: int = 2048
    backend: str = "fsdp2"
    zero_stage: int = 3
    grad_accum_no_sync: bool = False
    vllm_enable_sleep: bool = False
    deepspeed_enable_sleep: bool = False
    rollout_engine: str = "vllm"           # auto counts as vllm on CUDA (what auto picks there when installed)
    micro_rollout_batch_size: int = 8
    vllm_gpu_memory_utilization: float = 0.5
    vllm_tensor_parallel_size: int = 1
    micro_train_batch_size: int = 4
    # flags other work adds (read with defaults until they exist)
    ring_attn_size: int = 1
    use_dynamic_batch: bool = False
    train_max_tokens_per_gpu: int = 16192
    rollout_max_tokens_per_gpu: Optional[int] = None    # None: --train_max_tokens_per_gpu
    adam_offload: bool = False
    lora_rank: int = 0
    target_modules: str = "all-linear"

    @property
    def c(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def attn(self) -> str:
        # packed rows under sdpa still get a (block-diagonal) s x s mask; flash_attention_2 runs varlen, no mask
        return "flash" if self.flash_attn else "sdpa"

    @property
    def seq(self) -> int:
        if self.kind == "rl":  # RL's --max_len bounds prompt + response (rlhf.config.openrlhf_meaning)
            total = self.prompt_max_len + self.generate_max_len
            return min(total, self.rl_max_len) if self.rl_max_len else total
        return self.max_len

    @property
    def response_len(self) -> int:
        return self.generate_max_len if self.kind == "rl" else self.max_len

    @property
    def sleeps(self) -> bool:
        return self.vllm_enable_sleep or self.deepspeed_enable_sleep

    def on(self, on_cuda: bool, vllm_installed: bool) -> Job:
        """This job with --rollout_engine auto decided as it picks on the device planned for: vllm on CUDA when
        installed (planning a GPU job: assumed), else hf."""
        if self.rollout_engine != "auto":
            return self
        return replace(self, rollout_engine="vllm" if on_cuda and vllm_installed else "hf")


def job_from_flags(kind: str, model, data, topology, rollout, optim) -> Job:
    """The planner's input from the five flag groups that hold its flags (rlhf.config.schema's ``ModelConfig``,
    ``DataConfig``, ``TopologyConfig``, ``RolloutConfig``, ``OptimConfig``): each ``Job`` field takes the flag of
    its name, a field no group has keeps its default.  ``kind``: ppo / grpo (both "rl"), sft, rm, dpo.
    --rollout_engine auto stays auto here; ``Job.on`` decides it where the device is known.  The one builder of
    the planner's input, called at the top (rlhf/config/preflight.py, ``python -m rlhf.plan``), as torchtitan
    builds a component from its own config there (torchtitan/config/configurable.py ``Config.build``)."""
    groups = (model, data, topology, rollout, optim)
    j = Job()
    for f in fields(Job):
        for grp in groups:
            if f.name != "kind" and hasattr(grp, f.name):
                setattr(j, f.name, getattr(grp, f.name))
                break
    j.kind = "rl" if kind in ("ppo", "grpo", "rl") else kind
    if j.kind == "rl":
        j.rl_max_len = int(data.max_len or 0)
    return j


@dataclass
class RoleModel:
    """What the plan needs of one role: its dimensions, its parameter count and the ranks its group spans."""
    dims: ModelDims
    ranks: int                  # the role's group size (FSDP / ZeRO shard over it)
    trainable: bool
    lm: bool                    # has an LM head (actor, ref) vs a scalar head (critic, reward)
    adapters: int = 0           # --lora_rank: trainable adapter weights over a frozen base (terms.lora_adapter_params)

    @property
    def n(self) -> int:
        return self.dims.params if self.lm else self.dims.value_params


@dataclass
class Stage:
    name: str
    parts: Dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


@dataclass
class GroupPlan:
    ranks: List[int]
    roles: List[str]
    stages: List[Stage]
    host: float                 # host bytes per rank (sleep / offload)
    load_host: float = 0.0      # host bytes of the rank in this group that reads a checkpoint whole (FSDP2 load)


@dataclass
class MemoryPlan:
    job: Job
    device_bytes: float
    groups: List[GroupPlan]
    ranks_per_node: int = 8
    dims: Optional[ModelDims] = None      # the actor's (the rollout engine's model)

    def overflows(self) -> List[Tuple[GroupPlan, Stage, float]]:
        """(group, stage, bytes over) for every stage whose peak exceeds the device."""
        return [(g, s, s.total - self.device_bytes) for g in self.groups for s in g.stages
                if s.total > self.device_bytes]

    @property
    def fits(self) -> bool:
        return not self.overflows()

    def worst(self) -> Tuple[GroupPlan, Stage]:
        return max(((g, s) for g in self.groups for s in g.stages), key=lambda gs: gs[1].total)

    def table(self) -> str:
        cols = ["params", "grads", "optimizer", "gathered", "activations", "logits", "kv/vllm", "other"]
        out = [f"device memory {self.device_bytes / GiB:.1f} GiB per rank; GiB per rank at each stage's peak"]
        for g in self.groups:
            out.append(f"ranks {_ranges(g.ranks)} ({', '.join(g.roles)}); host (sleep/offload) "
                       f"{g.host / GiB:.1f} GiB per rank, {g.host * min(len(g.ranks), self.ranks_per_node) / GiB:.0f} "
                       f"GiB per node" + (f"; at load {g.load_host / GiB:.1f} GiB on the host of the rank that "
                                          f"reads the checkpoint" if g.load_host else ""))
            out.append(f"  {'stage':<14}" + "".join(f"{c:>12}" for c in cols) + f"{'peak':>10}  fits")
            for s in g.stages:
                row = _columns(s.parts)
                ok = "yes" if s.total <= self.device_bytes else f"NO, {(s.total - self.device_bytes) / GiB:.1f} over"
                out.append(f"  {s.name:<14}" + "".join(f"{row[c] / GiB:>12.2f}" for c in cols)
                           + f"{s.total / GiB:>10.2f}  {ok}")
        return "\n".join(out)


_COLUMN = {"params": "params", "grads": "grads", "optimizer": "optimizer", "gathered": "gathered",
           "activations": "activations", "logits": "logits", "kv": "kv/vllm", "vllm": "kv/vllm"}


def _columns(parts: Dict[str, float]) -> Dict[str, float]:
    row = {c: 0.0 for c in ("params", "grads", "optimizer", "gathered", "activations", "logits", "kv/vllm", "other")}
    for k, v in parts.items():
        row[_COLUMN.get(k.split(":")[-1], "other")] += v
    return row


def _ranges(ranks: List[int]) -> str:
    from rlhf.distributed.placement import _ranges as r

    return r(ranks)


# ---- the stages ------------------------------------------------------------------------------------------------
def role_states(job: Job, rm: RoleModel) -> States:
    d = rm.dims
    if job.backend == "deepspeed":
        return terms.deepspeed_states(rm.n, rm.ranks, job.bf16, job.zero_stage, rm.trainable, d.layer_params,
                                      job.adam_offload and rm.trainable, rm.adapters)
    return terms.fsdp2_states(rm.n, rm.ranks, job.c, job.zero_stage, rm.trainable, d.layer_params,
                              d.root_params if rm.lm else d.embed_params + 2 * d.hidden,
                              job.adam_offload and rm.trainable, job.grad_accum_no_sync and rm.trainable, rm.adapters)


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
    sp = max(1, job.ring_attn_size)
    c = job.c
    if grad:
        act = terms.activation_bytes(d, b, s, c, job.attn, job.gradient_checkpointing, sp)
    else:
        act = terms.inference_activation_bytes(d, b, s, c, job.attn, sp)
    out = {"activations": act}
    head = 0.0
    if lm:
        fused = head_fused(job)
        tokens = -(-b * s // sp)
        rows = tokens * job.response_len // max(1, job.seq) if fused else tokens  # unfused: every token's logits
        head = terms.lm_head_bytes(rows, d.vocab, c, job.logprob_chunk_size, max(0, job.lm_head_keep_mb) << 20, grad,
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
    # HF engine (rlhf/rollout/hf_engine.py): its own model copy, a KV cache for a micro-batch, one decode step's
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
    parameters' cache, the partitions stay (rlhf/backends/deepspeed_engine.py ``sleep``)."""
    if asleep and not (job.backend == "deepspeed" and not trainable and job.zero_stage >= 3):
        return {}
    return {f"{name}:params": st.params, f"{name}:grads": st.grads, f"{name}:optimizer": st.optimizer}


def weights_only_wake(job: Job, sleeping: bool) -> bool:
    """Whether a role woken from sleep for a forward-only stage (reward, ref, values, old log-probs) leaves its
    optimizer state on the host: FSDP2's ``wake`` brings the weights only and ``step`` brings the optimizer state
    (rlhf/backends/fsdp2.py ``wake`` / ``_onload_optimizer``; veRL's ``load_fsdp_optimizer`` in ``update_actor``
    only).  DeepSpeed's wake reloads every state (``reload_states``).  Without sleep everything stays resident.
    The weight sync follows the actor's update with the actor still awake, so its optimizer state is there."""
    return sleeping and job.backend == "fsdp2"


def group_stages(job: Job, roles: Dict[str, RoleModel], rollout_tp: int, device_bytes: float,
                 on_cuda: bool = True, scheduled: bool = True) -> Tuple[List[Stage], float]:
    """The stages of one rank holding ``roles`` (role -> RoleModel; "rollout" -> the actor's model) and its host
    bytes per rank.  Colocated with sleep, a stage keeps only its own role (and the one it shares) awake.
    ``scheduled``: the phase scheduler puts roles to sleep at all, which the RL trainer does only when every role
    shares every rank (rlhf/trainers/rl_trainer.py: ``enabled=self.plan.colocated and (...)``); the supervised
    trainers never do."""
    states = {r: role_states(job, m) for r, m in roles.items() if r != "rollout"}
    reserve = {"runtime": CUDA_RESERVE} if on_cuda else {}
    sleeping = scheduled and job.sleeps and len(roles) > 1
    stages: List[Stage] = []

    def resident(awake: Tuple[str, ...], first_step: bool = False, updating: str = "",
                 forward_only: bool = False) -> Dict[str, float]:
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
        if "rollout" in roles and "rollout" not in awake and not sleeping:
            out.update(_rollout_parts(job, roles["rollout"].dims, rollout_tp, device_bytes, on_cuda))
        return out

    def add(name: str, awake: Tuple[str, ...], extra: Dict[str, float], updating: str = "", first_step: bool = False,
            forward_only: bool = False):
        parts = dict(reserve)
        parts.update(resident(awake, first_step=first_step or name == "load", updating=updating,
                              forward_only=forward_only))
        for k, v in extra.items():
            parts[k] = parts.get(k, 0.0) + v
        stages.append(Stage(name, parts))

    if job.backend == "fsdp2" and states:  # the roles load one after another, before the rollout engine starts
        # (so "rollout" counts as awake: no vLLM share yet): the last role's one-tensor transient at most.  A role
        # on one rank reads its checkpoint itself and moves it tensor by tensor (``module.to`` / ``fully_shard``):
        # no broadcast buffer (rlhf/backends/base.py ``loads_on_first``: FSDP2 over more than one rank)
        transient = max(terms.load_transient_bytes(m.dims, terms.stored_bytes(job.c, m.trainable, m.adapters > 0))
                        if m.ranks > 1 else 0.0 for r, m in roles.items() if r != "rollout")
        add("shard", tuple(states) + ("rollout",), {"load:transient": transient} if transient else {},
            first_step=True)
    load_extra = {}
    if "rollout" in roles:
        load_extra = _rollout_parts(job, roles["rollout"].dims, rollout_tp, device_bytes, on_cuda)
    add("load", tuple(states) + ("rollout",), load_extra)
    if "rollout" in roles:
        add("rollout", ("rollout",), _rollout_parts(job, roles["rollout"].dims, rollout_tp, device_bytes, on_cuda))
    b_inf, s_inf = _tokens(job, job.micro_rollout_batch_size, job.rollout_max_tokens_per_gpu)
    b_tr, s_tr = _tokens(job, job.micro_train_batch_size, job.train_max_tokens_per_gpu)
    # old_logprobs: the actor's no-grad forward over the rollout (skipped for a single on-policy update, but then
    # still run on the first step and every --logprob_gap_interval steps to log the rollout gap): planned always
    for r, stage in (("reward", "reward"), ("ref", "ref"), ("critic", "values"), ("actor", "old_logprobs")):
        if r in roles and job.kind == "rl":
            m = roles[r]
            fwd = _forward(job, m.dims, b_inf, s_inf, False, m.lm)
            add(stage, (r,), {f"{r}:gathered": states[r].gathered, **fwd}, forward_only=True)
    if job.kind == "dpo" and "ref" in roles:
        m = roles["ref"]
        add("ref", ("ref",), {"ref:gathered": states["ref"].gathered,
                              **_forward(job, m.dims, 2 * job.micro_train_batch_size, job.seq, False, True)})
    for r, stage in (("critic", "critic_update"), ("actor", "actor_update" if job.kind == "rl" else "train")):
        if r in roles and roles[r].trainable:
            m = roles[r]
            b = 2 * b_tr if job.kind in ("dpo", "rm") else b_tr
            fwd = _forward(job, m.dims, b, s_tr, True, m.lm, m.ranks)
            add(stage, (r,), {f"{r}:gathered": states[r].gathered, **fwd}, updating=r)
    if job.kind == "rl" and ("rollout" in roles or "actor" in roles):
        add("weight_sync", ("actor",), _sync_parts(job, roles, rollout_tp, sleeping))
    # host memory per rank: every sleeping role's resident states (all asleep during the rollout), the
    # optimizer offload, and vLLM's level-1 sleep copy of its weights (start-up, eval)
    host = sum(st.host for st in states.values())
    if sleeping:
        host += sum(st.params + st.optimizer for st in states.values())  # gradients are freed after each step
        if "rollout" in roles and job.rollout_engine == "vllm":
            host += terms.vllm_weight_bytes(roles["rollout"].dims.params, rollout_tp)
    return stages, host


def _sync_copies(job: Job, actor: RoleModel) -> bool:
    """Whether the sync's gather makes new tensors (``weight_sync.full_tensor``): a sharded FSDP2 model (over
    several ranks, or under --bf16 / --adam_offload, rlhf/backends/fsdp2.py ``sharded``) all-gathers, ZeRO-3
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
                roles[r] = RoleModel(dims.get(r, actor), n, r in ("actor", "critic"), r in ("actor", "ref"),
                                     adapters if r == "actor" else 0)
        stages, host = group_stages(job, roles, job.vllm_tensor_parallel_size, device_bytes, on_cuda,
                                    scheduled=placement.colocated)
        sources = {r: m for r, m in roles.items() if r != "rollout" and placement.ranks[r][0] in ranks}
        out.append(GroupPlan(ranks, list(held), stages, host, _load_host(job, sources)))
    return MemoryPlan(job, device_bytes, out, ranks_per_node=placement.gpus_per_node, dims=actor)


def role_dims(model) -> Dict[str, ModelDims]:
    """Each role's dimensions from its config.json, the paths in ``model`` (the --model flag group): --pretrain
    (the built-in kit when unset), --ref_pretrain, --critic_pretrain (default --pretrain), --reward_pretrain."""
    from rlhf.models.load import resolve_pretrain

    from .dims import dims_of

    m = model
    actor = dims_of(resolve_pretrain(m.pretrain))
    out = {"actor": actor}
    for role, path in (("ref", m.ref_pretrain), ("critic", m.critic_pretrain), ("reward", m.reward_pretrain)):
        if path:
            out[role] = dims_of(path)
    return out


def device_budget(gpu_memory_gb: Optional[float]) -> float:
    """Bytes per rank to plan against: --gpu_memory_gb, else DEFAULT_GPU_GB (an H100)."""
    return (gpu_memory_gb if gpu_memory_gb is not None else DEFAULT_GPU_GB) * GiB


def plan_with_fixes(job: Job, dims: Dict[str, ModelDims], placement=None, world: int = 1,
                    device_bytes: float = DEFAULT_GPU_GB * GiB, on_cuda: bool = True,
                    vllm_installed: bool = True) -> Tuple[MemoryPlan, List[Dict]]:
    """The plan of a job (``job_from_flags``, ``role_dims``) and the flag sets that fit when it does not (each
    checked by re-planning)."""
    job = job.on(on_cuda, vllm_installed)

    def replan(j: Job) -> MemoryPlan:
        return plan_memory(j, dims, placement, world, device_bytes, on_cuda)

    plan = replan(job)
    colocated = bool(placement is not None and placement.colocated)
    group = max(len(r) for r in placement.ranks.values()) if placement is not None else world
    per_node = placement.gpus_per_node if placement is not None else world
    return plan, suggest(plan, replan, colocated, max_sp=_max_sp(group, per_node))


def _max_sp(group: int, per_node: int) -> int:
    """The largest power of two dividing both the role's ranks and the ranks per node (an SP group stays in a
    node), at most 8."""
    sp = 1
    while sp < 8 and group % (sp * 2) == 0 and per_node % (sp * 2) == 0:
        sp *= 2
    return sp


# ---- suggestions -----------------------------------------------------------------------------------------------
def _candidates(job: Job, colocated: bool, max_sp: int, dims: Optional[ModelDims] = None) -> List[Dict]:
    """Single changes that lower some stage's peak, most benign first."""
    out: List[Dict] = []
    if not job.gradient_checkpointing:
        out.append({"gradient_checkpointing": True})
    if colocated and not job.sleeps:
        out.append({"vllm_enable_sleep": True, "deepspeed_enable_sleep": True})
    if job.zero_stage < 3:
        out.append({"zero_stage": 3})
    if job.lm_head_keep_mb > 0:
        out.append({"lm_head_keep_mb": 0})
    m = job.micro_train_batch_size
    while m > 1:
        m //= 2
        out.append({"micro_train_batch_size": m})
    m = job.micro_rollout_batch_size
    while m > 1:
        m //= 2
        out.append({"micro_rollout_batch_size": m})
    if job.rollout_engine == "vllm":
        for u in (0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2):
            if u < job.vllm_gpu_memory_utilization:
                out.append({"vllm_gpu_memory_utilization": u})
    sp = job.ring_attn_size  # Ulysses (rlhf/distributed/sequence_parallel.py check_sp): packed rows, heads and kv
    while sp * 2 <= max_sp and job.kind != "rm":  # heads divisible by the group, not for train_rm
        sp *= 2
        if dims is not None and (dims.heads % sp or dims.kv_heads % sp):
            break
        out.append({"ring_attn_size": sp} if job.packing_samples else {"ring_attn_size": sp, "packing_samples": True})
    if not job.adam_offload:
        out.append({"adam_offload": True})
    return out


def suggest(plan: MemoryPlan, replan, colocated: bool = True, max_sp: int = 8, limit: int = 3) -> List[Dict]:
    """Flag sets that fit, each checked by ``replan(job) -> MemoryPlan``: first the single changes that fit alone,
    else changes accumulated in order (each kept only if it lowers the worst stage) until the plan fits."""
    if plan.fits:
        return []
    job = plan.job
    singles, seen = [], set()
    for ch in _candidates(job, colocated, max_sp, plan.dims):
        key = tuple(sorted(ch))  # one suggestion per flag: the first value that fits is the mildest
        if key in seen:
            continue
        if replan(replace(job, **ch)).fits:
            seen.add(key)
            singles.append(ch)
            if len(singles) >= limit:
                break
    if singles:
        return singles
    acc: Dict = {}
    cur = job
    worst = plan.worst()[1].total
    for ch in _candidates(job, colocated, max_sp, plan.dims):
        trial = replace(cur, **ch)
        p = replan(trial)
        if p.worst()[1].total < worst:
            cur, worst = trial, p.worst()[1].total
            for k in ch:
                acc.pop(k, None)
            acc.update(ch)
            if p.fits:
                return [acc]
    return []


def flags_text(change: Dict) -> str:
    parts = []
    for k, v in change.items():
        parts.append(f"--{k}" if v is True else f"--{k} {v}")
    return " ".join(parts)


def vllm_lines(plan: MemoryPlan) -> List[str]:
    """What vLLM's share holds on a rollout rank: its weights and, in the rest, how many full-length sequences'
    KV cache (vLLM refuses to start below one)."""
    j = plan.job
    if j.kind != "rl" or j.rollout_engine != "vllm" or plan.dims is None:
        return []
    d, tp = plan.dims, max(1, j.vllm_tensor_parallel_size)
    share = terms.vllm_share_bytes(j.vllm_gpu_memory_utilization, plan.device_bytes)
    weights = terms.vllm_weight_bytes(d.params, tp)
    per_seq = terms.kv_cache_bytes(d, 1, j.seq, 2) / tp
    seqs = (share - weights) / per_seq
    line = (f"vLLM per rank: share {share / GiB:.1f} GiB = weights {weights / GiB:.1f} GiB + KV cache and "
            f"activations {(share - weights) / GiB:.1f} GiB: about {max(0.0, seqs):.0f} sequences of "
            f"{j.seq} tokens at once")
    if seqs < 1:
        line += (f"; TOO SMALL: vLLM will not start (one sequence needs {per_seq / GiB:.2f} GiB of KV cache): raise "
                 f"--vllm_gpu_memory_utilization or --vllm_tensor_parallel_size")
    return [line]


def report(plan: MemoryPlan, suggestions: List[Dict]) -> str:
    lines = [plan.table()]
    lines += vllm_lines(plan)
    over = plan.overflows()
    if not over:
        g, s = plan.worst()
        lines.append(f"fits: the largest peak is {s.name} on ranks {_ranges(g.ranks)}: {s.total / GiB:.1f} of "
                     f"{plan.device_bytes / GiB:.1f} GiB")
        return "\n".join(lines)
    if plan.device_bytes <= CUDA_RESERVE and any("runtime" in s.parts for g in plan.groups for s in g.stages):
        g, s = plan.worst()
        lines.append(f"the device ({plan.device_bytes / GiB:.2f} GiB per rank) is no larger than the "
                     f"{CUDA_RESERVE / GiB:.1f} GiB runtime reserve every CUDA rank holds before any model; this job's "
                     f"largest stage, {s.name}, needs {s.total / GiB:.2f} GiB at this size (python -m rlhf.train_* "
                     f"names the smallest --gpu_memory_gb that fits)")
        return "\n".join(lines)
    for g, s, by in over:
        lines.append(f"OVERFLOW: {s.name} on ranks {_ranges(g.ranks)} needs {s.total / GiB:.1f} GiB of "
                     f"{plan.device_bytes / GiB:.1f} GiB ({by / GiB:.1f} GiB over)")
    if suggestions:
        for ch in suggestions:
            lines.append(f"fits with: {flags_text(ch)}")
    else:
        lines.append("no flag set found that fits: more ranks (a larger --actor_num_nodes), or a smaller model")
    return "\n".join(lines)


__all__ = ["Job", "MemoryPlan", "GroupPlan", "Stage", "RoleModel", "plan_memory", "suggest", "report",
           "job_from_flags", "role_dims", "plan_with_fixes", "device_budget", "flags_text", "DEFAULT_GPU_GB",
           "CUDA_RESERVE"]


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}" if x >= 10 * GiB else f"{x / GiB:.2f}"


# ---- the trainers' start-up check ------------------------------------------------------------------------------
def free_device_bytes() -> Tuple[float, float, int]:
    """(free bytes, total bytes, index) of this rank's GPU (LOCAL_RANK, as comm picks it) at start-up:
    ``torch.cuda.mem_get_info``, which creates this process's CUDA context on that device first, so the context
    is already out of the free figure."""
    import os

    import torch

    local = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
    free, total = torch.cuda.mem_get_info(local)
    return float(free), float(total), local


def smallest_device(plan_at, start: float) -> float:
    """The smallest device size (bytes, a multiple of 0.1 GiB) whose plan fits, ``plan_at(bytes) -> MemoryPlan``:
    vLLM's share grows with the device (--vllm_gpu_memory_utilization x memory), so the size is iterated from
    ``start`` (the worst stage at the current size) until the plan at that size fits."""
    import math

    def up(x: float) -> float:
        return math.ceil(x / GiB * 10 - 1e-9) / 10 * GiB

    dev = up(start)
    for _ in range(200):
        need = plan_at(dev).worst()[1].total
        if need <= dev:
            return dev
        dev = max(up(need), dev + 0.1 * GiB)
    return dev


def below_reserve(device_bytes: float, budget: str, stage: str, need: float, fits_at: float, given: bool) -> str:
    """The refusal when the device (or the given budget) is no larger than the runtime reserve alone."""
    fix = (f"--gpu_memory_gb {fits_at / GiB:.1f} or more fits (or leave --gpu_memory_gb unset: the GPU's free memory)"
           if given else f"a GPU with {fits_at / GiB:.1f} GiB free fits: free this one (another process holds it) or "
                         f"run on a larger one")
    return (f"memory plan: {budget} is {_gib(device_bytes)} GiB per rank, no more than the {_gib(CUDA_RESERVE)} GiB "
            f"every CUDA rank holds before any model (context, cuBLAS workspace, NCCL buffers: the planner's runtime "
            f"reserve); this job's largest stage, {stage}, needs {_gib(need)} GiB at this budget: {fix}. "
            f"See python -m rlhf.plan --memory with the same flags; --skip_memory_check starts anyway")


def startup_check(job: Job, model, topology, world: int, placement=None, on_cuda: Optional[bool] = None,
                  device_bytes: Optional[float] = None) -> List[str]:
    """Run before any process group (rlhf/config/preflight.py ``memory_notices``): plan the job and refuse a layout
    with a stage that cannot fit, naming the stage, the numbers and flag sets that fit, unless --skip_memory_check.

    ``job`` comes from ``job_from_flags``; ``model`` (the --model flag group) names the models whose config.json
    give their dimensions; ``topology`` (the --topology group) gives --gpu_memory_gb and --skip_memory_check;
    ``placement`` is RL's (None: a supervised job over ``world`` ranks).
    On CUDA the device is the GPU's free memory at start-up (``free_device_bytes``; what other processes hold is
    not ours to plan with), or --gpu_memory_gb.  Without CUDA the check does nothing unless --gpu_memory_gb is
    given (CPU runs are not planned for).  A model whose config.json cannot be read is left to the checks that
    report those."""
    gb = topology.gpu_memory_gb
    if on_cuda is None:
        import torch

        on_cuda = torch.cuda.is_available()
    budget = "the given budget (--gpu_memory_gb)"
    if device_bytes is None:
        if gb is not None:
            device_bytes = float(gb) * GiB
        elif on_cuda:
            device_bytes, total, index = free_device_bytes()
            budget = (f"GPU {index}'s free memory ({_gib(device_bytes)} of {_gib(total)} GiB; other processes hold "
                      f"the rest)")
        else:
            return []
    import importlib.util

    vllm = importlib.util.find_spec("vllm") is not None
    job = job.on(on_cuda, vllm)
    try:
        dims = role_dims(model)
        plan, fits = plan_with_fixes(job, dims, placement, world, device_bytes, on_cuda, vllm)
    except (OSError, ValueError) as e:
        return [f"[memory] plan skipped: a model's config.json could not be read ({e})"]
    g, s = plan.worst()

    def fitting() -> float:
        return smallest_device(lambda dev: plan_memory(job, dims, placement, world, dev, on_cuda), s.total)

    if on_cuda and device_bytes <= CUDA_RESERVE:
        msg = below_reserve(device_bytes, budget, s.name, s.total, fitting(), gb is not None)
        if topology.skip_memory_check:
            return [f"[memory] WARNING (--skip_memory_check): {msg}"]
        raise MemoryPlanError(msg)
    if plan.fits:
        return [f"[memory] plan: the largest peak is {s.name} on ranks {_ranges(g.ranks)}, {_gib(s.total)} of "
                f"{_gib(device_bytes)} GiB (python -m rlhf.plan --memory shows every stage)"]
    over = plan.overflows()
    worst_g, worst_s, by = max(over, key=lambda o: o[2])
    msg = (f"memory plan: {worst_s.name} on ranks {_ranges(worst_g.ranks)} needs {_gib(worst_s.total)} GiB of "
           f"{_gib(device_bytes)} GiB ({_gib(by)} GiB over"
           + (f"; {len(over) - 1} more stage(s) over" if len(over) > 1 else "") + "). "
           + (f"Fits with: {' | '.join(flags_text(f) for f in fits)}. " if fits else
              f"No flag set found that fits: more ranks, a smaller model, or a device with at least "
              f"{fitting() / GiB:.1f} GiB per rank. ")
           + "See python -m rlhf.plan --memory with the same flags; --skip_memory_check starts anyway")
    if topology.skip_memory_check:
        return [f"[memory] WARNING (--skip_memory_check): {msg}"]
    raise MemoryPlanError(msg)
