"""The PPO / GRPO loop: a loop that calls parts (experience.py, ppo_update.py, the phase scheduler)."""
from __future__ import annotations

import os
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from rlhf.algorithms import ADVANTAGE_ESTIMATORS, RunningMeanStd, make_kl_controller
from rlhf.data.formatting import build_prompts
from rlhf.data.loading import load_rows, split_eval
from rlhf.distributed import (PhaseScheduler, WeightSync, build_groups, init_distributed, make_plan,
                              nnodes_from_env)
from rlhf.models.load import load_tokenizer, resolve_pretrain
from rlhf.rewards.reward_func import builtin_reward_source, make_reward_source
from rlhf.rollout.base import SamplingParams
from rlhf.utils import checkpoint as ckpt
from rlhf.utils.logging import MetricsLogger
from rlhf.utils.preempt import install_signal_handler, stop_requested

from .experience import (gather_rollout, gather_rows, generate_shard, inference_rows, make_experience,
                         reward_shard)
from .ppo_update import train_actor, train_critic
from .roles import build_roles


def _log0(msg: str):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def load_prompt_sets(cfg, tokenizer, kit_dir: Optional[str]):
    d = cfg.data
    keys = {"input_key": d.input_key, "label_key": d.label_key}
    if d.prompt_data:
        rows = load_rows(d.prompt_data, keys, d.prompt_data_probs, d.max_samples, cfg.optim.seed)
        if d.eval_dataset:
            ev = load_rows(d.eval_dataset, keys, None, d.max_samples, cfg.optim.seed)
        else:
            rows, ev = split_eval(rows, d.eval_split, cfg.optim.seed)
    else:  # built-in arithmetic task of the tiny kit
        if kit_dir is None:
            raise ValueError("--prompt_data is required with --pretrain (the built-in task comes with the built-in "
                             "kit); e.g. --prompt_data prompts.jsonl --input_key input --label_key label")
        data = os.path.join(kit_dir, "data")
        rows = load_rows(os.path.join(data, "prompts_train.jsonl"), keys, None, d.max_samples)
        ev = load_rows(os.path.join(data, "prompts_eval.jsonl"), keys, None, d.max_samples)
    return build_prompts(rows, tokenizer, d), build_prompts(ev, tokenizer, d)


class RLTrainer:
    def __init__(self, cfg, kind: str = "ppo"):
        self.cfg, self.kind = cfg, kind
        a, t = cfg.algorithm, cfg.topology
        self.spec = ADVANTAGE_ESTIMATORS[a.advantage_estimator]
        self.need_ref = a.init_kl_coef > 0 or a.use_kl_loss
        # --- everything that can fail on bad input, before any process group exists ---
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.plan = make_plan(t, world, t.nnodes_hint or nnodes_from_env(), self.need_ref, self.spec.needs_critic,
                              cfg.model.reward_pretrain is not None)
        if cfg.rollout.async_train and not self.plan.separate_rollout:
            raise ValueError("--async_train needs rollout ranks of their own: set --vllm_num_engines > 0 and give "
                             "the job those extra ranks")
        self.agent_mode = bool(cfg.rollout.agent_func_path)
        if self.agent_mode:
            from rlhf.agents.base import load_agent

            load_agent(cfg.rollout.agent_func_path)  # fail on a bad file before any process group
        self.reward_source = make_reward_source(cfg.rollout.remote_rm_url, cfg.rollout.reward_timeout_s, _log0)
        if self.reward_source is None and not cfg.model.reward_pretrain:
            self.reward_source = builtin_reward_source(_log0)
        self.path = resolve_pretrain(cfg.model.pretrain)
        self.tokenizer = load_tokenizer(self.path)
        self.prompts, self.eval_prompts = load_prompt_sets(cfg, self.tokenizer, None if cfg.model.pretrain else self.path)
        rb = cfg.rollout.rollout_batch_size
        if len(self.prompts) < rb:
            raise ValueError(f"{len(self.prompts)} prompts is fewer than --rollout_batch_size {rb}")
        self.steps_per_episode = len(self.prompts) // rb
        total = self.steps_per_episode * cfg.optim.num_episodes
        if cfg.optim.max_global_steps > 0:
            total = min(total, cfg.optim.max_global_steps)
        self.total_steps = total
        # --- process groups and roles ---
        self.rank, self.world, _, self.device = init_distributed(t.dist_timeout_s)
        torch.manual_seed(cfg.optim.seed)
        self.groups = build_groups(self.plan, self.rank)
        samples = rb * cfg.rollout.n_samples_per_prompt
        opt_steps = total * cfg.optim.max_epochs * max(1, samples // cfg.optim.train_batch_size)
        self.roles = build_roles(cfg, self.groups, self.device, opt_steps, self.need_ref, self.spec.needs_critic)
        self.scheduler = PhaseScheduler(self.rank, self.roles.sleepables(), group=None, barrier=self.plan.colocated,
                                        enabled=self.plan.colocated and (t.vllm_enable_sleep or t.deepspeed_enable_sleep))
        self.scheduler.put_all_to_sleep()
        self.weight_sync = WeightSync(self.groups, self.roles.rollout, timeout_s=t.dist_timeout_s, device=self.device,
                                      dtype=torch.bfloat16 if cfg.model.bf16 else None)
        self.kl_ctl = make_kl_controller(a.init_kl_coef, a.kl_target, a.kl_horizon)
        self.reward_norm = RunningMeanStd() if a.normalize_reward else None
        self.step = 0
        self.logger = MetricsLogger(self.rank, cfg.logging.log_dir, total, run_name=cfg.logging.wandb_run_name or kind,
                                    use_wandb=cfg.logging.use_wandb, wandb_project=cfg.logging.wandb_project,
                                    wandb_org=cfg.logging.wandb_org, use_tensorboard=cfg.logging.use_tensorboard,
                                    progress_bar=cfg.logging.progress_bar, config=cfg.to_dict())

    # ---- data ------------------------------------------------------------------------------------------------------
    def prompts_for(self, step: int):
        rb = self.cfg.rollout.rollout_batch_size
        episode, j = divmod(step, self.steps_per_episode)
        g = torch.Generator().manual_seed(self.cfg.optim.seed + episode)
        perm = torch.randperm(len(self.prompts), generator=g)[j * rb:(j + 1) * rb]
        return [self.prompts[i] for i in perm.tolist()]

    def sampling(self, step: int, eval_mode: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(n=r.eval_n_samples_per_prompt if eval_mode else r.n_samples_per_prompt,
                              temperature=r.eval_temperature if eval_mode else r.temperature,
                              top_p=r.top_p, top_k=r.top_k, max_new_tokens=self.cfg.data.generate_max_len,
                              stop_token_ids=(self.tokenizer.eos_token_id,),
                              # per engine, not per rank: the TP ranks of one vLLM engine must sample identically
                              seed=self.cfg.optim.seed * 100003 + step * 97 + (self.plan.engine_of(self.rank) or 0))

    def generate(self, step: int, prompts, eval_mode: bool = False):
        with self.scheduler.phase("rollout", tags=None):
            return generate_shard(self.roles, self.groups, prompts, self.sampling(step, eval_mode))

    # ---- weights ---------------------------------------------------------------------------------------------------
    def sync_weights(self) -> float:
        t0 = time.perf_counter()
        if self.plan.separate_rollout:
            if self.groups.has("actor") or self.groups.has("rollout"):
                self.weight_sync.sync(self.roles.actor.model if self.roles.actor is not None else None)
        else:
            with self.scheduler.phase("sync", role="rollout", share="actor", tags=["weights"]):
                self.weight_sync.sync(self.roles.actor.model)
        return time.perf_counter() - t0

    # ---- checkpoint ------------------------------------------------------------------------------------------------
    def save(self):
        c = self.cfg.checkpoint

        def write(tmp):
            if self.roles.actor is not None:
                self.roles.actor.save_checkpoint(os.path.join(tmp, "actor"))
            if self.roles.critic is not None:
                self.roles.critic.save_checkpoint(os.path.join(tmp, "critic"))

        state = {"step": self.step, "kl_coef": self.kl_ctl.value,
                 "reward_norm": self.reward_norm.state_dict() if self.reward_norm else None}
        path = ckpt.save_checkpoint(c.ckpt_path, self.step, write, state, c.max_ckpt_num)
        if c.save_hf_ckpt:
            self.save_hf(os.path.join(path, "hf"))

    def resume(self) -> bool:
        path = ckpt.latest_checkpoint(self.cfg.checkpoint.ckpt_path)
        if path is None:
            _log0(f"[resume] no complete checkpoint in {self.cfg.checkpoint.ckpt_path}; starting fresh")
            return False
        if self.roles.actor is not None:
            self.roles.actor.load_checkpoint(os.path.join(path, "actor"))
        if self.roles.critic is not None:
            self.roles.critic.load_checkpoint(os.path.join(path, "critic"))
        st = ckpt.load_trainer_state(path)
        self.step = st["step"]
        self.kl_ctl.value = st["kl_coef"]
        if self.reward_norm is not None and st.get("reward_norm"):
            self.reward_norm.load_state_dict(st["reward_norm"])
        ckpt.load_rank_state(path)
        _log0(f"[resume] from {path} at step {self.step}")
        return True

    def save_hf(self, path: str):
        """Collective: the actor ranks gather the full weights, the first actor rank writes them."""
        if self.groups.has("actor"):
            sd = self.roles.actor.full_state_dict()
            if self.rank == self.plan.roles["actor"][0]:
                ckpt.save_hf(sd, self.roles.actor.model, self.tokenizer, path)
        dist.barrier()

    # ---- eval ------------------------------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        if not self.eval_prompts:
            return {}
        local = self.generate(self.step, self.eval_prompts, eval_mode=True)
        n = len(self.eval_prompts) * self.cfg.rollout.eval_n_samples_per_prompt
        batch = gather_rollout(local, n, self.tokenizer.pad_token_id, self.agent_mode)
        labels = [p.label for p in self.eval_prompts for _ in range(self.cfg.rollout.eval_n_samples_per_prompt)]
        res = reward_shard(self.roles, self.groups, self.reward_source, self.tokenizer, batch, labels,
                           inference_rows(self.cfg))
        r = gather_rows(None if res is None else res["rewards"].unsqueeze(1), n).squeeze(1)
        return {"reward": float(r.mean()), "response_len": float(batch.action_mask.sum(1).float().mean())}

    # ---- loop ------------------------------------------------------------------------------------------------------
    def fit(self):
        cfg = self.cfg
        install_signal_handler()
        if cfg.checkpoint.load_checkpoint and self.resume():
            self.sync_weights()
            self.logger.advance(self.step)
        n_rows = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        pending = None
        if cfg.rollout.async_train and self.step < self.total_steps:
            pending = self.generate(self.step, self.prompts_for(self.step))
        while self.step < self.total_steps:
            t_step = time.perf_counter()
            prompts = self.prompts_for(self.step)
            t0 = time.perf_counter()
            local = pending if cfg.rollout.async_train else self.generate(self.step, prompts)
            batch = gather_rollout(local, n_rows, self.tokenizer.pad_token_id, self.agent_mode)
            t_gen = time.perf_counter() - t0
            labels = [p.label for p in prompts for _ in range(cfg.rollout.n_samples_per_prompt)]
            t0 = time.perf_counter()
            exp = make_experience(cfg, self.roles, self.groups, batch, labels, self.reward_source, self.tokenizer,
                                  self.kl_ctl.value, self.reward_norm, scheduler=self.scheduler)
            t_exp = time.perf_counter() - t0
            if cfg.rollout.async_train and self.step + 1 < self.total_steps:
                # rollout ranks start the next batch now, while the actor ranks train on this one
                pending = self.generate(self.step + 1, self.prompts_for(self.step + 1))
            t0 = time.perf_counter()
            metrics = dict(exp.metrics)
            if self.roles.critic is not None:
                with self.scheduler.phase("critic_train", role="critic"):
                    metrics.update(train_critic(cfg, self.roles.critic, exp, self.groups.role_rank("critic"),
                                                self.groups.role_size("critic"), self.step))
            if self.roles.actor is not None:
                with self.scheduler.phase("actor_train", role="actor"):
                    metrics.update(train_actor(cfg, self.roles.actor, exp, self.groups.role_rank("actor"),
                                               self.groups.role_size("actor"), self.kl_ctl.value, self.step))
            t_train = time.perf_counter() - t0
            t_sync = self.sync_weights()
            self.kl_ctl.update(metrics["kl"], n_rows)
            self.step += 1
            dt = time.perf_counter() - t_step
            tokens = int(batch.attention_mask.sum())
            metrics.update({"time_generate": t_gen, "time_experience": t_exp, "time_train": t_train,
                            "time_sync": t_sync, "time_step": dt, "tokens_per_s": tokens / dt})
            metrics = self._reduce_metrics(metrics)
            if self.step % cfg.logging.logging_steps == 0 or self.step == self.total_steps:
                self.logger.log(self.step, metrics)
            self.logger.advance()
            es = cfg.logging.eval_steps
            if es > 0 and self.step % es == 0:
                self.logger.log(self.step, self.evaluate(), prefix="eval")
            if cfg.checkpoint.save_steps > 0 and self.step % cfg.checkpoint.save_steps == 0:
                self.save()
            if self.step < self.total_steps and stop_requested():
                _log0(f"[preempt] stop requested: checkpointing step {self.step} and exiting")
                self.save()
                self.logger.close()
                return self
        es = cfg.logging.eval_steps
        if not (es > 0 and self.step % es == 0):  # final eval unless one just ran
            self.logger.log(self.step, self.evaluate(), prefix="eval")
        self.save_hf(cfg.checkpoint.save_path)
        self.logger.close()
        return self

    def _reduce_metrics(self, metrics: dict) -> dict:
        """Mean over the ranks that computed each metric (critic metrics live on critic ranks only)."""
        if self.world == 1:
            return {k: float(v) for k, v in metrics.items()}
        every = [None] * self.world
        dist.all_gather_object(every, {k: float(v) for k, v in metrics.items()})
        keys = list(dict.fromkeys(k for d in every for k in d))
        return {k: sum(d[k] for d in every if k in d) / sum(1 for d in every if k in d) for k in keys}

    def close(self):
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def run_rl(cfg, kind: str):
    trainer = RLTrainer(cfg, kind)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer
