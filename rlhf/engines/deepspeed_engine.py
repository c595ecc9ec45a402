"""DeepSpeed ZeRO engine (``--backend deepspeed``), config generated from the same flags.

Needs the [deepspeed] extra.  Runs on CPU too (DeepSpeed selects its CPU accelerator by itself).

Precision (issue 24 item 5).  The model arrives in fp32.  With ``--bf16`` DeepSpeed casts the module's
parameters (not its buffers) to bf16, the compute dtype (deepspeed/runtime/engine.py
``_configure_distributed_model`` -> ``_cast_module_mixed_precision``), and its optimizer wrapper keeps fp32 master
partitions which the client AdamW steps, so AdamW's state is fp32 as well
(engine.py ``_do_optimizer_sanity_check`` / ``_configure_optimizer``, DeepSpeed 0.19.8):

* ZeRO-1/2: ``DeepSpeedZeroOptimizer.single_partition_of_fp32_groups``;
* ZeRO-3: ``DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat``;
* stage 0: ``FP16_UnfusedOptimizer.fp32_groups`` (bf16 as its low-precision dtype).

Each wrapper puts its fp32 tensors into the client optimizer's ``param_groups``; ``master_dtypes`` reads them
back (tests/multiprocess/test_deepspeed.py asserts fp32).

Frozen models (ref, reward) never go through ``deepspeed.init_inference``: it converts the module to fp16 and
injects inference kernels.  ZeRO-3: ``deepspeed.initialize`` without an optimizer on an eval config, as OpenRLHF
does (openrlhf/utils/deepspeed/deepspeed_utils.py ``get_eval_ds_config``): partitioned parameters, bf16 with
``--bf16``.  Stage < 3: a plain module (nothing to shard), parameters cast to bf16 with ``--bf16``.

Process groups: a DeepSpeed engine must span every rank of the job (``--colocate_all_models``): DeepSpeed issues
world collectives of its own (``_check_whole_world``).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from rlhf.distributed import comm
from rlhf.distributed.mesh import world_mesh
from rlhf.engines.train import EngineSpec, TrainEngine, is_last, make_optimizer


def deepspeed_config(spec: EngineSpec, dp: int, offload_optimizer: Optional[bool] = None,
                     hidden_size: Optional[int] = None, ds_cpu_adam: bool = True) -> dict:
    """The ds_config dict for a ZeRO stage, batch sizes and precision.

    A frozen spec (``trainable=False``) gets the eval config: no gradient clipping, ZeRO-3 parameter partitioning
    only (OpenRLHF ``get_eval_ds_config``).  ``bf16.enabled`` keeps fp32 masters (module docstring).
    ZeRO-3 keeps parameters under ``10 * hidden_size`` elements whole on every rank (transformers'
    ``HfTrainerDeepSpeedConfig`` fills "auto" so, transformers/integrations/deepspeed.py); 1e4 without a size.

    ``offload_optimizer`` (default: ``spec.adam_offload``, --adam_offload): ZeRO's optimizer offload,
    ``offload_optimizer: {device: cpu, pin_memory: true}`` as OpenRLHF's ``get_train_ds_config(adam_offload=True)``
    (openrlhf/utils/deepspeed/deepspeed_utils.py); DeepSpeed then keeps the fp32 master partitions and the Adam
    state in host memory and steps there (stages 1-3; stage 0 is refused at parse time).  DeepSpeed refuses a
    client optimizer other than its own CPU Adam under offload (``zero_force_ds_cpu_optimizer``,
    deepspeed/runtime/engine.py ``_configure_optimizer``): ``ds_cpu_adam=False`` (the torch AdamW, used on CPU-only
    machines, where DeepSpeedCPUAdam's JIT build takes a minute) turns that check off."""
    if offload_optimizer is None:
        offload_optimizer = bool(spec.adam_offload and spec.trainable)
    accum = spec.train_batch_size // (spec.micro_batch_size * dp)
    persist = 10 * hidden_size if hidden_size else 1e4
    zero = {"stage": spec.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 5e8, "stage3_param_persistence_threshold": persist,
            "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e8,
            "stage3_gather_16bit_weights_on_model_save": True}
    if spec.zero_stage < 3:
        for k in [k for k in zero if k.startswith("stage3")]:
            del zero[k]
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    ds_config = {
        "train_batch_size": spec.train_batch_size,
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": spec.max_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(spec.bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload_optimizer and not ds_cpu_adam:
        ds_config["zero_force_ds_cpu_optimizer"] = False
    if spec.dynamic_batch and spec.trainable:
        # token budgets: the micro-batch count varies from step to step, so DeepSpeed does not count micro-steps;
        # the caller's step() is the accumulation boundary (DeepSpeed's "unmanaged" gradient accumulation,
        # deepspeed/runtime/engine.py is_gradient_accumulation_boundary; it refuses overlap_comm below stage 2).
        # The loss is still divided by gradient_accumulation_steps, as the other engines divide by accum_steps.
        ds_config["managed_gradient_accumulation"] = False
        if spec.zero_stage < 2:
            zero["overlap_comm"] = False
    if not spec.trainable:
        del ds_config["gradient_clipping"]
    return ds_config


def offload_optimizer_for(model: torch.nn.Module, spec: EngineSpec, device) -> tuple:
    """(optimizer, scheduler, DeepSpeed CPU Adam?) for --adam_offload: DeepSpeed's ``DeepSpeedCPUAdam`` (AdamW mode)
    where an accelerator runs the model, as OpenRLHF (``DeepSpeedCPUAdam if adam_offload``,
    openrlhf/utils/deepspeed/deepspeed.py ``create_optimizer``); on a CPU-only machine the torch AdamW (same update
    rule; the state is in host memory either way)."""
    if device is None or torch.device(device).type == "cpu":
        return (*make_optimizer(model, spec), False)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from rlhf.engines.train import lr_lambda

    opt = DeepSpeedCPUAdam([p for p in model.parameters() if p.requires_grad], lr=spec.lr, betas=tuple(spec.betas),
                           weight_decay=spec.weight_decay, adamw_mode=True)
    warm = int(spec.warmup_ratio * spec.total_steps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec.scheduler, spec.total_steps, warm)), True


def _import_deepspeed():
    import os

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        # what DeepSpeed's detection would pick, said in advance: else every rank logs "Setting accelerator to CPU.
        # If you have GPU or other accelerator, we were unable to detect it." (deepspeed/accelerator/
        # real_accelerator.py ``get_accelerator``: the override path picks the same CPU accelerator silently)
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed
    except ImportError as e:
        raise RuntimeError("--backend deepspeed needs DeepSpeed: pip install 'rlhf[deepspeed]', "
                           "or use --backend fsdp2") from e
    return deepspeed


def _check_whole_world(group) -> None:
    """DeepSpeed needs every rank of the job: without an mpu it shards over the whole world
    (deepspeed/utils/groups.py ``_get_data_parallel_group`` -> ``_clone_world_group``), and even with one ZeRO-3
    runs a world barrier while it sets up (deepspeed/runtime/zero/stage3.py ``_setup_for_real_optimizer``:
    a world-wide barrier; measured with DeepSpeed 0.19.8: ranks 0-1 of 3 fail there), so a role on a sub-group would
    hang or fail inside ``deepspeed.initialize``."""
    if comm.world_size(group) != comm.world_size():
        raise ValueError(f"--backend deepspeed: a role on {comm.world_size(group)} of {comm.world_size()} ranks; "
                         f"DeepSpeed shards over every rank of the job. Put every role on all ranks "
                         f"(--colocate_all_models) or use --backend fsdp2 for roles on ranks of their own")


def freeze_plain(model: torch.nn.Module, bf16: bool, device) -> torch.nn.Module:
    """A frozen model for stage < 3: eval mode, no gradients, on ``device``; with ``bf16`` its parameters (not its
    buffers, e.g. rotary ``inv_freq``) in bf16, as DeepSpeed's own cast does."""
    model.requires_grad_(False)
    model.eval()
    if bf16:
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    return model.to(device) if device is not None else model


def module_bytes(model: torch.nn.Module, bf16: bool) -> int:
    """The bytes of the module's parameters as DeepSpeed keeps them on the device (bf16 under --bf16)."""
    return sum(p.numel() * (2 if bf16 and p.is_floating_point() else p.element_size()) for p in model.parameters())


def check_whole_module_fits(nbytes: int, free_bytes: int, zero_stage: int, device: str = "the GPU") -> None:
    """ZeRO stages below 3 keep the whole module on every rank's device (DeepSpeed's ``module.to(device)`` in
    deepspeed/runtime/engine.py ``_configure_distributed_model``; a frozen plain module the same): refuse, with
    the numbers, a model whose parameters alone exceed the device's free memory, before it is moved there."""
    if zero_stage >= 3 or nbytes <= free_bytes:
        return
    gib = 2 ** 30
    raise ValueError(f"--backend deepspeed --zero_stage {zero_stage} keeps the whole model on every GPU: its "
                     f"parameters are {nbytes / gib:.1f} GiB, {device} has {free_bytes / gib:.1f} GiB free. Use "
                     f"--zero_stage 3 (parameters partitioned over the ranks as they are placed) or --backend fsdp2")


def partition_on_placement(deepspeed, model: torch.nn.Module, ds_config: dict, bf16: bool, device) -> None:
    """ZeRO-3 without the whole model on any device: each parameter in turn is moved to the device, broadcast
    from rank 0 and partitioned (``deepspeed.zero.Init(module=model)``: "partition the model as if it was
    constructed in the context", deepspeed/runtime/zero/partition_parameters.py ``_convert_to_zero_parameters``),
    so a rank holds its partitions plus one full parameter.  ``deepspeed.initialize`` then finds a ZeRO-Init model
    and leaves its placement alone (engine.py ``_configure_distributed_model``: ``is_zero_init_model`` skips
    ``module.to(device)``, which would put the whole model on every GPU first; OpenRLHF and transformers reach the
    same state by building under ``zero.Init`` via ``HfDeepSpeedConfig``).  ZeRO-Init parameters must already be
    in the compute dtype (engine.py ``_cast_module_mixed_precision`` skips them): under --bf16 each is cast on the
    host first, as DeepSpeed's own cast would (the fp32 masters come from the bf16 values either way); buffers
    (rotary ``inv_freq``) are not partitioned and go to the device as ``module.to`` would have taken them."""
    if bf16:
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != torch.bfloat16:
                p.data = p.data.to(torch.bfloat16)
    deepspeed.init_distributed()  # DeepSpeed's comm over torch's existing world (zero.Init sizes the partitions by it)
    deepspeed.zero.Init(module=model, config_dict_or_path=ds_config, mem_efficient_linear=False)
    if device is not None:
        for mod in model.modules():
            for name, b in mod.named_buffers(recurse=False):
                if b is not None and b.device != torch.device(device):
                    mod._buffers[name] = b.to(device)


# where each DeepSpeed optimizer wrapper keeps the tensors the client optimizer steps (DeepSpeed 0.19.8): ZeRO-3
# (stage3.py; it hands them to the client optimizer only during step), ZeRO-1/2 (stage_1_and_2.py),
# BF16_Optimizer (bf16_optimizer.py), FP16_UnfusedOptimizer (fp16/unfused_optimizer.py, stage 0)
MASTER_ATTRS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition",
                "fp32_groups")


def master_tensors(ds_optimizer) -> list:
    """The master tensors of a DeepSpeed optimizer wrapper; a bare optimizer's parameters otherwise."""
    for attr in MASTER_ATTRS:
        groups = getattr(ds_optimizer, attr, None)
        if groups:
            return [t for g in groups for t in (g if isinstance(g, (list, tuple)) else [g])]
    return [p for g in ds_optimizer.param_groups for p in g["params"]]


class DeepSpeedEngine(TrainEngine):
    def __init__(self, model: torch.nn.Module, spec: EngineSpec, group=None, device=None, mesh=None):
        deepspeed = _import_deepspeed()
        self.spec = spec
        self.mesh = mesh if mesh is not None else world_mesh()  # the role's mesh (rlhf.distributed.mesh)
        self.group = group if group is not None else self.mesh.group
        _check_whole_world(self.group)
        dp = comm.world_size(self.group)
        per_step = spec.micro_batch_size * dp
        if spec.train_batch_size % per_step:
            raise ValueError(f"--train_batch_size {spec.train_batch_size} must be a multiple of "
                             f"--micro_train_batch_size {spec.micro_batch_size} x data-parallel ranks {dp} = {per_step}")
        self.accum_steps = spec.train_batch_size // per_step
        self.zero3 = spec.zero_stage == 3
        self.optimizer = self.scheduler = None
        self._offloaded = False
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        self._check_fits(model)
        if self.zero3:  # before the optimizer is built: it holds the (then partitioned) parameters
            partition_on_placement(deepspeed, model, deepspeed_config(spec, dp, hidden_size=hidden), spec.bf16,
                                   comm.device())
        cpu_adam = False
        if spec.trainable and spec.adam_offload:
            opt, sched, cpu_adam = offload_optimizer_for(model, spec, comm.device())
        elif spec.trainable:
            opt, sched = make_optimizer(model, spec)  # torch AdamW: no DeepSpeed op to JIT-build
        ds_config = deepspeed_config(spec, dp, hidden_size=hidden, ds_cpu_adam=cpu_adam)
        self.config = ds_config
        if spec.trainable:
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=opt, lr_scheduler=sched, config=ds_config)
            self.model = self.ds.module
            if spec.dynamic_batch and not hasattr(self.ds, "managed_gradient_accumulation"):
                raise RuntimeError(f"--use_dynamic_batch with --backend deepspeed needs DeepSpeed's unmanaged "
                                   f"gradient accumulation (managed_gradient_accumulation; 0.19.8 has it), not in "
                                   f"DeepSpeed {deepspeed.__version__}: pip install 'deepspeed>=0.19.8', or use "
                                   f"--backend fsdp2")
        elif self.zero3:
            model.requires_grad_(False)
            model.eval()
            self.ds = deepspeed.initialize(model=model, config=ds_config)[0]
            self.model = self.ds.module
        else:
            self.ds = None
            self.model = freeze_plain(model, spec.bf16, device)

    def _check_fits(self, model: torch.nn.Module) -> None:
        dev = comm.device()
        if self.zero3 or dev.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(dev)
        check_whole_module_fits(module_bytes(model, self.spec.bf16), free, self.spec.zero_stage, str(dev))

    # ---- training ----------------------------------------------------------------------------------------------
    def backward(self, loss, micro_step: int, last: Optional[bool] = None) -> None:
        """DeepSpeed scales by 1/accum itself and wants step() after every micro batch.  Token-budget
        micro-batches (``spec.dynamic_batch``; their count varies): DeepSpeed's unmanaged accumulation
        (``deepspeed_config``): backward only, and ``step`` once after the last.  (OpenRLHF sets accumulation 1
        and steps after the last micro-batch; here, with forwards through ``ds.module``, that kept only the last
        micro-batch's gradient, and so did ``set_gradient_accumulation_boundary`` under ZeRO-3:
        tests/helpers/batching_checks.py ``check_deepspeed_token_budgets`` compares with fixed micro-batches.)"""
        self.ds.backward(loss)
        clear = getattr(self.ds.optimizer, "clear_backward_seen_flag", None) if self.zero3 else None
        if clear is not None:
            # ZeRO-3 (DeepSpeed 0.19) counts its micro-steps in clear_backward_seen_flag, which
            # DeepSpeedEngine.forward calls first (deepspeed/runtime/engine.py forward; zero/stage3.py: micro-step 0
            # copies the reduced gradient partition, later ones add to it).  The trainers' forwards go through
            # ds.module, so without this call every micro-batch overwrote the previous one's gradient (measured:
            # 2 micro-batches of 1 row, grad norm 2.05 instead of 3.20); called after each backward, the next one
            # accumulates (a later DeepSpeedEngine.forward finds the flag cleared and counts nothing twice)
            clear()
        if not self.spec.dynamic_batch and not is_last(micro_step, self.accum_steps, last):
            self.ds.step()

    def step(self) -> Dict[str, float]:
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else 0.0, "lr": self.scheduler.get_last_lr()[0]}

    def master_dtypes(self) -> Dict[str, set]:
        """The dtypes of what the optimizer steps (``master``), of its state (``optim_state``) and of the module's
        parameters (``compute``): under ``--bf16`` fp32, fp32 and bf16 (module docstring)."""
        basic = self.ds.basic_optimizer
        masters = {t.dtype for t in master_tensors(self.ds.optimizer)}
        state = {v.dtype for s in basic.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"}
        return {"master": masters, "optim_state": state, "compute": {p.dtype for p in self.model.parameters()}}

    # ---- checkpoint --------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        if self.ds is None:
            raise RuntimeError("a frozen model under --backend deepspeed --zero_stage < 3 has no checkpoint state")
        self.ds.save_checkpoint(path, tag="ds")

    def load_checkpoint(self, path: str) -> None:
        if self.ds is None:
            raise RuntimeError("a frozen model under --backend deepspeed --zero_stage < 3 has no checkpoint state")
        self.ds.load_checkpoint(path, tag="ds")

    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The full weights on the group's first rank (None elsewhere), under ``model.state_dict()``'s names;
        collective over the group.  Trainable: the fp32 masters where DeepSpeed keeps them
        (deepspeed/utils/tensor_fragment.py ``safe_get_full_fp32_param``, itself a collective under ZeRO 1-3),
        so a ``--bf16`` run exports fp32 weights like FSDP2's; else the module's (gathered under ZeRO-3)."""
        from rlhf.distributed.weight_sync import full_tensor

        first = comm.rank(self.group) == 0
        out = {} if first else None
        stage0 = self._stage0_masters()
        for name, t in self.model.state_dict(keep_vars=True).items():
            full = None
            if isinstance(t, torch.nn.Parameter) and t.requires_grad:
                full = stage0[id(t)] if id(t) in stage0 else self._master(t)
            if full is None:
                full = full_tensor(t)
            if first:
                out[name] = full.detach().to("cpu", copy=True)
        return out

    def _stage0_masters(self) -> Dict[int, torch.Tensor]:
        """Stage 0 under --bf16 (FP16_UnfusedOptimizer): its fp32 copy of each bf16 parameter, by id; it keeps
        ``fp16_groups`` and ``fp32_groups`` side by side (deepspeed/runtime/fp16/unfused_optimizer.py)."""
        opt = self.ds.optimizer if self.ds is not None else None
        if opt is None or not hasattr(opt, "fp16_groups") or not hasattr(opt, "fp32_groups"):
            return {}
        return {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups) for lp, hp in zip(lps, hps)}

    def _master(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        if self.optimizer is None:
            return None
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(p)

    # ---- sleep / wake ------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Release device memory until wake: a trainable engine offloads its ZeRO states to the host (ZeRO 1-3:
        DeepSpeed's ``offload_states``, as OpenRLHF ``offload_deepspeed_states``); a frozen ZeRO-3 model drops its gathered
        parameters (``empty_partition_cache``); a frozen plain module moves to the host.  On CPU: nothing to do."""
        if self._offloaded or comm.device().type == "cpu":
            self._offloaded = True
            return
        if self.ds is None:
            self.model.to("cpu")
        elif self.optimizer is not None and self.spec.zero_stage > 0:
            self.ds.offload_states()
        else:
            self.ds.empty_partition_cache()
        torch.cuda.empty_cache()
        self._offloaded = True

    def wake(self, tags=None) -> None:
        if not self._offloaded:
            return
        if comm.device().type != "cpu":
            if self.ds is None:
                self.model.to(comm.device())
            elif self.optimizer is not None and self.spec.zero_stage > 0:
                self.ds.reload_states()
        self._offloaded = False
