"""The PPO / GRPO trainer: checks, placement and roles, then a short loop over the step's stages.

Order of work: everything that can fail on bad input (config, placement, data,
reward function, agent file) is checked before any process group exists; then the
process groups, the role objects and the watchdog; then ``fit`` runs the stages ``stages.build_stages`` chose
for each step and the cadence (log, eval, save, preempt).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import List, Optional

import torch

from rlhf import checkpoint as ckpt
from rlhf.algorithms import make_kl_controller
from rlhf.algorithms.eval_metrics import pass_at_n
from rlhf.algorithms.seqlen_balancing import OVER_BUDGET
from rlhf.batch import Batch
from rlhf.config.preflight import preflight
from rlhf.data.formatting import build_prompts, format_prompt
from rlhf.data.loading import load_train_eval
from rlhf.distributed import PhaseScheduler, WeightSync, build_groups, comm, make_placement, nnodes_from_env, role_needs
from rlhf.distributed.failfast import Watchdog, guarded, refill_deadlines
from rlhf.distributed.sharding import all_gather_objects
from rlhf.engines.rollout import SamplingParams
from rlhf.errors import InputError
from rlhf.models.load import load_tokenizer, resolve_pretrain
from rlhf.rewards.reward_func import builtin_reward_source, make_reward_source
from rlhf.rl.advantage_stage import InvalidRewardGuard, running_reward_norm
from rlhf.rl.async_queue import AsyncRollout, QueueSettings
from rlhf.rl.components import Forwards, Rollouts, Sampler, Scorer, decode_queries
from rlhf.rl.stages import Stage, StageParts, build_stages, stage_deadlines, sync_weights
from rlhf.roles.build import build_roles
from rlhf.utils.cadence import Cadence, log0, planned_steps
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.preempt import StopSignal

# Phases a pending stop cuts a step after: long, and before anything of the run's state changes (the update,
# reward normalisation and the KL controller come later), so the last completed step is a consistent checkpoint.
CUT_STAGES = ("rollout", "reward", "rollout_refill")


class StepCut(Exception):
    """Every rank agreed on a stop after ``stage``: the step is abandoned, the last completed step saved."""

    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


def load_prompt_sets(cfg, tokenizer, kit_dir: Optional[str]):
    d = cfg.data
    kit = None if kit_dir is None else tuple(os.path.join(kit_dir, "data", f"prompts_{s}.jsonl") for s in ("train", "eval"))
    rows, ev = load_train_eval(d, {"input_key": d.input_key, "label_key": d.label_key}, d.prompt_data,
                               d.prompt_data_probs, kit, "--prompt_data is required with --pretrain (the built-in task "
                               "comes with the built-in kit); e.g. --prompt_data prompts.jsonl --input_key input "
                               "--label_key label", cfg.optim.seed)
    return build_prompts(rows, tokenizer, d), build_prompts(ev, tokenizer, d), datasources(ev, tokenizer, d)


def datasources(rows, tokenizer, d) -> dict:
    """Formatted prompt text -> its row's ``datasource`` (rows without one: none, read as "default"): OpenRLHF's
    ``prompt_to_datasource`` (openrlhf/trainer/ppo_trainer.py compute_eval_metrics), which keys pass@k by source."""
    return {format_prompt(r[d.input_key], tokenizer, d.apply_chat_template, d.input_template): str(r["datasource"])
            for r in rows if r.get("datasource") is not None}


def generation_rows(tokenizer, batch: Batch, res: Batch, labels: List, k: int) -> List[dict]:
    """``k`` eval samples as {prompt, response, label, reward} (reward None when invalid): rows drawn with a fixed
    seed, so every eval logs the same prompts' samples (veRL ``_maybe_log_val_generations``: a fixed-seed shuffle,
    then the first N)."""
    n = batch.sequences.size(0)
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(42))[:k].sort().values
    queries, prompts = decode_queries(tokenizer, batch.select(rows), slice(None))
    out = []
    for i, q, p in zip(rows.tolist(), queries, prompts):
        ok = bool(res.valid[i]) and bool(torch.isfinite(res.rewards[i]))
        out.append({"prompt": p, "response": q[len(p):], "label": labels[i],
                    "reward": float(res.rewards[i]) if ok else None})
    return out


def io_deadlines(cfg, path: str, plan, nodes: int, floor_s: float) -> dict:
    """The watchdog's "load" and "save" deadlines from the bytes they move (launch/sbatch.py ``io_deadlines_s``):
    a 70B actor + critic write ~2 TB per checkpoint and read it back for the manifest's hashes, far past a fixed
    --watchdog_slow_timeout_s (the floor).  Sizes from each model's config.json (or the size in its name)."""
    from launch.sbatch import io_deadlines_s, model_params

    m = cfg.model

    def size(p):
        return (model_params(p)[0] or 0) if p else 0

    actor = size(path)
    critic = size(m.critic_pretrain or path) if plan.ranks.get("critic") else 0
    ref = size(m.ref_pretrain or path) if plan.ranks.get("ref") else 0
    reward = size(m.reward_pretrain) if plan.ranks.get("reward") else 0
    return io_deadlines_s(actor + critic, actor + critic + ref + reward, nodes, floor_s)


def check_backend_placement(cfg, plan) -> None:
    """--backend deepspeed needs every model role on every rank: ZeRO's set-up runs a world-wide barrier
    (deepspeed/runtime/zero/stage3.py ``_setup_for_real_optimizer``), so a role on ranks of its own would hang
    there.  Checked before any process group exists."""
    if cfg.topology.backend != "deepspeed":
        return
    world = list(range(plan.world_size))
    partial = [r for r in ("actor", "ref", "critic", "reward") if plan.ranks.get(r) and plan.ranks[r] != world]
    if partial:
        raise InputError(f"--backend deepspeed needs every model role on every rank, but {', '.join(partial)} "
                         f"sit on ranks of their own in this placement (DeepSpeed's ZeRO set-up waits on the whole "
                         f"job): use --colocate_all_models (and no --vllm_num_engines ranks of their own), or "
                         f"--backend fsdp2 for roles on ranks of their own")


def check_batch_sizes(cfg, plan) -> None:
    """Batch shapes the roles' engines need, checked against the placement before any process group."""
    o = cfg.optim
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    for role, lr_flag in (("actor", "actor"), ("critic", "critic")):
        n = plan.dims(role)["dp"]  # data-parallel ranks (rlhf.distributed.mesh)
        if n and o.train_batch_size % (o.micro_train_batch_size * n):
            per = o.micro_train_batch_size * n
            raise InputError(f"--train_batch_size {o.train_batch_size} must be a multiple of --micro_train_batch_size "
                             f"{o.micro_train_batch_size} x {n} {role} ranks = {per} (every {role} rank takes the same "
                             f"number of micro-batches per optimizer step); "
                             + batch_size_fix(samples, o.train_batch_size, o.micro_train_batch_size, n))


def batch_size_fix(samples: int, train_batch_size: int, micro: int, ranks: int) -> str:
    """A fix that passes every batch check at once: a --train_batch_size that is a multiple of micro x ranks and
    divides the step's samples (closest to the current one), else a --micro_train_batch_size that allows one."""
    per = micro * ranks
    fits = [k * per for k in range(1, samples // per + 1) if samples % (k * per) == 0]
    if fits:
        return f"e.g. --train_batch_size {min(fits, key=lambda b: (abs(b - train_batch_size), -b))}"
    for m in range(micro - 1, 0, -1):
        if samples % (m * ranks) == 0:
            return f"e.g. --micro_train_batch_size {m} --train_batch_size {samples}"
    return (f"no batch splits {samples} samples (--rollout_batch_size x --n_samples_per_prompt) over {ranks} ranks: "
            f"make that a multiple of {ranks}")


class RLTrainer:
    def __init__(self, cfg, run_name: str = "ppo"):
        self.cfg = cfg
        a, t, r = cfg.algorithm, cfg.topology, cfg.rollout
        # --- everything that can fail on bad input, before any process group exists ---
        world = int(os.environ.get("WORLD_SIZE", "1"))
        preflight(cfg, "ppo", world)  # model kinds, writable paths, resume
        self.plan_nodes = t.nnodes_hint or nnodes_from_env()
        self.plan = make_placement(t, world, self.plan_nodes, **role_needs(a, cfg.model))
        if r.async_train and not self.plan.separate_rollout:
            raise InputError("--async_train needs rollout ranks of their own: set --vllm_num_engines > 0 and give "
                             "the job those extra ranks")
        check_batch_sizes(cfg, self.plan)
        check_backend_placement(cfg, self.plan)
        self.agent_mode = bool(r.agent_func_path)
        if self.agent_mode:
            from rlhf.agents.load import load_agent

            load_agent(r.agent_func_path)  # fail on a bad file before any process group
        self.reward_source = make_reward_source(r.remote_rm_url, r.reward_timeout_s, log0, r.remote_rm_retries)
        if self.reward_source is None and not cfg.model.reward_pretrain:
            self.reward_source = builtin_reward_source(log0)
        self.path = resolve_pretrain(cfg.model.pretrain)
        self.tokenizer = load_tokenizer(self.path)
        self.prompts, self.eval_prompts, self.eval_sources = load_prompt_sets(
            cfg, self.tokenizer, None if cfg.model.pretrain else self.path)
        rb = r.rollout_batch_size
        if len(self.prompts) < rb:
            raise InputError(f"{len(self.prompts)} training prompts is fewer than --rollout_batch_size {rb} (one "
                             f"step's prompts): use --rollout_batch_size {len(self.prompts)} or fewer, or more data"
                             + (f" (--eval_holdout {cfg.data.eval_holdout} held out {len(self.eval_prompts)} for eval)"
                                if cfg.data.prompt_data and not cfg.data.eval_dataset and cfg.data.eval_holdout
                                else ""))
        self.steps_per_episode = len(self.prompts) // rb
        total, capped = planned_steps(self.steps_per_episode, cfg.optim.num_episodes, cfg.optim.max_global_steps,
                                      "--num_episodes")
        self.total_steps = total
        left = len(self.prompts) - self.steps_per_episode * rb
        notes = [f"[data] {len(self.prompts)} training prompts -> {self.steps_per_episode} steps per episode of "
                 f"--rollout_batch_size {rb}" + (f" ({left} prompts of each shuffled episode are left out)" if left
                                                  else "") + f"; {len(self.eval_prompts)} eval prompts"
                 + ("" if self.eval_prompts else " (eval off)")] + ([capped] if capped else [])
        # --- process groups, roles, watchdog ---
        self.rank, self.world, _, self.device = comm.init(t.dist_timeout_s)
        # the stages' own deadlines join these once the stages are built (``stage_deadlines``)
        self.watchdog = Watchdog(default_s=t.watchdog_timeout_s, slow_s=t.watchdog_slow_timeout_s,
                                 deadlines={"eval": t.watchdog_slow_timeout_s,
                                            **io_deadlines(cfg, self.path, self.plan, self.plan_nodes,
                                                           t.watchdog_slow_timeout_s)})
        for n in notes:
            log0(n)
        torch.manual_seed(cfg.optim.seed)
        self.groups = build_groups(self.plan, self.rank)
        samples = rb * r.n_samples_per_prompt
        opt_steps = total * cfg.optim.max_epochs * max(1, samples // cfg.optim.train_batch_size)
        with self.watchdog.phase("load"):
            self.roles = build_roles(cfg, self.groups, self.device, opt_steps)
        self.scheduler = PhaseScheduler(self.rank, self.roles.sleepables(), group=None, barrier=self.plan.colocated,
                                        enabled=self.plan.colocated and (t.vllm_enable_sleep or t.deepspeed_enable_sleep))
        self.scheduler.put_all_to_sleep()
        rollout_engine = self.roles.rollout.engine
        self.weight_sync = WeightSync(self.groups, rollout_engine, timeout_s=t.dist_timeout_s, device=self.device,
                                      dtype=torch.bfloat16 if cfg.model.bf16 else None)
        self.kl_ctl = make_kl_controller(a.init_kl_coef, a.kl_target, a.kl_horizon)
        self.reward_norm = running_reward_norm(cfg)
        self.invalid_rewards = InvalidRewardGuard(a.max_invalid_reward_batches)
        self.build_step(cfg)
        self.step = 0
        lg = cfg.logging
        self.logger = MetricsLogger(self.rank, lg.log_dir, total, run_name=lg.wandb_run_name or run_name,
                                    use_wandb=lg.use_wandb, wandb_project=lg.wandb_project, wandb_org=lg.wandb_org,
                                    use_tensorboard=lg.use_tensorboard, progress_bar=lg.progress_bar,
                                    config=cfg.to_dict())
        self.cadence = Cadence(cfg.logging, cfg.checkpoint, self.logger, StopSignal())
        # a stop (SIGTERM: torchrun kills 30 s later) cuts the step after its long phases (sync mode: every rank
        # runs every stage, so the agreement is one all_reduce at the same point on every rank); said at once
        self.cut_stages = () if self.async_rollout is not None else CUT_STAGES
        self.watchdog.announce_stops(self.cadence.stop, self.cut_stages)

    # ---- data ------------------------------------------------------------------------------------------------------
    def prompts_for(self, step: int):
        rb = self.cfg.rollout.rollout_batch_size
        episode, j = divmod(step, self.steps_per_episode)
        g = torch.Generator().manual_seed(self.cfg.optim.seed + episode)
        perm = torch.randperm(len(self.prompts), generator=g)[j * rb:(j + 1) * rb]
        return [self.prompts[i] for i in perm.tolist()]

    def refill_prompts(self, step: int, round_: int, k: int):
        """k more prompts for a dynamic-filtering refill: a seeded draw from the training prompts (every rank alike)."""
        g = torch.Generator().manual_seed(self.cfg.optim.seed * 7919 + step * 131 + round_)
        idx = torch.randint(len(self.prompts), (k,), generator=g)
        return [self.prompts[i] for i in idx.tolist()]

    def sampling(self, step: int, eval_mode: bool = False, salt: int = 0) -> SamplingParams:
        return self.sampler.params(step, eval_mode, salt)

    def build_step(self, cfg) -> None:
        """The step's components, each from its part of the config, the async queue, and the stages that apply
        (decided once, from config and placement); their deadlines join the watchdog's."""
        t, a = cfg.topology, cfg.algorithm
        self.forwards = Forwards.from_config(cfg)
        self.sampler = Sampler.from_config(cfg, self.tokenizer.eos_token_id, self.roles.rollout.engine_index)
        self.rollouts = Rollouts(self.tokenizer.pad_token_id, with_rewards=self.agent_mode)
        self.scorer = Scorer(self.agent_mode, self.reward_source, self.tokenizer, self.watchdog, self.forwards,
                             self.rank, self.world)
        self.async_rollout = AsyncRollout(QueueSettings.from_config(cfg), self.roles, self.groups, self.rank,
                                          self.scorer, self.sampler, self.prompts_for, self.tokenizer.pad_token_id) \
            if cfg.rollout.async_train else None
        # a dynamic-filtering refill is up to max_rounds + 1 rounds of generation + scoring: each round has its own
        # deadline (RefillRolloutStage), the whole stage the sum
        round_s, refill_s = refill_deadlines(t.watchdog_timeout_s, t.watchdog_slow_timeout_s,
                                             a.dynamic_filtering_max_rounds)
        self.stages: List[Stage] = build_stages(cfg, StageParts(
            has={k: bool(v) for k, v in self.plan.ranks.items()}, agent_mode=self.agent_mode,
            reward_source=self.reward_source, forwards=self.forwards, rollouts=self.rollouts, scorer=self.scorer,
            sampler=self.sampler, scheduler=self.scheduler, watchdog=self.watchdog, weight_sync=self.weight_sync,
            reward_norm=self.reward_norm, guard=self.invalid_rewards, queue=self.async_rollout,
            refill_draw=self.refill_prompts, total_steps=self.total_steps,
            timeouts=(t.watchdog_timeout_s, t.watchdog_slow_timeout_s, round_s, refill_s)))
        self.watchdog.deadlines.update(stage_deadlines(self.stages))

    # ---- phases ----------------------------------------------------------------------------------------------------
    def waits_for(self, stage: Stage) -> Optional[str]:
        """The role this rank only waits for in ``stage`` (it holds neither the stage's role nor the one it shares
        with), else None: then the watchdog reports "waiting for <role> (<stage>)" and holds this rank to the
        stage's deadline plus what earlier waits owe (failfast.Watchdog)."""
        if stage.role is None:
            return None
        roles = self.roles.all()
        if stage.role not in roles:
            return None
        mine = [r for r in (stage.role, stage.share) if r in roles and roles[r].is_member]
        return None if mine else stage.role

    def phase(self, stage: Stage):
        """The watchdog's deadline and, for colocated roles, the scheduler's sleep/wake around one stage."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.watchdog.phase(stage.name, waits_for=self.waits_for(stage)))
        if stage.role is not None:
            stack.enter_context(self.scheduler.phase(stage.name, role=stage.role, share=stage.share, tags=stage.tags))
        return stack

    def run_stages(self, st: Batch) -> Batch:
        skip = self.async_rollout is not None and self.groups.rollout_only  # they generate meanwhile
        for stage in self.stages:
            if skip and stage.trainers_only:
                continue
            t0 = time.perf_counter()
            with self.phase(stage):
                stage.run(st, self.roles)
            st.metrics[f"time_{stage.name}"] = time.perf_counter() - t0
            if stage.name in self.cut_stages and self.cadence.stop.requested():  # collective, on every rank
                raise StepCut(stage.name)
        return st

    def save_cut_step(self, stage: str) -> None:
        """After a StepCut: save the last completed step (unless its own save just ran) and end as preempted."""
        c = self.cfg.checkpoint
        if not (self.step > 0 and c.save_steps > 0 and self.step % c.save_steps == 0):
            critic = "critic" if self.roles.critic is not None else None
            with self.scheduler.phase("save", role="actor", share=critic):
                self.save()
        self.cadence.preempted = True
        log0(f"[preempt] {self.cadence.stop.reason()}: step {self.step + 1} cut after its {stage} phase; checkpoint "
             f"of step {self.step} (the last completed) saved in {c.ckpt_path}; the run is NOT complete "
             f"({self.step}/{self.total_steps} steps): resume with --load_checkpoint")

    # ---- weights ---------------------------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Actor -> rollout engines.  Colocated: every rank; separate: the actor and rollout ranks."""
        sync_weights(self.weight_sync, self.roles)

    # ---- checkpoint ------------------------------------------------------------------------------------------------
    def save(self):
        c = self.cfg.checkpoint

        def write(tmp):
            for role in self.roles.trained():
                role.state_dict(os.path.join(tmp, role.state_dir))

        state = {"step": self.step, "kl_coef": self.kl_ctl.value,
                 "reward_norm": self.reward_norm.state_dict() if self.reward_norm else None,
                 "async_queue": self.async_rollout.state() if self.async_rollout is not None else None}
        with self.watchdog.phase("save"):
            path = ckpt.save_checkpoint(c.ckpt_path, self.step, write, state, c.max_ckpt_num,
                                        identity=ckpt.run_identity(self.cfg))
            if c.save_hf_ckpt:
                self.save_hf(os.path.join(path, "hf"))

    def resume(self) -> bool:
        with self.watchdog.phase("load"):  # the verification reads the whole checkpoint (in shares): bytes-scaled
            path = ckpt.resume_path(self.cfg.checkpoint.ckpt_path, self.cfg.checkpoint.strict_resume)
        if path is None:  # preflight said so (check_resume: "no checkpoint ... starting from step 0")
            return False
        with self.watchdog.phase("load"):
            for role in self.roles.trained():
                role.load_state_dict(os.path.join(path, role.state_dir))
            st = ckpt.load_trainer_state(path)
            self.step = st["step"]
            self.kl_ctl.value = st["kl_coef"]
            if self.reward_norm is not None and st.get("reward_norm"):
                self.reward_norm.load_state_dict(st["reward_norm"])
            if self.async_rollout is not None:
                self.async_rollout.restore(st.get("async_queue"))
            ckpt.load_rank_state(path)
        with self.phase(self.stage_named("weight_sync")):
            self.sync_weights()
        log0(f"[resume] from {path} at step {self.step}")
        return True

    def first_sync(self) -> None:
        """Colocated vLLM starts on dummy weights (VLLMEngine ``dummy_weights``) and takes the actor's here, before
        the first generate, unless a resume synced already.  Collective: every rank learns whether any engine
        needs it (ranks without a rollout engine take part in the sync as actor ranks)."""
        engine = self.roles.rollout.engine  # None on ranks without a rollout engine
        need = torch.tensor([1.0 if engine is not None and engine.needs_weights else 0.0])
        if float(comm.all_reduce(need, "max")) > 0:
            with self.phase(self.stage_named("weight_sync")):
                self.sync_weights()

    def stage_named(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def save_hf(self, path: str):
        """Collective: the actor ranks gather the full weights, the first actor rank writes them."""
        self.roles.actor.export(path, self.tokenizer)
        comm.barrier()

    def exports(self) -> list:
        """(role, directory) of the final export: the actor at --save_path, with --save_value_network the critic's
        backbone and value head at ``<save_path>_critic`` (OpenRLHF's directory; --critic_pretrain reads it back)."""
        c = self.cfg.checkpoint
        out = [(self.roles.actor, c.save_path)]
        if c.save_value_network and self.roles.critic is not None:
            out.append((self.roles.critic, c.save_path.rstrip("/") + "_critic"))
        return out

    def finish(self):
        """Collective: each exported role's members gather and write it, then every rank waits for the write."""
        with self.watchdog.phase("save"):
            for role, path in self.exports():
                role.export(path, self.tokenizer)
                comm.barrier()

    # ---- eval ------------------------------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        if not self.eval_prompts:  # the same list on every rank
            return {}
        n = self.cfg.rollout.eval_n_samples_per_prompt
        st = Batch(step=self.step, prompts=self.eval_prompts, n_samples=n)
        with self.watchdog.phase("eval"):
            with self.scheduler.phase("eval_rollout", role="rollout"):
                batch = self.rollouts.generate(self.roles, self.eval_prompts,
                                               self.sampler.params(self.step, eval_mode=True))
            with self.scheduler.phase("eval_reward", role="reward"):
                res = self.scorer.score(batch, self.roles, st.labels)
        r, valid = res.rewards, res.valid
        out = {"reward": float(r[valid].mean()) if valid.any() else float("nan"),
               "response_len": float(batch.action_mask.sum(1).float().mean()), "samples": float(r.numel())}
        out.update({f"reward_{k}": float(v.mean()) for k, v in res.extra_logs.items()})
        # eval_{datasource}_pass1 / _pass{n}: from the gathered rewards every rank holds (no collective)
        out.update(pass_at_n(r, n, [self.eval_sources.get(p.prompt, "default") for p in self.eval_prompts], valid))
        k = self.cfg.logging.log_val_generations
        if k > 0 and self.rank == 0:  # decoding only, on the rank that writes the logs
            self.logger.log_generations(self.step, generation_rows(self.tokenizer, batch, res, st.labels, k))
        return out

    # ---- loop ------------------------------------------------------------------------------------------------------
    def fit(self):
        cfg = self.cfg
        self.cadence.start(self)
        self.first_sync()
        n_rows = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        if self.async_rollout is not None:  # the first K batches, with the starting (or resumed) weights
            k, slow = cfg.rollout.async_queue_size, cfg.topology.watchdog_slow_timeout_s
            # K generations, each with the slow deadline; the other ranks wait for them in the first gather
            # (``waits_for``: the watchdog carries this deadline over to that phase)
            with self.watchdog.phase("produce", waits_for=None if self.roles.rollout.is_member else "rollout",
                                     deadline_s=k * slow):
                self.async_rollout.warm_up(self.step, self.total_steps)
        while self.step < self.total_steps:
            t_step = time.perf_counter()
            st = Batch(step=self.step, prompts=self.prompts_for(self.step),
                       n_samples=cfg.rollout.n_samples_per_prompt, kl_coef=self.kl_ctl.value)
            try:
                self.run_stages(st)
            except StepCut as cut:
                self.save_cut_step(cut.stage)
                break
            st.metrics.update(self.wait_metrics(st.metrics))
            self.step += 1
            dt = time.perf_counter() - t_step
            st.metrics.update({"time_step": dt, "tokens_per_s": int(st.attention_mask.sum()) / dt})
            if cfg.optim.use_dynamic_batch:  # sequences over the token budget, each run alone (seqlen_balancing)
                st.metrics["over_budget_micro_batches"] = float(OVER_BUDGET.take())
            metrics = self.reduce_metrics(st.metrics)
            self.kl_ctl.update(metrics["kl"], n_rows)  # the mean over the ranks that computed it: the same value
            if not self.cadence.after_step(self, metrics):
                break
        self.cadence.finish(self)
        return self

    def wait_metrics(self, m: dict) -> dict:
        """--async_train: how long each side waited for the other this step (this rank's, reported by the ranks of
        that side only, so the mean over ranks is per side).  The trainer (actor ranks) waits in the rollout
        gather and the weight sync for the rollout ranks to finish producing; the rollout ranks wait for the
        trainer in every stage but ``produce``."""
        if self.async_rollout is None:
            return {}
        if self.roles.actor.is_member:
            return {"async/trainer_wait_s": m.get("time_rollout", 0.0) + m.get("time_weight_sync", 0.0)}
        if self.roles.rollout.is_member:
            return {"async/rollout_wait_s": sum(v for k, v in m.items()
                                                if k.startswith("time_") and k != "time_produce")}
        return {}

    def reduce_metrics(self, metrics: dict) -> dict:
        """Mean over the ranks that computed each metric (critic metrics live on critic ranks only)."""
        every = all_gather_objects({k: float(v) for k, v in metrics.items()})
        keys = list(dict.fromkeys(k for d in every for k in d))
        return {k: sum(d[k] for d in every if k in d) / sum(1 for d in every if k in d) for k in keys}

    def close(self):
        """After a successful run only (a failure never gets here: see failfast.guarded)."""
        self.watchdog.stop()
        engine = self.roles.rollout.engine
        if engine is not None:  # vLLM's own processes (separate rollout ranks)
            engine.close()
        comm.barrier()
        comm.destroy()


def run_rl(cfg, run_name: str):
    def main():
        trainer = RLTrainer(cfg, run_name)
        trainer.fit()
        trainer.close()
        return trainer

    return guarded(main)
