"""Shared loop for SFT, reward-model and DPO training: data -> micro-batches -> engine -> metrics / eval / save.

A ``Task`` supplies the model(s), the tokenized samples, the collate and the loss;
the loop owns batching, accumulation, logging, checkpoints and the HF export.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Dict, List, Optional

import torch

from rlhf import checkpoint as ckpt
from rlhf.algorithms.seqlen_balancing import OVER_BUDGET, Item, plan_step
from rlhf.config.batching_checks import row_budgets
from rlhf.config.preflight import preflight
from rlhf.console import print0
from rlhf.data.images import ImageInputs
from rlhf.data.loading import load_train_eval
from rlhf.data.screen import screen_rows
from rlhf.distributed import comm, micro_plan, shard_rows
from rlhf.distributed.failfast import guarded
from rlhf.distributed.groups import Groups, build_groups, nnodes_from_env
from rlhf.distributed.placement import supervised_placement
from rlhf.distributed.watchdog import Watchdog
from rlhf.engines.train import spec_from_config
from rlhf.models import moe
from rlhf.models.load import load_tokenizer, resolve_pretrain
from rlhf.roles.actor import Actor
from rlhf.roles.base import Roles, model_role
from rlhf.roles.reference import build_reference
from rlhf.utils.cadence import Cadence, planned_steps
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.preempt import StopSignal


class Task:
    name = "task"
    required_keys: Dict[str, str] = {}
    device: Optional[torch.device] = None  # the engine's compute device (SupervisedTrainer sets it; see ``batch``)
    ref = None  # the Reference role's engine where ``needs_reference`` (SupervisedTrainer sets it), else None
    images = None  # a vision-language model's rlhf.data.images.ImageInputs (SupervisedTrainer sets it), else None
    freeze_visual = False  # --freeze_visual_encoder (SupervisedTrainer sets it)

    def __init__(self, model_config, data, algorithm, tokenizer):
        """``model_config``, ``data``, ``algorithm``: the config's groups a task reads (rlhf.config.schema)."""
        self.model_config, self.data, self.algorithm, self.tokenizer = model_config, data, algorithm, tokenizer

    def build_model(self, path: str, on_meta: bool = False): ...

    def make_sample(self, row: dict): ...

    def collate(self, samples: List) -> dict:
        """The micro-batch's tensors (on the CPU; ``batch`` moves them)."""
        raise NotImplementedError

    def compute(self, model, batch: dict) -> tuple:
        """(loss tensor, metrics dict) of a collated batch that already lives on the model's device."""
        raise NotImplementedError

    def batch(self, model, samples: List) -> dict:
        """The one place a supervised micro-batch reaches the compute device: every tensor of ``collate`` (ids,
        masks, labels, margins, precomputed reference log-probs) is moved to ``self.device``, the engine's compute
        device (``TrainEngine.compute_device``, which SupervisedTrainer sets), so no loss mixes CPU and CUDA tensors.
        Not the parameters' device: under --adam_offload FSDP2 keeps the shards on the host and computes on the GPU.
        A task used without a trainer (``device`` unset) moves them to where ``model``'s parameters are."""
        return to_device(self.collate(samples), self.device if self.device is not None else model_device(model))

    def loss(self, model, samples: List) -> tuple:
        """(loss tensor, metrics dict) of a list of samples."""
        return self.compute(model, self.batch(model, samples))

    def needs_reference(self, samples: List) -> bool:
        """Whether the loss runs a reference model's forward on these samples (DPO: unless every row carries
        precomputed reference log-probs); the trainer then builds the Reference role and sets ``ref``."""
        return False

    def reference_flags(self, m):
        """The model group the reference is built from (KD: its --ref_pretrain is the teacher, rlhf.supervised.kd)."""
        return m

    def sequences(self, sample) -> List[List[int]]:
        """The token sequences one sample puts into a micro-batch: SFT ``(ids, loss_mask)`` one, an RM pair
        ``(chosen, rejected[, margin])`` and a DPO pair ``((ids, mask), (ids, mask), ref)`` two."""
        if self.name == "rm":
            return [sample[0], sample[1]]
        if self.name == "dpo":
            return [sample[0][0], sample[1][0]]
        return [sample[0]]

    def item(self, sample) -> Item:
        """The sample's size for token-budget micro-batches: right-padded rows (0, longest), one row per sequence,
        its real tokens the sum of the lengths."""
        seqs = self.sequences(sample)
        return Item(0, max(len(x) for x in seqs), rows=len(seqs), tokens=sum(len(x) for x in seqs))

    def units(self, samples: List) -> float:
        """What ``compute`` averages its loss over: SFT the supervised tokens (``sft_token_loss``: loss_mask[1:]
        of every sample), RM / DPO the pairs.  Token-budget micro-batches weigh each micro-batch's loss by its
        units over the step's (all ranks), so the step's loss is the mean over the whole step."""
        if self.name in ("rm", "dpo"):
            return float(len(samples))
        return float(sum(sum(s[1][1:]) for s in samples))

    def after_fit(self, trainer) -> None:
        return None


def model_device(model) -> torch.device:
    """Where ``model``'s parameters live (a DTensor shard's device under FSDP2): a plain module's compute device,
    not an engine's (use ``TrainEngine.compute_device`` there)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def to_device(batch: dict, device: torch.device) -> dict:
    """Every tensor of ``batch`` on ``device`` (other values as they are)."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def io_deadlines(ref_pretrain: Optional[str], path: str, task: str, nodes: int, floor_s: float) -> dict:
    """The watchdog's "load" and "save" deadlines from the bytes they move (launch/sbatch.py ``io_deadlines_s``, as
    the RL trainers: rl_trainer.io_deadlines): the trained model's checkpoint (weights, fp32 master, Adam) written
    and read back for the manifest's hashes, and at start-up or resume the weights (DPO: and its reference) or the
    checkpoint read and verified; never below --watchdog_slow_timeout_s (``floor_s``).  Sizes from each model's
    config.json (or the size in its name); ``ref_pretrain``: --ref_pretrain (DPO's reference, default ``path``)."""
    from launch.sbatch import io_deadlines_s, model_params

    trained = model_params(path)[0] or 0
    ref = (model_params(ref_pretrain or path)[0] or 0) if task == "dpo" else 0
    return io_deadlines_s(trained, trained + ref, nodes, floor_s)


def default_data(kit: str, kind: str):
    return os.path.join(kit, "data", f"{kind}_train.jsonl"), os.path.join(kit, "data", f"{kind}_eval.jsonl")


def supervised_roles(m, o, t, task: Task, groups: Groups, path: str, device, total_steps: int) -> Roles:
    """The roles through RL's role construction (``model_role``): the trained model an Actor (SFT: a causal LM,
    RM: one with a value head, DPO: the policy), checkpointed as ``model/``, and DPO's Reference; from the model
    (``m``), optim (``o``) and topology (``t``) groups."""
    spec = lambda role: spec_from_config(m, o, t, o.learning_rate, total_steps)  # noqa: E731
    actor = model_role(Actor, "actor", groups, t.backend, device, spec,
                       lambda on_meta: task.build_model(path, on_meta=on_meta))
    actor.state_name = "model"
    return Roles(actor=actor, ref=build_reference(task.reference_flags(m), o, t, groups, path, device, total_steps))


class SupervisedTrainer:
    def __init__(self, cfg, task_cls, data_kind: str):
        self.cfg = cfg
        d, o, t = cfg.data, cfg.optim, cfg.topology
        preflight(cfg, task_cls.name)  # before any process group: wrong model kinds, unwritable paths, resume
        self.path = resolve_pretrain(cfg.model.pretrain)
        self.tokenizer = load_tokenizer(self.path, padding_side="right")
        self.task = task_cls(cfg.model, d, cfg.algorithm, self.tokenizer)
        self.task.images = ImageInputs.from_model_dir(self.path, cfg.vision.image_key,
                                                      cfg.vision.max_images_per_prompt)  # None: text-only model
        self.task.freeze_visual = cfg.vision.freeze_visual_encoder
        keys = {k: getattr(d, k) for k in self.task.required_keys}
        rows, ev = load_train_eval(d, keys, d.dataset, d.dataset_probs,
                                   None if cfg.model.pretrain else default_data(self.path, data_kind),
                                   "--dataset is required with --pretrain (the built-in task goes with the built-in "
                                   "kit)", o.seed)
        rows, self.data_report = screen_rows(rows, self.tokenizer, d, self.task.name, "train", cfg.model.pretrain_mode)
        ev, _ = screen_rows(ev, self.tokenizer, d, self.task.name, "eval", cfg.model.pretrain_mode)
        self.train_samples = [self.task.make_sample(r) for r in rows]
        self.eval_samples = [self.task.make_sample(r) for r in ev]
        world = int(os.environ.get("WORLD_SIZE", "1")) // max(1, t.ring_attn_size)  # data-parallel ranks
        if o.train_batch_size % (o.micro_train_batch_size * world):
            raise ValueError(f"--train_batch_size {o.train_batch_size} must be a multiple of --micro_train_batch_size "
                             f"{o.micro_train_batch_size} x data-parallel ranks {world}")
        self.steps_per_epoch = len(self.train_samples) // o.train_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(self.train_samples)} samples is fewer than --train_batch_size {o.train_batch_size}")
        self.total_steps, capped = planned_steps(self.steps_per_epoch, o.max_epochs, o.max_global_steps, "--max_epochs")
        self.rank, self.world, _, self.device = comm.init(t.dist_timeout_s)
        # --ring_attn_size: consecutive ranks split each sequence; each such group is one data-parallel rank
        plan = supervised_placement(self.world, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)), t.ring_attn_size,
                                    self.task.needs_reference(self.train_samples + self.eval_samples))
        self.groups = build_groups(plan, self.rank)
        self.mesh = self.groups.mesh("actor")
        self.sp, self.dp_rank, self.dp_world = self.mesh.sp, self.mesh.dp_rank, self.mesh.dp_size
        if capped:
            print0(capped)
        self.watchdog = Watchdog(default_s=t.watchdog_timeout_s, slow_s=t.watchdog_slow_timeout_s,
                                 deadlines=io_deadlines(cfg.model.ref_pretrain, self.path, self.task.name, t.nnodes_hint
                                                        or nnodes_from_env(), t.watchdog_slow_timeout_s))
        torch.manual_seed(o.seed)
        with self.watchdog.phase("load"):
            self.roles = supervised_roles(cfg.model, o, t, self.task, self.groups, self.path, self.device, self.total_steps)
        for r in (self.roles.actor, self.roles.ref):  # --experts_implementation (an MoE model's expert kernels)
            if r is not None and r.engine is not None:
                moe.set_experts(r.engine.model, cfg.parallel.experts_implementation)
        self.engine = self.roles.actor.engine  # the engine the loop trains
        self.task.device = self.engine.compute_device  # batches go there, whatever device the parameters are on
        self.task.ref = self.roles.ref.engine if self.roles.ref is not None else None
        if cfg.model.lm_head_fp32:
            self.fp32_heads()
        self.step = 0
        lg = cfg.logging
        self.logger = MetricsLogger(self.rank, lg.log_dir, self.total_steps, run_name=lg.wandb_run_name or self.task.name,
                                    use_wandb=lg.use_wandb, wandb_project=lg.wandb_project, wandb_org=lg.wandb_org,
                                    use_tensorboard=lg.use_tensorboard, progress_bar=lg.progress_bar,
                                    config=cfg.to_dict())
        self.logger.log(0, self.data_report.metrics(), prefix="data")
        self.cadence = Cadence(cfg.logging, cfg.checkpoint, self.logger, StopSignal())
        # a stop signal is said at once (rank 0: the phase, that the checkpoint comes at step end, torchrun's grace);
        # supervised steps are not cut (no phase runs long enough to need it)
        self.watchdog.announce_stops(self.cadence.stop)

    def fp32_heads(self) -> None:
        """--lm_head_fp32: the policy's (and DPO's reference's) log-probs from float32 logits
        (rlhf.models.lm_head.use_fp32_head); a reward model has no LM head: said, nothing changes."""
        from rlhf.models.lm_head import use_fp32_head

        if self.task.name == "rm":
            print0("[rm] --lm_head_fp32 has no effect on a reward model (its score head is not an LM head)")
            return
        for role in (self.roles.actor, self.roles.ref):
            if role is not None:
                use_fp32_head(role.engine.model)

    def batches_for(self, step: int):
        o = self.cfg.optim
        epoch, j = divmod(step, self.steps_per_epoch)
        perm = torch.randperm(len(self.train_samples), generator=torch.Generator().manual_seed(o.seed + epoch))
        rows = perm[j * o.train_batch_size:(j + 1) * o.train_batch_size]
        if o.use_dynamic_batch:  # token budgets: rows over DP ranks by tokens, then by the budget (same count)
            rows = rows.tolist()
            items = [self.task.item(self.train_samples[i]) for i in rows]
            _, micro = plan_step(items, self.dp_world, row_budgets(self.cfg)[0], self.cfg.model.packing_samples)
            return [None if m is None else [self.train_samples[rows[k]] for k in m] for m in micro[self.dp_rank]]
        mine = rows[shard_rows(rows.numel(), self.dp_rank, self.dp_world)].tolist()
        mb = o.micro_train_batch_size
        return [[self.train_samples[i] for i in mine[s:s + mb]] for s in range(0, len(mine), mb)]

    def micro_weights(self, batches: List) -> List[float]:
        """The factor on each micro-batch's loss.  Fixed size: 1 (the engine averages the micro-batches and
        ranks).  Token budgets (--use_dynamic_batch; an entry None is a dummy forward, weight 0):
        units_i / U x accum_steps x DP ranks, U the step's units over every DP rank (one all_reduce over the
        world, divided by the ranks that share a DP rank's samples), so after the engine's 1/accum_steps and the
        ranks' average the step's loss is sum_i units_i loss_i / U, the mean over the whole step (OpenRLHF
        computes the same global count, openrlhf/utils/loss_utils.py ``get_loss_batch_info``)."""
        if not self.cfg.optim.use_dynamic_batch:
            return [1.0] * len(batches)
        units = [self.task.units(b) if b is not None else 0.0 for b in batches]
        total = torch.tensor([sum(units)], dtype=torch.float64)
        comm.all_reduce(total)
        total = float(total) / max(self.world // self.dp_world, 1)
        scale = self.engine.accum_steps * self.dp_world / max(total, 1.0)
        return [u * scale for u in units]

    def _reduce(self, logs: Dict[str, List[float]]) -> Dict[str, float]:
        """Mean over every rank's micro-batch values (every rank passes the same keys: the task's loss keys)."""
        keys = sorted(logs)
        t = torch.tensor([[sum(logs[k]), len(logs[k])] for k in keys], dtype=torch.float64)
        comm.all_reduce(t)
        return {k: float(s / n) if n else float("nan") for k, (s, n) in zip(keys, t.tolist())}

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Every rank runs the same number of forwards (FSDP collectives); an empty micro-batch runs a dummy
        forward on sample 0 and is not counted.  Metrics are weighted by samples, not by micro-batches."""
        n = len(self.eval_samples)  # the same on every rank
        if n == 0:
            return {}
        self.engine.model.eval()
        mb = self.cfg.optim.micro_train_batch_size
        logs = defaultdict(list)
        for part in micro_plan(n, self.dp_rank, self.dp_world, mb):
            chunk = self.eval_samples[part] if part is not None else self.eval_samples[:1]
            _, met = self.task.loss(self.engine.model, chunk)
            if part is not None:
                for k, v in met.items():
                    logs[k] += [v] * len(chunk)
        self.engine.model.train()
        for k in self._metric_keys():
            logs.setdefault(k, [])
        return self._reduce(logs)

    def _metric_keys(self) -> List[str]:
        if not hasattr(self, "_keys"):
            _, met = self.task.loss(self.engine.model, self.eval_samples[:1] or self.train_samples[:1])
            self._keys = sorted(met)
        return self._keys

    def save(self):
        c = self.cfg.checkpoint
        with self.watchdog.phase("save"):
            ckpt.save_checkpoint(c.ckpt_path, self.step, self.write_roles, {"step": self.step}, c.max_ckpt_num,
                                 identity=ckpt.run_identity(self.cfg))

    def write_roles(self, tmp: str) -> None:
        """Each trained role's state under the checkpoint being written (the actor's: ``model/``)."""
        for role in self.roles.trained():
            role.state_dict(os.path.join(tmp, role.state_dir))

    def resume(self) -> bool:
        with self.watchdog.phase("load"):  # the verification reads the whole checkpoint (in shares), then the load
            path = ckpt.resume_path(self.cfg.checkpoint.ckpt_path, self.cfg.checkpoint.strict_resume)
            if path is None:  # preflight said so (check_resume: "no checkpoint ... starting from step 0")
                return False
            for role in self.roles.trained():
                role.load_state_dict(os.path.join(path, role.state_dir))
            self.step = ckpt.load_trainer_state(path)["step"]
            ckpt.load_rank_state(path)
        print0(f"[resume] from {path} at step {self.step}")
        return True

    def accumulate(self, batches: List) -> Dict[str, List[float]]:
        """Forward and backward every micro-batch of one optimizer step (``batches_for``); the metrics per
        micro-batch.  Token budgets (--use_dynamic_batch): losses weighted by ``micro_weights``, the engine told
        which micro-batch is the last, a dummy (None: this rank has fewer micro-batches) run on a real sample with
        weight 0, and ``loss`` the step's loss (this rank's share x DP ranks: the mean over ranks is the value)."""
        logs = defaultdict(list)
        weights = self.micro_weights(batches)
        dynamic, step_loss = self.cfg.optim.use_dynamic_batch, 0.0
        for i, (mb, w) in enumerate(zip(batches, weights)):
            loss, met = self.task.loss(self.engine.model, mb if mb is not None else self.train_samples[:1])
            self.engine.backward(loss * w if dynamic else loss, i, last=i == len(batches) - 1 if dynamic else None)
            if mb is None:
                continue
            for k, v in met.items():
                logs[k].append(v)
            step_loss += float(loss.detach()) * w / self.engine.accum_steps
        if dynamic:
            logs["loss"] = [step_loss]
            logs["over_budget_micro_batches"] = [float(OVER_BUDGET.take())]  # seqlen_balancing: run alone
        return logs

    def fit(self):
        self.cadence.start(self)
        self.engine.model.train()
        while self.step < self.total_steps:
            with self.watchdog.phase("train"):
                logs = self.accumulate(self.batches_for(self.step))
                for k, v in self.engine.step().items():
                    logs[k].append(v)
            self.step += 1
            if not self.cadence.after_step(self, self._reduce(logs)):
                break
        self.cadence.finish(self)
        return self

    def finish(self):
        with self.watchdog.phase("save"):
            self.roles.actor.export(self.cfg.checkpoint.save_path, self.tokenizer)
            self.task.after_fit(self)
            comm.barrier()


def run_supervised(cfg, task_cls, data_kind: str):
    def main():
        trainer = SupervisedTrainer(cfg, task_cls, data_kind)
        trainer.fit()
        trainer.watchdog.stop()
        comm.barrier()
        comm.destroy()
        return trainer

    return guarded(main)
