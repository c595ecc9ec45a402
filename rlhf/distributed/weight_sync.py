"""Actor -> rollout weight sync.

Colocated: every rank gathers full parameters from its actor shards and loads
them into its own engine, bucket by bucket (no extra copy of the whole model).
Separate rollout ranks: actor rank 0 packs each bucket into one flat tensor per
dtype and broadcasts it.  vLLM engines in their own processes receive it in their
workers, straight onto the workers' devices, over a weight-transfer group of their
own (NCCL on CUDA, gloo on CPU; ``rlhf.distributed.transport``); engines in the
trainer's process (HF) over the sync group (actor rank 0 + rollout ranks).  Both
sides derive the same bucket plan from the parameter metadata, which is broadcast
once.  Every wait has a timeout (``--dist_timeout_s``).
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch

from rlhf.distributed import comm, expert_names
from rlhf.distributed import transport as transfer  # the weight-transfer group and its wire format
from rlhf.errors import WeightSyncTimeout

Meta = Tuple[str, Tuple[int, ...], torch.dtype]


def zero3_param(p: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter: its ``shape`` is the local partition's (``[0]`` outside a gather), ``ds_shape``
    the full one (deepspeed/runtime/zero/partition_parameters.py sets ``ds_id``/``ds_shape`` on conversion)."""
    return hasattr(p, "ds_id")


def full_shape(p: torch.Tensor) -> Tuple[int, ...]:
    """The full (unsharded) shape, without any collective: ZeRO-3 ``ds_shape``, a DTensor's global shape, or the
    plain tensor's."""
    return tuple(p.ds_shape) if zero3_param(p) else tuple(p.shape)


def full_tensor(p: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The full tensor of a parameter; a collective for sharded ones, so every rank of the shard group calls it for
    the same parameters in the same order.  ``dtype``: the tensor comes back in it, and a sharded one is gathered
    in it (each rank casts its shard first): a bf16 engine's sync all-gathers half the bytes of the fp32 masters
    and holds a bf16 buffer, not an fp32 one (veRL gathers the FSDP actor's weights for vLLM in the rollout's
    dtype, verl/workers/sharding_manager/fsdp_vllm.py: ``param.to(device, non_blocking=True).full_tensor()`` of
    the bf16 state dict; OpenRLHF gathers ZeRO-3's bf16 module parameters).

    * FSDP2 DTensor: ``full_tensor()`` (all-gather over its mesh).
    * DeepSpeed ZeRO-3: gathered one parameter at a time inside ``deepspeed.zero.GatheredParameters([p])``
      (all-gather over ``p.ds_process_group``), as OpenRLHF's ``_broadcast_to_vllm`` does
      (openrlhf/trainer/ray/ppo_actor.py: ``GatheredParameters([param], enabled=zero_stage == 3)``); the gathered
      data is copied out before the context re-partitions the parameter on exit.
    * anything else passes through (no copy).
    """
    if zero3_param(p):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.data.detach().to(dtype or p.dtype, copy=True)
    t = p.data if isinstance(p, torch.nn.Parameter) else p
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)  # a DTensor casts its local shard: no communication
    return t.full_tensor() if hasattr(t, "full_tensor") else t


PEFT_PREFIX = "base_model.model."


def _engine_name(name: str) -> str:
    """peft's parameter name -> the plain HF model's (what the rollout engine holds)."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def _lora_scalings(model) -> dict:
    return {name: mod.scaling["default"] for name, mod in model.named_modules()
            if hasattr(mod, "lora_A") and hasattr(mod, "scaling") and "default" in getattr(mod, "scaling", {})}


def tied_aliases(model) -> dict:
    """{name of a parameter's first occurrence: [its other names]} for parameters reachable under several names,
    i.e. tied weights (``tie_word_embeddings``: ``lm_head.weight`` is ``model.embed_tokens.weight``).
    ``named_parameters()`` yields a shared parameter once, under its first name, so without this the tied
    ``lm_head.weight`` is never sent."""
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
    return out


def _export(model, materialize: bool, aliases: bool = False, dtype: Optional[torch.dtype] = None):
    """(engine name, full shape, dtype, tensor or None) for every weight the engine receives, in one fixed order
    (``named_parameters``, the same on every rank).  ``dtype``: the tensors are gathered in it (``full_tensor``);
    the metadata keeps the parameters' own dtypes.

    LoRA layers are merged: W = W_base + scaling * B @ A in fp32, rounded once to the output dtype, emitted
    where lora_B appears (a LoRA layer's parts are gathered in their own dtypes; under --bf16 its frozen base is
    bf16 already, ``rlhf.models.load.weight_dtype``),
    so the metadata pass (materialize=False, no collectives: shapes from ``full_shape``) and the tensor pass
    agree.  The tensor pass gathers every parameter (``full_tensor``), a collective under FSDP2 and ZeRO-3.

    ``aliases``: a tied parameter is also emitted under each of its other names (``tied_aliases``), right after
    its first name, with the same gathered tensor (no second gather).  vLLM needs it: its ``lm_head`` does not
    follow a reloaded embedding.  vLLM 0.32 ties by sharing the Parameter (``ParallelLMHead.tie_weights``,
    vllm/model_executor/layers/vocab_parallel_embedding.py; qwen2.py / llama.py ``if config.tie_word_embeddings:
    self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)``), but on CPU each layer's
    ``process_weights_after_loading`` packs its own copy for the GEMM (``dispatch_cpu_unquantized_gemm``,
    vllm/model_executor/layers/utils.py: ``create_onednn_mm(origin_weight.t(), ...)`` / ``convert_weight_packed``),
    and the in-place reload re-runs that step only for layers that received weights
    (model_loader/reload/layerwise.py ``finalize_layerwise_processing``: a layer that loaded nothing gets its
    old kernel tensors back).  The reload puts every layer on meta first (``initialize_layerwise_reload``), which
    unties them, so ``AutoWeightsLoader`` no longer skips ``lm_head.weight`` as an alias
    (models/utils.py ``_get_tied_embedding_params``) and loads it into the head, which then re-packs.  Engines
    that share the tensor (the HF engine) take the first name only.  The other weights vLLM keeps in another
    form, Llama's / Qwen2's fused ``qkv_proj`` and ``gate_up_proj`` (``stacked_params_mapping`` in their
    ``load_weights``), are rebuilt from q/k/v and gate/up only when a reload gets all of a layer's tensors at
    once: the loaders hold a decoder layer back until it is complete (``transport.split_last_layer``).
    """
    scal = _lora_scalings(model)
    tied = tied_aliases(model) if aliases else {}
    pending = {}
    for name, p in model.named_parameters():
        mod = None
        for key in (".base_layer.weight", ".lora_A.default.weight", ".lora_B.default.weight"):
            if name.endswith(key) and name[: -len(key)] in scal:
                mod, part = name[: -len(key)], key
        t = full_tensor(p, dtype if mod is None else None) if materialize else None
        if mod is None:
            for n in [name] + tied.get(name, []):
                yield _engine_name(n), full_shape(p), p.dtype, t
            continue
        slot = pending.setdefault(mod, {})
        slot[part] = t if materialize else p
        if part == ".lora_B.default.weight":
            base = slot[".base_layer.weight"]
            merged = None
            if materialize:
                merged = (base.float() + scal[mod] * (slot[".lora_B.default.weight"].float() @
                                                      slot[".lora_A.default.weight"].float())).to(dtype or base.dtype)
            yield _engine_name(mod + ".weight"), full_shape(base), base.dtype, merged
            del pending[mod]


def param_meta(model: torch.nn.Module, aliases: bool = False) -> List[Meta]:
    """(engine name, full shape, dtype) of every weight the engine receives; local, no collective.  ``aliases``:
    tied weights under every name (see ``_export``)."""
    return [(n, shape, dt) for n, shape, dt, _ in _export(model, materialize=False, aliases=aliases)]


def wants_tied_aliases(engine) -> bool:
    """Does this rank's engine (None: none here) need a tied weight under each of its names?  An engine says so
    with ``tied_weights_apart`` (vLLM: see ``_export``); the HF engine shares the tensor and takes one name."""
    return engine is not None and engine.tied_weights_apart


def bucket_plan(meta: List[Meta], bucket_bytes: int, dtype: Optional[torch.dtype] = None) -> List[List[int]]:
    """Group parameter indices into buckets of at most bucket_bytes (a larger tensor gets its own bucket)."""
    buckets, cur, size = [], [], 0
    for i, (_, shape, dt) in enumerate(meta):
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype or dt).element_size()
        if cur and size + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def _wait(work, timeout_s: float, what: str):
    """``comm.wait``, raising ``WeightSyncTimeout`` with what a stuck sync usually means."""
    try:
        comm.wait(work, timeout_s, what)
    except TimeoutError as e:
        raise WeightSyncTimeout(f"weight sync timed out after {timeout_s}s during {what}: a rank of the sync group "
                                f"did not join (crashed, or is stuck in another phase). Cause: {e}") from None


class WeightSync:
    def __init__(self, groups, engine=None, bucket_mb: float = 256, dtype: Optional[torch.dtype] = None,
                 timeout_s: float = 600, device: Optional[torch.device] = None):
        self.groups = groups
        self.engine = engine
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self._meta: Optional[List[Meta]] = None

    # ---- colocated -------------------------------------------------------------------------------------------
    def _named_full(self, model, aliases: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
        """Full (unsharded, LoRA-merged) weights under the engine's names; collective over the actor group."""
        for name, _, _, t in _export(model, materialize=True, aliases=aliases, dtype=self.dtype):
            yield name, (t.to(self.dtype) if self.dtype is not None else t)

    def sync_colocated(self, model) -> int:
        """Gather and load bucket by bucket; returns bytes loaded."""
        aliases = wants_tied_aliases(self.engine)
        meta = param_meta(model, aliases)
        it = self._named_full(model, aliases)
        total = 0
        for bucket in bucket_plan(meta, self.bucket_bytes, self.dtype):
            batch = [next(it) for _ in bucket]
            total += sum(t.numel() * t.element_size() for _, t in batch)
            if self.engine is not None:
                self.engine.load_weights(batch)
        if self.engine is not None:
            self.engine.reset_prefix_cache()
        return total

    # ---- separate rollout ranks --------------------------------------------------------------------------------
    _link: Optional[dict] = None  # how weights reach the engines; set by the first sync_broadcast (``_connect``)

    def sync_broadcast(self, model=None) -> int:
        """Called on all actor ranks and all rollout ranks; returns the bytes of one copy of the weights.

        vLLM engines in their own processes (``direct_weights``): every worker of every engine is a rank of a
        weight-transfer group with actor rank 0 (``_connect``), and receives each bucket straight onto its own
        device; the engine's first trainer rank drives the receive with one RPC per sync, its other TP ranks
        receive nothing.  Engines in the trainer's process (HF): buckets are broadcast over the sync group.
        Non-zero actor ranks only help unshard (the gather of each parameter is collective over the actor)."""
        plan, rank = self.groups.plan, self.groups.rank
        if rank not in plan.sync_ranks:
            for _ in self._named_full(model):
                pass
            return 0
        src = plan.sync_ranks[0]
        if self._link is None:
            self._link = self._connect(src)
        aliases = self._link["aliases"]
        if self._meta is None:  # vLLM's own processes read MoE experts under per-expert names (expert_names)
            meta = param_meta(model, aliases) if rank == src else None
            if meta is not None and self._link["direct"]:
                meta = expert_names.per_expert_meta(meta)
            self._meta = comm.broadcast_object(meta, src, self.groups.group("sync"))
        wire = self._wire()
        if not self._link["direct"]:
            return self._sync_in_process(model, wire, src, aliases)
        if rank == src:
            return self._send_direct(model, wire, aliases)
        if self._link["joined"]:
            self.engine.receive_weights([p for bucket in wire for p in bucket])
            self.engine.reset_prefix_cache()
        return sum(transfer.piece_bytes(p) for bucket in wire for p in bucket)

    def _wire(self) -> List[List[transfer.Piece]]:
        """The bucket plan as the wire carries it: per bucket, one piece per dtype ``(dtype name, [(engine name,
        shape), ...])``, each sent as one flat tensor.  Derived from the metadata on every rank alike."""
        meta, out = self._meta, []
        for bucket in bucket_plan(meta, self.bucket_bytes, self.dtype):
            by_dtype: dict = {}
            for i in bucket:
                dt = str(self.dtype or meta[i][2]).removeprefix("torch.")
                by_dtype.setdefault(dt, []).append((meta[i][0], list(meta[i][1])))
            out.append(list(by_dtype.items()))
        return out

    def _connect(self, src: int) -> dict:
        """Once, on every rank of the sync group: do the engines receive directly, and if so build the
        weight-transfer group.  Every sync rank says (direct, workers) (workers: its engine's TP size on an
        engine's first rank, else 0); actor rank 0 opens a TCPStore and sends its address; each engine's first
        rank makes its workers join at ``rank_offset`` = 1 + the workers before it, while actor rank 0 joins as
        rank 0.  Both joins block until the group is complete, at most ``timeout_s``."""
        eng = self.engine
        direct = eng is not None and eng.direct_weights
        workers = eng.weight_workers() if direct else 0
        info = comm.all_gather_object((direct, workers, wants_tied_aliases(eng)), group=self.groups.group("sync"))
        aliases = any(a for _, _, a in info)  # tied weights under every name if any engine needs them
        info = [(d, w) for d, w, _ in info]
        if not any(d for d, _ in info):
            return {"direct": False, "aliases": aliases}
        world = 1 + sum(w for _, w in info)
        is_src = self.groups.rank == src
        store = addr = None
        if is_src:
            backend = transfer.transfer_backend(self.device)
            store, port = transfer.open_store(transfer.sender_address(), self.timeout_s)
            addr = (transfer.sender_address(), port, backend)
        host, port, backend = comm.broadcast_object(addr, src, self.groups.group("sync"))
        if is_src:
            group = transfer.TransferGroup(store, 0, world, backend, self.timeout_s, self.device)
            print(f"[weights] direct to {world - 1} vLLM worker(s) of {sum(1 for _, w in info if w)} engine(s) "
                  f"over {backend} (weight-transfer group at {host}:{port})", flush=True)
            return {"direct": True, "group": group, "aliases": aliases}
        if workers:
            me = comm.rank(self.groups.group("sync"))
            offset = 1 + sum(w for _, w in info[:me])
            eng.join_weight_group(host, port, offset, world, backend, self.timeout_s)
        return {"direct": True, "joined": bool(workers), "aliases": aliases}

    def _pack(self, tensors: dict, piece: transfer.Piece) -> torch.Tensor:
        dt = getattr(torch, piece[0])
        return torch.cat([tensors[n].reshape(-1).to(dt) for n, _ in piece[1]]).to(self.device)

    def _send_direct(self, model, wire: List[List[transfer.Piece]], aliases: bool) -> int:
        """Actor rank 0: gather, pack and broadcast each piece to every vLLM worker.  Double-buffered: the next
        piece is gathered and packed while the previous one is on the wire (peak: two packed pieces and one
        bucket of gathered tensors)."""
        group = self._link["group"]
        it = expert_names.per_expert(self._named_full(model, aliases))  # as the metadata (sync_broadcast)
        inflight, total = None, 0
        for bucket in wire:
            tensors = dict(next(it) for _ in range(sum(len(entries) for _, entries in bucket)))
            for piece in bucket:
                flat = self._pack(tensors, piece)
                if inflight is not None:
                    _wait(inflight[0], self.timeout_s, inflight[2])
                inflight = (group.broadcast(flat), flat, f"bucket piece of {len(piece[1])} tensors to vLLM's workers")
                total += flat.numel() * flat.element_size()
        if inflight is not None:
            _wait(inflight[0], self.timeout_s, inflight[2])
        return total

    def _sync_in_process(self, model, wire: List[List[transfer.Piece]], src: int, aliases: bool) -> int:
        """Engines in the trainer's process: each piece is broadcast over the sync group, every rollout rank
        loads it (tied aliases only where its engine wants them, ``wants_tied_aliases``)."""
        rank, is_actor = self.groups.rank, model is not None
        it = self._named_full(model, aliases) if is_actor else None
        # another engine wants tied weights under every name; this one loads the first name only
        skip = set() if self.engine is None or not aliases or wants_tied_aliases(self.engine) \
            else self.engine.shared_weight_names()
        total = 0
        for bucket in wire:
            tensors = dict(next(it) for _ in range(sum(len(entries) for _, entries in bucket))) if is_actor else {}
            loaded = []
            for piece in bucket:
                if rank == src:
                    flat = self._pack(tensors, piece)
                else:
                    flat = torch.empty(sum(transfer.numel(s) for _, s in piece[1]), dtype=getattr(torch, piece[0]),
                                       device=self.device)
                try:
                    comm.broadcast(flat, src, self.groups.group("sync"), timeout_s=self.timeout_s)
                except TimeoutError as e:
                    raise WeightSyncTimeout(f"weight sync: bucket piece of {len(piece[1])} tensors: a rank of the "
                                            f"sync group did not join within --dist_timeout_s. Cause: {e}") from None
                total += flat.numel() * flat.element_size()
                if not is_actor:
                    loaded += [(n, t) for n, t in transfer.split_flat(flat, piece) if n not in skip]
            if loaded and self.engine is not None:
                self.engine.load_weights(loaded)
        if not is_actor and self.engine is not None:
            self.engine.reset_prefix_cache()
        return total

    def sync(self, model=None) -> int:
        if self.groups.plan.separate_rollout:
            return self.sync_broadcast(model)
        return self.sync_colocated(model)
