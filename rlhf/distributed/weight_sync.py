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

import time
from typing import Iterator, List, Optional, Tuple

import torch

from rlhf.distributed import comm, expert_names
from rlhf.distributed import transport as transfer  # the weight-transfer group and its wire format
from rlhf.distributed.gather import full_shape, full_tensor, zero3_param  # noqa: F401 (their home before)
from rlhf.distributed.lora_sync import _engine_name, adapter_config, adapter_meta, export_adapter, is_lora_model, sync_metrics
from rlhf.distributed.shard_sync import ShardSync, shard_params, shard_route
from rlhf.distributed.sync_link import connect, wants_tied_aliases
from rlhf.errors import WeightSyncTimeout

Meta = Tuple[str, Tuple[int, ...], torch.dtype]


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


def _export(model, materialize: bool, aliases: bool = False, dtype: Optional[torch.dtype] = None,
            lora: str = "merge"):
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

    ``lora="base"`` (adapter sync, ``rlhf.distributed.lora_sync``): a LoRA layer's frozen base goes under the
    engine's name, its A and B not at all (they travel as the adapter).
    """
    scal = _lora_scalings(model)
    tied = tied_aliases(model) if aliases else {}
    pending = {}
    for name, p in model.named_parameters():
        mod = None
        for key in (".base_layer.weight", ".lora_A.default.weight", ".lora_B.default.weight"):
            if name.endswith(key) and name[: -len(key)] in scal:
                mod, part = name[: -len(key)], key
        if mod is not None and lora == "base":
            if part == ".base_layer.weight":
                yield _engine_name(name), full_shape(p), p.dtype, full_tensor(p, dtype) if materialize else None
            continue
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


def param_meta(model: torch.nn.Module, aliases: bool = False, lora: str = "merge") -> List[Meta]:
    """(engine name, full shape, dtype) of every weight the engine receives; local, no collective.  ``aliases``:
    tied weights under every name, ``lora``: merged or base only (see ``_export``)."""
    return [(n, shape, dt) for n, shape, dt, _ in _export(model, materialize=False, aliases=aliases, lora=lora)]


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
                 timeout_s: float = 600, device: Optional[torch.device] = None, lora_sync: str = "merged",
                 keep_versions: int = 1, from_shards: bool = False):
        """``lora_sync``: ``adapter`` sends a LoRA actor's base weights once and its adapter at every sync
        (``rlhf.distributed.lora_sync``), ``merged`` W + s B A every time; ``keep_versions``: adapter versions an
        engine keeps (--async_queue_size + 1 under --async_train); ``from_shards``: separate rollout ranks whose
        engines load in the trainer's process get each actor rank's own blocks (``rlhf.distributed.shard_sync``)
        instead of actor rank 0's gathered copy."""
        self.groups = groups
        self.engine = engine
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self._meta: Optional[tuple] = None  # (base/merged weights' meta, adapter meta or None, adapter config)
        self.lora_sync, self.keep_versions, self.from_shards = lora_sync, keep_versions, from_shards
        self.base_sent = False  # adapter sync: the engines hold the base weights (sent once)
        self.version = 0        # adapter sync: the last adapter version sent (vLLM's lora_int_id, >= 1)
        self.last: dict = {}    # the last sync's metrics on this rank: sync_bytes, sync_s, sync_GBps

    def adapter_mode(self, model) -> bool:
        """Adapter sync on this actor rank: --lora_sync adapter, a LoRA model, and an engine that takes adapters
        (none here: the rollout ranks' engines, all of which do)."""
        return self.lora_sync == "adapter" and is_lora_model(model) and \
            (self.engine is None or self.engine.lora_adapters)

    # ---- colocated -------------------------------------------------------------------------------------------
    def _named_full(self, model, aliases: bool = False, lora: str = "merge") -> Iterator[Tuple[str, torch.Tensor]]:
        """Full (unsharded; LoRA merged, or base only) weights under the engine's names; collective over the
        actor group."""
        for name, _, _, t in _export(model, materialize=True, aliases=aliases, dtype=self.dtype, lora=lora):
            yield name, (t.to(self.dtype) if self.dtype is not None else t)

    def sync_colocated(self, model) -> int:
        """Gather and load bucket by bucket; returns bytes loaded.  Adapter sync: the base at the first sync,
        then the adapter as a new version (``engine.load_adapter``)."""
        adapter = self.adapter_mode(model)
        total = 0
        if not (adapter and self.base_sent):
            total += self._load_colocated(model, "base" if adapter else "merge")
            self.base_sent = adapter
        if adapter:
            named = [(n, t) for n, _, _, t in export_adapter(model)]
            self.version += 1
            if self.engine is not None:
                self.engine.load_adapter(self.version, named, adapter_config(model), self.keep_versions)
            total += sum(t.numel() * t.element_size() for _, t in named)
        return total

    def _load_colocated(self, model, lora: str) -> int:
        aliases = wants_tied_aliases(self.engine)
        meta = param_meta(model, aliases, lora)
        it = self._named_full(model, aliases, lora)
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
        receive nothing.  Engines in the trainer's process (HF): with ``from_shards`` every actor rank sends its
        own blocks and the engine's rank assembles them (``shard_sync``; returns this rank's bytes); else buckets
        are broadcast over the sync group and non-zero actor ranks only help unshard (each gather is collective
        over the actor)."""
        plan, rank = self.groups.plan, self.groups.rank
        adapter = self.adapter_mode(model)  # actor ranks; rollout ranks learn it from the metadata
        lora, src = "base" if adapter else "merge", plan.sync_ranks[0]
        if self._link is None and rank in plan.sync_ranks:
            self._link = self._connect(src)
        if self._route is None and model is not None:  # every actor rank alike (same model, same flag)
            self._route = shard_route(model, lora, False) if self.from_shards else "gather"
            if rank == src and self._route == "shards" and (self._link["direct"] or self._link["aliases"]):
                raise RuntimeError("weight sync from every shard needs engines in the trainer's process; these "
                                   "receive in processes of their own (vLLM): build WeightSync(from_shards=False)")
        if rank not in plan.sync_ranks:  # another actor rank: its blocks (shards), or its part of each gather
            sent = 0
            if not (adapter and self.base_sent):
                if self._route == "shards":
                    sent = self._shard_sync(param_meta(model, False, lora)).send(shard_params(model, lora))
                for _ in self._named_full(model, lora=lora) if self._route != "shards" else ():
                    pass
            for _ in export_adapter(model) if adapter else ():
                pass
            self.base_sent = adapter
            return sent
        aliases = self._link["aliases"]
        if self._meta is None:
            mine = None
            if rank == src:
                bm = param_meta(model, aliases, lora)
                if self._link["direct"]:  # vLLM's own processes read MoE experts under per-expert names (expert_names)
                    bm = expert_names.per_expert_meta(bm)
                mine = (bm, adapter_meta(model) if adapter else None,
                        adapter_config(model) if adapter else None, self._route)
            self._meta = comm.broadcast_object(mine, src, self.groups.group("sync"))
        base_meta, ameta, config, self._route = self._meta
        adapter, total = ameta is not None, 0
        if not (adapter and self.base_sent) and self._route == "shards":
            total += self._from_shards(model, base_meta, lora)
        elif not (adapter and self.base_sent):
            stream = self._named_full(model, aliases, "base" if adapter else "merge") if rank == src else None
            if stream is not None and self._link["direct"]:
                stream = expert_names.per_expert(stream)  # as the metadata
            total += self._send(stream, self._wire(base_meta, self.dtype), src, aliases)
        self.base_sent = adapter
        if adapter:
            self.version += 1
            stream = ((n, t) for n, _, _, t in export_adapter(model)) if rank == src else None
            total += self._send(stream, self._wire(ameta, None), src, False, (self.version, config))
        return total

    _route: Optional[str] = None    # "shards" (every actor rank sends its blocks) | "gather" (actor rank 0 sends)
    _shards: Optional[ShardSync] = None

    def _shard_sync(self, meta) -> ShardSync:
        if self._shards is None:
            receivers = [r for r in self.groups.plan.sync_ranks[1:]]
            self._shards = ShardSync(meta, self.groups.ranks("actor"), receivers, self.groups.rank,
                                     self.bucket_bytes, self.dtype, self.device, self.timeout_s)
        return self._shards

    def _from_shards(self, model, meta, lora: str) -> int:
        """Shard route on a sync rank: actor rank 0 sends its blocks, an engine's rank assembles and loads."""
        if model is not None:
            return self._shard_sync(meta).send(shard_params(model, lora))
        total = self._shard_sync(meta).receive(self.engine.load_weights if self.engine is not None else list)
        if self.engine is not None:
            self.engine.reset_prefix_cache()
        return total

    def _send(self, stream, wire, src: int, aliases: bool, adapter=None) -> int:
        """One stream of weights (the base / merged weights, or an adapter version ``adapter`` = (version,
        config)) from actor rank ``src`` to the engines; ``stream`` only on ``src``."""
        if not self._link["direct"]:
            return self._sync_in_process(stream, wire, src, aliases, adapter)
        if self.groups.rank == src:
            return self._send_direct(stream, wire)
        if self._link["joined"]:
            pieces = [p for bucket in wire for p in bucket]
            if adapter is None:
                self.engine.receive_weights(pieces)
                self.engine.reset_prefix_cache()
            else:
                self.engine.receive_adapter(adapter[0], pieces, adapter[1], self.keep_versions)
        return sum(transfer.piece_bytes(p) for bucket in wire for p in bucket)

    def _wire(self, meta: List[Meta], dtype: Optional[torch.dtype]) -> List[List[transfer.Piece]]:
        """The bucket plan as the wire carries it: per bucket, one piece per dtype ``(dtype name, [(engine name,
        shape), ...])``, each sent as one flat tensor (in ``dtype``, else each tensor's own).  Derived from the
        metadata on every rank alike."""
        out = []
        for bucket in bucket_plan(meta, self.bucket_bytes, dtype):
            by_dtype: dict = {}
            for i in bucket:
                dt = str(dtype or meta[i][2]).removeprefix("torch.")
                by_dtype.setdefault(dt, []).append((meta[i][0], list(meta[i][1])))
            out.append(list(by_dtype.items()))
        return out

    def _connect(self, src: int) -> dict:
        return connect(self.groups, self.engine, src, self.timeout_s, self.device)

    def _pack(self, tensors: dict, piece: transfer.Piece) -> torch.Tensor:
        dt = getattr(torch, piece[0])
        return torch.cat([tensors[n].reshape(-1).to(dt) for n, _ in piece[1]]).to(self.device)

    def _send_direct(self, stream, wire: List[List[transfer.Piece]]) -> int:
        """Actor rank 0: gather, pack and broadcast each piece to every vLLM worker.  Double-buffered: the next
        piece is gathered and packed while the previous one is on the wire (peak: two packed pieces and one
        bucket of gathered tensors)."""
        group, it = self._link["group"], stream
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

    def _sync_in_process(self, it, wire: List[List[transfer.Piece]], src: int, aliases: bool, adapter=None) -> int:
        """Engines in the trainer's process: each piece is broadcast over the sync group, every rollout rank
        loads it (tied aliases only where its engine wants them, ``wants_tied_aliases``); an adapter version
        (``adapter`` = (version, config)) is loaded whole once received."""
        rank, is_actor = self.groups.rank, it is not None
        # another engine wants tied weights under every name; this one loads the first name only
        skip = set() if self.engine is None or not aliases or wants_tied_aliases(self.engine) \
            else self.engine.shared_weight_names()
        total, received = 0, []
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
            if adapter is not None:
                received += loaded
            elif loaded and self.engine is not None:
                self.engine.load_weights(loaded)
        if not is_actor and self.engine is not None:
            if adapter is None:
                self.engine.reset_prefix_cache()
            else:
                self.engine.load_adapter(adapter[0], received, adapter[1], self.keep_versions)
        return total

    def sync(self, model=None) -> int:
        """One sync; ``last`` holds its bytes (on this rank: sent on the sending rank, received or loaded on an
        engine's), seconds and GB/s."""
        t0 = time.perf_counter()
        n = self.sync_broadcast(model) if self.groups.plan.separate_rollout else self.sync_colocated(model)
        self.last = sync_metrics(n, time.perf_counter() - t0)
        return n
