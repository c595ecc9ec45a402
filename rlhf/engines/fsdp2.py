"""FSDP2 (torch.distributed.fsdp.fully_shard) training engine; works on CPU with gloo."""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from rlhf.distributed import comm
from rlhf.distributed.expert_parallel import ep_device_mesh, expert_params, reduce_expert_grads, shard_experts
from rlhf.distributed.mesh import RoleMesh, world_mesh
from rlhf.distributed.tensor_parallel import apply_tp, clip_grad_norm, fsdp_submesh, role_device_mesh, tp_partial_grads
from rlhf.engines.train import EngineSpec, TrainEngine, is_last, make_optimizer


def decoder_layers(model: torch.nn.Module):
    """The repeated transformer blocks (wrapped one FSDP unit each)."""
    names = getattr(model, "_no_split_modules", None) or []
    inner = getattr(model, "base_model", model)
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        blocks = [m for m in inner.modules() if type(m).__name__.endswith("DecoderLayer")]
    return blocks


def model_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too, e.g. rotary inv_freq), by name, in module order;
    a tied weight once.  The same names before and after ``fully_shard`` (it swaps parameters in place)."""
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def host_copies(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``model_tensors`` as detached tensors: new tensor objects over the same host storage (no copy).

    ``fully_shard`` moves every parameter and buffer of a unit to the mesh's device by swapping its ``.data``
    (torch/distributed/fsdp/_fully_shard/_fsdp_init.py ``_move_states_to_device``: ``tensor.data =
    tensor.to(device)``), and a live Parameter kept aside would then hold that device copy after FSDP has replaced
    the Parameter by its shard: block by block the whole model would pile up on the source rank's GPU.  A detached
    tensor is not touched by that swap and keeps the host storage, as veRL keeps ``model.state_dict()`` (detached)
    before ``apply_fsdp2`` (verl/workers/fsdp_workers.py, ``fsdp2_load_full_state_dict``)."""
    return {name: t.detach() for name, t in model_tensors(model).items()}


def to_meta(model: torch.nn.Module) -> None:
    """Every parameter and buffer onto the meta device, in place: a Parameter keeps its identity (``swap_tensors``),
    so tied weights stay tied and the module has the same tensors under the same names as a model built on meta.
    The source rank calls it after ``host_copies``: ``fully_shard`` then skips the meta tensors
    (``_move_states_to_device``: "Keep meta-device tensors on meta device for deferred init"), so no full block
    ever reaches the source's device; its shards are allocated by ``to_empty`` and filled like every member's."""
    for p in model.parameters():
        if p.device.type != "meta":
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                           requires_grad=p.requires_grad))
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device.type != "meta":
                mod._buffers[name] = torch.empty_like(b, device="meta")


def fill_units(model: torch.nn.Module, names) -> List[List[str]]:
    """The tensor names in fill order, one list per FSDP unit: each decoder block, then the rest (embedding, final
    norm, head: the root unit).  A function of the module tree: the same on every rank."""
    prefix = {id(m): n for n, m in model.named_modules()}
    units, taken = [], set()
    for block in decoder_layers(model):
        head = prefix[id(block)] + "."
        unit = [n for n in names if n.startswith(head) and n not in taken]
        taken.update(unit)
        units.append(unit)
    units.append([n for n in names if n not in taken])
    return [u for u in units if u]


def fill_from_first(model: torch.nn.Module, full: Optional[Dict[str, torch.Tensor]], group, src: int,
                    device: torch.device, after_unit: Optional[Callable[[List[str]], None]] = None) -> None:
    """Fill a sharded (or plain) model whose storage is uninitialised from ``full``, which only global rank
    ``src`` holds (host tensors, see ``host_copies``); collective over ``group``, one tensor at a time, unit by
    unit (``fill_units``).

    For each tensor the source moves the full tensor to the device, one broadcast over the group carries it,
    and every member keeps its own shard (``distribute_tensor(..., src_data_rank=None)``: a local slice, no
    more communication).  So a member's device holds its shards plus one full tensor at a time: never the
    whole model (veRL ``fsdp2_load_full_state_dict`` and torch's ``set_model_state_dict(broadcast_from_rank0)``
    do the same, but the latter only from global rank 0, so not for a role on a sub-group).  The source drops
    each host tensor from ``full`` once its shards are filled, so its host copy shrinks unit by unit (the
    caller must hold no other reference).  ``after_unit(names)`` runs after each unit (tests measure there)."""
    me = comm.rank()
    tensors = model_tensors(model)
    for unit in fill_units(model, list(tensors)):
        for name in unit:
            t = tensors[name]
            local = t.to_local() if isinstance(t, DTensor) else t
            if me == src:
                x = full.pop(name).to(device=device, dtype=local.dtype)
            else:
                x = torch.empty(t.shape, dtype=local.dtype, device=device)
            comm.broadcast(x, src, group)
            with torch.no_grad():
                if isinstance(t, DTensor):
                    local.copy_(distribute_tensor(x, t.device_mesh, t.placements, src_data_rank=None).to_local())
                else:
                    local.copy_(x)
            del x
        if after_unit is not None:
            after_unit(unit)


def mixed_precision(bf16: bool) -> MixedPrecisionPolicy:
    """--bf16: parameters are stored (and the optimizer steps) in fp32, each FSDP unit's forward and backward
    compute in bf16 and gradients are reduced in fp32 (veRL's actor default, verl/workers/fsdp_workers.py:
    fp32 model dtype, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``)."""
    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload_policy(adam_offload: bool, device: torch.device) -> OffloadPolicy:
    """--adam_offload: FSDP2's ``CPUOffloadPolicy`` (torch.distributed.fsdp fully_shard(offload_policy=...)): the
    sharded parameters and gradients live in host memory, each unit's shards are copied to the device for its
    all-gather, gradients come back after the reduce-scatter and the optimizer steps on the CPU with its state
    there (torchtitan's --training.enable_cpu_offload, veRL's FSDP2 offload_policy).  Pinned host memory (faster
    copies that overlap compute) needs an accelerator: pin_memory is on where the device is not the CPU."""
    if not adam_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type != "cpu")


def buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move the module's buffers (rotary ``inv_freq``, ...; FSDP does not manage them) to ``device``."""
    for mod in model.modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and b.device != device:
                mod._buffers[name] = b.to(device)


class FSDP2Engine(TrainEngine):
    def __init__(self, model: torch.nn.Module, spec: EngineSpec, mesh: Optional[RoleMesh] = None, device=None,
                 load_on_first: bool = False):
        """``mesh``: the role's mesh (default every rank, ``world_mesh``); the model is sharded over the whole role
        (``mesh.group``: every dimension flattened, as torchtitan's FSDP over ``dp_shard_cp``,
        torchtitan/distributed/parallel_dims.py), so SP ranks hold shards too and the gradient is averaged over
        all of them.  load_on_first: only the group's first rank holds real weights (the others built ``model``
        on the meta device).  The model is sharded first, then each rank's shards are allocated on its device and filled by
        broadcast from that rank (``fill_from_first``): no rank ever holds the whole model on its device, and
        the checkpoint is read once per group, not once per member."""
        self.spec = spec
        self.mesh = mesh if mesh is not None else world_mesh()
        self.group = self.mesh.group if self.mesh.group is not None else comm.world_group()
        self.device = device or torch.device("cpu")
        # --tp_size / --fsdp_shard_size: the role's (dp_replicate?, dp_shard, tp?) DeviceMesh (None: neither); the
        # TP ranks of a data-parallel rank compute the same rows, so the data-parallel ranks are the FSDP ones
        self.device_mesh = role_device_mesh(self.mesh, self.device.type)
        self.tp_group = self.mesh.dim_groups.get("tp") if self.device_mesh is not None else None
        self.tp_partial: List[str] = []
        self.experts: List[torch.nn.Parameter] = []  # --ep_size: the expert shards FSDP2 leaves alone
        self.dp = comm.world_size(self.group) // self.mesh.size_of("tp")
        per_step = spec.micro_batch_size * self.dp
        if spec.train_batch_size % per_step:
            raise ValueError(f"--train_batch_size {spec.train_batch_size} must be a multiple of --micro_train_batch_size "
                             f"{spec.micro_batch_size} x data-parallel ranks {self.dp} = {per_step}")
        self.accum_steps = spec.train_batch_size // per_step
        src = comm.global_rank(self.group, 0)
        first = comm.rank() == src
        if self.device_mesh is not None and first:
            print(f"[fsdp2] {self.mesh.name}: DeviceMesh {dict(zip(self.device_mesh.mesh_dim_names, self.device_mesh.shape))}"
                  f" (--tp_size, --fsdp_shard_size)", flush=True)
        full = None
        if load_on_first and first:  # the source keeps host copies and shards on meta like every member
            full = host_copies(model)
            to_meta(model)
        # one rank and fp32: sharding would only add all-gather and DTensor overhead to every op (measured: 2x
        # slower forward on the tiny model), so the module stays plain; same optimizer, schedule and checkpoints.
        # --adam_offload: sharded too (at one rank a single shard), since only FSDP's units offload
        self.adam_offload = bool(spec.adam_offload and spec.trainable)
        self.sharded = self.dp > 1 or spec.bf16 or self.adam_offload or self.device_mesh is not None
        if self.sharded:  # shard first (on the host or the meta device), then move shards
            device_mesh = DeviceMesh.from_group(self.group, self.device.type)
            if self.device_mesh is not None:  # TP before FSDP (torchtitan's parallelize order), FSDP over dp only
                if self.tp_group is not None:
                    self.tp_partial = apply_tp(model, self.device_mesh["tp"], decoder_layers(model),
                                               self.mesh.size_of("sp"))
                device_mesh = fsdp_submesh(self.device_mesh)
            if self.mesh.ep_size > 1:  # --ep_size: experts over (dp_mod_ep, ep), left out of FSDP2 (expert_parallel)
                per = shard_experts(model, ep_device_mesh(self.mesh, self.device.type))
                self.experts = expert_params(model)
                if first:
                    print(f"[fsdp2] {self.mesh.name}: --ep_size {self.mesh.ep_size}: {per} experts per rank", flush=True)
            mp = mixed_precision(spec.bf16)
            reshard = spec.zero_stage >= 3
            off = offload_policy(self.adam_offload, self.device)
            for block in decoder_layers(model):
                fully_shard(block, mesh=device_mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=off,
                            ignored_params=set(self.experts) or None)
            # the root unit (embedding, final norm, LM head) stays unsharded from forward to backward, torch's own
            # default for the root (its params are all-gathered again at once for backward), and what lets the
            # fused LM head read the unsharded head weight after the forward (lm_head.fusable_head)
            fully_shard(model, mesh=device_mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=off,
                        ignored_params=set(self.experts) or None)
        home = torch.device("cpu") if self.adam_offload else self.device  # offloaded shards stay on the host
        if load_on_first:
            model.to_empty(device=home)
            fill_from_first(model, full, self.group, src, self.device)
            del full
        else:
            model.to(home)
        if self.adam_offload:
            buffers_to(model, self.device)
        # gradient accumulation: reduce-scatter every micro-batch (sharded gradients only) unless the user opts
        # in to no-sync, which keeps full unsharded fp32 gradients between micro-batches (torchtitan, veRL: sync)
        self.no_sync = bool(spec.accum_no_sync) and isinstance(model, FSDPModule)
        if self.no_sync and first:
            n = sum(p.numel() for p in model.parameters() if p.requires_grad)
            print(f"[fsdp2] --grad_accum_no_sync: every rank keeps full unsharded fp32 gradients between "
                  f"micro-batches: {n * 4 / 2**30:.2f} GiB per rank (sharded: {n * 4 / self.dp / 2**30:.2f} GiB)",
                  flush=True)
        self.model = model
        self.optimizer = None
        self.scheduler = None
        if spec.trainable:
            # fused: one kernel for all parameters (CPU and CUDA; DTensor shards too): 4.6x faster step on CPU
            self.optimizer, self.scheduler = make_optimizer(model, spec, fused=True)
        else:
            model.requires_grad_(False)
            model.eval()
        self._offloaded = False

    # ---- training ----------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, micro_step: int, last: Optional[bool] = None) -> None:
        if self.no_sync:
            self.model.set_requires_gradient_sync(is_last(micro_step, self.accum_steps, last))
        (loss / self.accum_steps).backward()

    def step(self) -> Dict[str, float]:
        self._onload_optimizer()  # after a sleep the optimizer state comes back here, for the update only
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.experts:  # to the data-parallel mean FSDP2 gives the dense gradients
            reduce_expert_grads(self.experts, self.mesh.dim_groups.get("dp_mod_ep"), self.dp)
        if self.device_mesh is not None or self.experts:  # gradients on several meshes (tensor_parallel)
            tp_partial_grads(self.model, self.tp_partial, self.tp_group)
            norm = clip_grad_norm(params, self.spec.max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.spec.max_norm)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if torch.isfinite(torch.tensor(norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"grad_norm": norm, "lr": self.scheduler.get_last_lr()[0]}

    # ---- checkpoint --------------------------------------------------------------------------------------------
    def _state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer) if self.optimizer else (
            get_state_dict(self.model, [])[0], {})
        state = {"model": msd}
        if self.optimizer:
            state["optim"] = osd
        return state

    def save_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        state = self._state()
        dcp.save(state, checkpoint_id=path, process_group=self.group)
        if self.scheduler is not None and comm.rank(self.group) == 0:
            torch.save(self.scheduler.state_dict(), os.path.join(path, "scheduler.pt"))

    def load_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=path, process_group=self.group)
        if self.optimizer:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            self.scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=False))
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, state["model"])

    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """Full, unsharded weights on the group's rank 0 (None elsewhere); collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if comm.rank(self.group) == 0 else None

    # ---- sleep / wake ------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Offload params, grads and optimizer state to CPU (frees device memory; a no-op move on CPU)."""
        if self._offloaded or self.device.type == "cpu":
            self._offloaded = True
            return
        if isinstance(self.model, FSDPModule):  # the root unit may still hold unsharded params from a forward
            self.model.reshard()
        if self.adam_offload:  # shards, gradients and optimizer state live on the host already
            buffers_to(self.model, torch.device("cpu"))
        else:
            self.model.to("cpu", non_blocking=True)
        if not self.adam_offload:
            optimizer_state_to(self.optimizer, torch.device("cpu"))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._offloaded = True

    def wake(self, tags=None) -> None:
        """Bring back the weights (and buffers) only: what every phase needs.  The optimizer state stays on the
        host until ``step`` needs it (``_onload_optimizer``), so the forward-only phases that wake this engine
        (old log-probs, the weight sync, a save) do not move it twice for nothing (veRL moves them apart too:
        ``load_fsdp_model_to_gpu`` for every phase, ``load_fsdp_optimizer`` in ``update_actor`` only,
        verl/workers/fsdp_workers.py)."""
        if not self._offloaded:
            return
        if self.device.type != "cpu" and self.adam_offload:
            buffers_to(self.model, self.device)
        elif self.device.type != "cpu":
            self.model.to(self.device, non_blocking=True)
            torch.cuda.synchronize()
        self._offloaded = False

    def _onload_optimizer(self) -> None:
        """The optimizer state onto the device where a sleep left it on the host (--adam_offload: it lives there)."""
        if self.optimizer is not None and not self.adam_offload and self.device.type != "cpu":
            if optimizer_state_to(self.optimizer, self.device):
                torch.cuda.synchronize()


def optimizer_state_to(optimizer, device: torch.device) -> int:
    """Move every tensor of the optimizer's state that is not on ``device`` there; returns how many moved."""
    moved = 0
    for st in (optimizer.state.values() if optimizer is not None else ()):
        for k, v in st.items():
            if torch.is_tensor(v) and v.device != device:
                st[k] = v.to(device, non_blocking=True)
                moved += 1
    return moved
