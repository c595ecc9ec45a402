"""The PPO / GRPO trainer: checks, placement and roles, then a short loop over the step's stages.

Order of work: everything that can fail on bad input (config, placement, data,
reward function, agent file) is checked before any process group exists (``rlhf.rl.checks``); then the
process groups, the role objects and the watchdog; then ``fit`` runs the stages ``stages.build_stages`` chose
for each step and the cadence (log, eval, save, preempt).  One eval pass: ``rlhf.rl.evaluate``; the checkpoint,
resume and final export: ``rlhf.rl.persistence``.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import List, Optional

import torch

from rlhf import checkpoint as ckpt
from rlhf.algorithms import make_kl_controller
from rlhf.algorithms.seqlen_balancing import OVER_BUDGET
from rlhf.batch import Batch
from rlhf.config.batching_checks import dynamic_budgets
from rlhf.config.preflight import preflight
from rlhf.console import print0
from rlhf.data.images import ImageInputs
from rlhf.distributed import PhaseScheduler, WeightSync, build_groups, comm, make_placement, nnodes_from_env
from rlhf.distributed.failfast import guarded
from rlhf.distributed.placement import job_role_needs
from rlhf.distributed.sharding import all_gather_objects
from rlhf.distributed.watchdog import Watchdog, refill_deadlines
from rlhf.models.load import load_tokenizer, resolve_pretrain
from rlhf.models.vision import refuse_vision_roles
from rlhf.rewards.reward_func import builtin_reward_source, make_reward_source
from rlhf.rl.advantage_stage import InvalidRewardGuard, running_reward_norm
from rlhf.rl.async_queue import AsyncRollout, QueueSettings
from rlhf.rl.checks import check_async_placement, check_backend_placement, check_batch_sizes, io_deadlines, load_prompt_sets, plan_steps
from rlhf.rl.components import Forwards, Rollouts, Sampler, Scorer
from rlhf.rl.evaluate import Evaluator
from rlhf.rl.opd import distill_stages
from rlhf.rl.persistence import export_final, needs_first_sync, restore_run, run_state, save_run
from rlhf.rl.stages import Stage, StageParts, build_stages, stage_deadlines, sync_weights
from rlhf.roles.build import build_roles, engines_in_process, lora_versions
from rlhf.utils.cadence import Cadence
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


class RLTrainer:
    def __init__(self, cfg, run_name: str = "ppo"):
        self.cfg = cfg
        a, t, r = cfg.algorithm, cfg.topology, cfg.rollout
        # --- everything that can fail on bad input, before any process group exists ---
        world = int(os.environ.get("WORLD_SIZE", "1"))
        preflight(cfg, "ppo", world)  # model kinds, writable paths, resume
        self.plan_nodes = t.nnodes_hint or nnodes_from_env()
        self.plan = make_placement(t, world, self.plan_nodes, parallel=cfg.parallel, **job_role_needs(cfg))
        check_async_placement(r.async_train, self.plan)
        check_batch_sizes(cfg.optim, r.rollout_batch_size * r.n_samples_per_prompt, self.plan)
        check_backend_placement(t.backend, self.plan)
        self.agent_mode = bool(r.agent_func_path or cfg.agent.tools_path)  # tool episodes: scored at their end
        if r.agent_func_path:
            from rlhf.agents.load import load_agent

            load_agent(r.agent_func_path)  # fail on a bad file before any process group
        self.reward_source = make_reward_source(r.remote_rm_url, r.reward_timeout_s, print0, r.remote_rm_retries)
        if self.reward_source is None and not cfg.model.reward_pretrain:
            self.reward_source = builtin_reward_source(print0)
        self.path = resolve_pretrain(cfg.model.pretrain)
        self.tokenizer = load_tokenizer(self.path)
        from rlhf.agents.tool_setup import check_tool_run, tool_schemas

        check_tool_run(cfg.agent, r, cfg.model, cfg.data, self.tokenizer)  # --tools_path: file, flags, parser, template
        self.images = ImageInputs.from_model_dir(self.path, cfg.vision.image_key, cfg.vision.max_images_per_prompt)
        if self.images is not None:  # a vision-language policy: no critic or reward model (rlhf.models.vision)
            refuse_vision_roles(job_role_needs(cfg))
            if r.agent_func_path and r.async_train:  # the async queue gathers no episode images
                from rlhf.errors import InputError

                raise InputError("--async_train with --agent_func_path on a vision-language model is not supported "
                                 "(episode images are not carried through the async queue): drop --async_train")
        self.prompts, eval_prompts, eval_sources = load_prompt_sets(
            cfg.data, cfg.optim.seed, self.tokenizer, None if cfg.model.pretrain else self.path,
            tool_schemas(cfg.agent.tools_path), self.images)
        rb = r.rollout_batch_size
        self.steps_per_episode, total, notes = plan_steps(len(self.prompts), len(eval_prompts), rb, cfg.data,
                                                          cfg.optim)
        self.total_steps = total
        # --- process groups, roles, watchdog ---
        self.rank, self.world, _, self.device = comm.init(t.dist_timeout_s)
        # the stages' own deadlines join these once the stages are built (``stage_deadlines``)
        self.watchdog = Watchdog(default_s=t.watchdog_timeout_s, slow_s=t.watchdog_slow_timeout_s,
                                 deadlines={"eval": t.watchdog_slow_timeout_s,
                                            **io_deadlines(cfg.model, self.path, self.plan, self.plan_nodes,
                                                           t.watchdog_slow_timeout_s)})
        for n in notes:
            print0(n)
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
                                      dtype=torch.bfloat16 if cfg.model.bf16 else None, lora_sync=cfg.model.lora_sync,
                                      keep_versions=lora_versions(r),
                                      from_shards=self.plan.separate_rollout and engines_in_process(r, self.path))
        self.kl_ctl = make_kl_controller(a.init_kl_coef, a.kl_target, a.kl_horizon)
        self.reward_norm = running_reward_norm(a)
        self.invalid_rewards = InvalidRewardGuard(a.max_invalid_reward_batches)
        self.build_step(cfg)
        self.step = 0
        lg = cfg.logging
        self.logger = MetricsLogger(self.rank, lg.log_dir, total, run_name=lg.wandb_run_name or run_name,
                                    use_wandb=lg.use_wandb, wandb_project=lg.wandb_project, wandb_org=lg.wandb_org,
                                    use_tensorboard=lg.use_tensorboard, progress_bar=lg.progress_bar,
                                    config=cfg.to_dict())
        self.cadence = Cadence(cfg.logging, cfg.checkpoint, self.logger, StopSignal())
        self.evaluator = Evaluator(eval_prompts, eval_sources, r.eval_n_samples_per_prompt, lg.log_val_generations,
                                   rollouts=self.rollouts, sampler=self.sampler, scorer=self.scorer,
                                   watchdog=self.watchdog, scheduler=self.scheduler, tokenizer=self.tokenizer,
                                   logger=self.logger, rank=self.rank)
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

    def build_step(self, cfg) -> None:
        """The step's components, each from its part of the config, the async queue, and the stages that apply
        (decided once, from config and placement); their deadlines join the watchdog's."""
        t, a = cfg.topology, cfg.algorithm
        self.forwards = Forwards.from_config(cfg.rollout, cfg.model, dynamic_budgets(cfg)[1])
        self.sampler = Sampler.from_config(cfg.rollout, cfg.data.generate_max_len, cfg.optim.seed,
                                           self.tokenizer.eos_token_id, self.roles.rollout.engine_index)
        self.rollouts = Rollouts(self.tokenizer.pad_token_id, with_rewards=self.agent_mode,
                                 with_images=bool(cfg.rollout.agent_func_path) and self.images is not None)
        self.scorer = Scorer(self.agent_mode, self.reward_source, self.tokenizer, self.watchdog, self.forwards,
                             self.rank, self.world)
        queue = QueueSettings.from_config(cfg.rollout, a, cfg.data.generate_max_len)
        self.async_rollout = AsyncRollout(queue, self.roles, self.groups, self.rank, self.scorer, self.sampler,
                                          self.prompts_for, self.tokenizer.pad_token_id) \
            if cfg.rollout.async_train else None
        # a dynamic-filtering refill is up to max_rounds + 1 rounds of generation + scoring: each round has its own
        # deadline (RefillRolloutStage), the whole stage the sum
        round_s, refill_s = refill_deadlines(t.watchdog_timeout_s, t.watchdog_slow_timeout_s,
                                             a.dynamic_filtering_max_rounds)
        self.stages: List[Stage] = build_stages(cfg.rollout, a, cfg.optim, cfg.logging, cfg.data, StageParts(
            has={k: bool(v) for k, v in self.plan.ranks.items()}, agent_mode=self.agent_mode,
            reward_source=self.reward_source, forwards=self.forwards, rollouts=self.rollouts, scorer=self.scorer,
            sampler=self.sampler, scheduler=self.scheduler, watchdog=self.watchdog, weight_sync=self.weight_sync,
            reward_norm=self.reward_norm, guard=self.invalid_rewards, queue=self.async_rollout,
            refill_draw=self.refill_prompts, total_steps=self.total_steps,
            timeouts=(t.watchdog_timeout_s, t.watchdog_slow_timeout_s, round_s, refill_s),
            distill=distill_stages(cfg.teacher, t.watchdog_slow_timeout_s, self.forwards)))
        self.watchdog.deadlines.update(stage_deadlines(self.stages))

    # ---- phases ----------------------------------------------------------------------------------------------------
    def waits_for(self, stage: Stage) -> Optional[str]:
        """The role this rank only waits for in ``stage`` (it holds neither the stage's role nor the one it shares
        with), else None: then the watchdog reports "waiting for <role> (<stage>)" and holds this rank to the
        stage's deadline plus what earlier waits owe (rlhf.distributed.watchdog.Watchdog)."""
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
        print0(f"[preempt] {self.cadence.stop.reason()}: step {self.step + 1} cut after its {stage} phase; checkpoint "
             f"of step {self.step} (the last completed) saved in {c.ckpt_path}; the run is NOT complete "
             f"({self.step}/{self.total_steps} steps): resume with --load_checkpoint")

    # ---- weights ---------------------------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Actor -> rollout engines.  Colocated: every rank; separate: the actor and rollout ranks."""
        sync_weights(self.weight_sync, self.roles)

    # ---- checkpoint (rlhf.rl.persistence) --------------------------------------------------------------------------
    def save(self):
        state = run_state(self.step, self.kl_ctl.value, self.reward_norm, self.async_rollout)
        with self.watchdog.phase("save"):
            save_run(self.cfg.checkpoint, self.step, self.roles, state, ckpt.run_identity(self.cfg), self.tokenizer)

    def resume(self) -> bool:
        with self.watchdog.phase("load"):  # the verification reads the whole checkpoint (in shares): bytes-scaled
            path = ckpt.resume_path(self.cfg.checkpoint.ckpt_path, self.cfg.checkpoint.strict_resume)
        if path is None:  # preflight said so (check_resume: "no checkpoint ... starting from step 0")
            return False
        with self.watchdog.phase("load"):
            self.step = restore_run(path, self.roles, self.kl_ctl, self.reward_norm, self.async_rollout)
        with self.phase(self.stage_named("weight_sync")):
            self.sync_weights()
        print0(f"[resume] from {path} at step {self.step}")
        return True

    def first_sync(self) -> None:
        """Colocated vLLM takes the actor's weights here, before the first generate, unless a resume synced
        already (``needs_first_sync``: collective)."""
        if needs_first_sync(self.roles.rollout.engine):  # None on ranks without a rollout engine
            with self.phase(self.stage_named("weight_sync")):
                self.sync_weights()

    def stage_named(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def finish(self):
        """Collective: the final export (--save_path, with --save_value_network the critic's)."""
        with self.watchdog.phase("save"):
            export_final(self.cfg.checkpoint, self.roles, self.tokenizer)

    def evaluate(self) -> dict:
        """Collective: one eval pass with the current weights (``Evaluator.run``); {} with no eval prompts."""
        return self.evaluator.run(self.step, self.roles)

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
