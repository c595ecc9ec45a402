"""The SPMD sweep: many RL configurations per torchrun launch (start-up paid once), awkward sizes, every placement.

    torchrun --nproc_per_node N tests/helpers/sweep.py --kit KIT --data DIR --out DIR [--cases a,b]

Each case builds a fresh trainer over the launch's process group (new role groups),
runs its steps, and rank 0 appends one JSON line to DIR/results.jsonl.  An error in
any case ends the whole launch (rlhf.distributed.failfast), which the test reports.
``CASES[world]`` lists the cases for a world size; ``NODES2`` the 2 nodes x 2 ranks ones.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

# run by path under torchrun, sys.path[0] is tests/helpers: put tests/ first so ``helpers`` imports
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.e2e import flags_argv  # noqa: E402

# name -> (trainer kind, flags); sizes are chosen to be awkward: fewer prompts than ranks or engines, rollout
# batches that do not divide over the engines, data sets not a multiple of the batch, one-prompt eval sets.
BASE = {"generate_max_len": 4, "remote_rm_url": "builtin:arithmetic", "lr_warmup_ratio": 0.0,
        "actor_learning_rate": 1e-4, "max_global_steps": 2, "micro_rollout_batch_size": 2,
        # greedy, one sample per eval prompt (OpenRLHF's defaults, 0.6 and 4, make every eval 4x)
        "eval_temperature": 0.0, "eval_n_samples_per_prompt": 1}
RM = {"remote_rm_url": None, "reward_pretrain": "{kit}/reward"}
# a reward function (rlhf.engines: streamed on the rollout ranks under --async_train) whose scores vary by response
FAULT_RM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_reward.py")
# scores that vary from sample to sample: a reward function, and a two-turn agent (feedback between the turns)
VARIED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "varied_scores.py")

CASES = {
    1: {
        "w1_group_norm_eval1": ("grpo", dict(prompts=6, eval_prompts=1, rollout_batch_size=4, n_samples_per_prompt=2,
                                             train_batch_size=8, micro_train_batch_size=4)),
        "w1_gae_rm": ("ppo", dict(RM, prompts=5, rollout_batch_size=2, n_samples_per_prompt=1, train_batch_size=2,
                                  micro_train_batch_size=1, advantage_estimator="gae", critic_learning_rate=1e-3)),
        "w1_dynamic_filtering_refill": ("grpo", dict(prompts=12, eval_prompts=1, rollout_batch_size=4,
                                                     n_samples_per_prompt=4, train_batch_size=16,
                                                     micro_train_batch_size=8, micro_rollout_batch_size=8,
                                                     dynamic_filtering=True,
                                                     dynamic_filtering_reward_range=(0.2, 0.7), generate_max_len=6,
                                                     remote_rm_url=FAULT_RM)),
        # DeepSpeed ZeRO-2: actor and critic trained, the reward model frozen (a plain module below stage 3)
        "w1_deepspeed_zero2_gae_rm": ("ppo", dict(RM, prompts=4, eval_prompts=1, rollout_batch_size=2,
                                                  n_samples_per_prompt=1, train_batch_size=2, micro_train_batch_size=1,
                                                  advantage_estimator="gae", critic_learning_rate=1e-3,
                                                  backend="deepspeed", zero_stage=2)),
        # a two-turn agent, synchronous: episodes on the HF engine, the environment's rewards, feedback masked
        "w1_agent_two_turns": ("grpo", dict(prompts=5, eval_prompts=1, rollout_batch_size=2, n_samples_per_prompt=2,
                                            train_batch_size=4, micro_train_batch_size=2, agent_func_path=VARIED,
                                            max_steps=2, remote_rm_url=None, generate_max_len=6)),
        "w1_rloo_small_data": ("grpo", dict(prompts=3, eval_prompts=0, rollout_batch_size=3, n_samples_per_prompt=2,
                                            train_batch_size=6, micro_train_batch_size=3,
                                            advantage_estimator="rloo", max_epochs=2)),
    },
    2: {
        # the issue's own case: 16 prompts, a 10% eval hold-out (--eval_holdout 0.1) -> 1 eval prompt for 2 ranks
        # (on-policy: the gap is measured by the logprob_gap stage; eval: 2 samples of the one prompt -> pass@2)
        "w2_issue_16_prompts": ("grpo", dict(prompts=16, eval_prompts=None, rollout_batch_size=8,
                                             n_samples_per_prompt=2, train_batch_size=16, micro_train_batch_size=8,
                                             max_samples=16, colocate_all_models=True, eval_holdout=0.1,
                                             eval_n_samples_per_prompt=2, eval_temperature=1.0)),
        "w2_colocated_sleep_rb1": ("grpo", dict(prompts=4, eval_prompts=1, rollout_batch_size=1,
                                                n_samples_per_prompt=2, train_batch_size=2, micro_train_batch_size=1,
                                                colocate_all_models=True, vllm_enable_sleep=True,
                                                deepspeed_enable_sleep=True)),
        "w2_colocated_rb3_split": ("grpo", dict(prompts=10, eval_holdout=0.0, rollout_batch_size=3,
                                                n_samples_per_prompt=2, train_batch_size=6, micro_train_batch_size=3,
                                                colocate_all_models=True, advantage_estimator="dr_grpo")),
        "w2_actor_ref_colocated_rollout_own": ("ppo", dict(prompts=5, eval_prompts=1, rollout_batch_size=2,
                                                           n_samples_per_prompt=1, train_batch_size=2,
                                                           micro_train_batch_size=2, advantage_estimator="reinforce",
                                                           actor_num_gpus_per_node=1, colocate_actor_ref=True,
                                                           vllm_num_engines=1)),
        # the reward model on the actor's rank scores each batch ahead between the update and the weight sync
        "w2_async_rloo_rm": ("grpo", dict(RM, prompts=7, eval_prompts=1, rollout_batch_size=2,
                                             n_samples_per_prompt=2, train_batch_size=4, micro_train_batch_size=2,
                                             advantage_estimator="rloo", actor_num_gpus_per_node=1,
                                             vllm_num_engines=1, async_train=True, max_global_steps=3)),
        # agents under --async_train, K=2: episodes run whole on the rollout rank while the actor trains, 3 groups
        # in flight for batches of 2 (oversampling), streamed groups filtered by their environment's scores
        "w2_async_agent_k2_oversample_filter": ("grpo", dict(prompts=9, eval_prompts=1, rollout_batch_size=2,
                                                             n_samples_per_prompt=2, train_batch_size=4,
                                                             micro_train_batch_size=2, actor_num_gpus_per_node=1,
                                                             vllm_num_engines=1, async_train=True,
                                                             async_queue_size=2, vllm_generate_batch_size=3,
                                                             agent_func_path=VARIED, max_steps=2, remote_rm_url=None,
                                                             generate_max_len=6, dynamic_filtering=True,
                                                             dynamic_filtering_reward_range=(0.2, 0.7),
                                                             max_global_steps=3)),
        # issue 29: K=2 batches ahead, partial rollout in chunks of 2 of 6 tokens, oversampling (3 groups in flight
        # for batches of 2) and dynamic filtering of streamed rewards (groups dropped as they complete, new prompts
        # drawn in their place).  The random kit's samples all run to the limit, so groups complete together and
        # none spans a sync here: samples that do are checked on the SFT'd model (tests/vllm_cpu/test_vllm_e2e.py) and on a
        # scripted engine (tests/unit/test_async_rollout.py)
        "w2_async_k2_partial_oversample_filter": ("grpo", dict(prompts=9, eval_prompts=1, rollout_batch_size=2,
                                                               n_samples_per_prompt=2, train_batch_size=4,
                                                               micro_train_batch_size=2, actor_num_gpus_per_node=1,
                                                               vllm_num_engines=1, async_train=True,
                                                               async_queue_size=2, partial_rollout=True,
                                                               partial_rollout_chunk=2, generate_max_len=6,
                                                               vllm_generate_batch_size=3, dynamic_filtering=True,
                                                               dynamic_filtering_reward_range=(0.2, 0.7),
                                                               remote_rm_url=FAULT_RM, max_global_steps=4,
                                                               save_steps=2)),
        # ... and resumed from its step-2 checkpoint (its step-4 one removed): the queue is not checkpointed, only
        # the engine's place in its prompt stream; the K batches are generated again with the resumed weights,
        # from the prompts after those the first run had drawn
        "w2_async_k2_resume": ("grpo", dict(resumes="w2_async_k2_partial_oversample_filter")),
        # DeepSpeed ZeRO-3 under --bf16 with LoRA: partitioned bf16 actor (fp32 masters), LoRA merged at the sync,
        # frozen ref and reward model partitioned too
        "w2_deepspeed_zero3_bf16_lora_rm": ("grpo", dict(RM, prompts=4, eval_prompts=1, rollout_batch_size=2,
                                                         n_samples_per_prompt=2, train_batch_size=4,
                                                         micro_train_batch_size=1, colocate_all_models=True,
                                                         backend="deepspeed", zero_stage=3, bf16=True, lora_rank=4,
                                                         lora_alpha=8)),
        # --use_dynamic_batch (issue 28): token-budget micro-batches for the actor and critic updates and the ref,
        # old log-prob, value and reward-model forwards; packed actor, padded critic / RM, two epochs (old log-probs)
        "w2_dynamic_batch_gae_rm_packed": ("ppo", dict(RM, prompts=6, eval_prompts=1, rollout_batch_size=4,
                                                       n_samples_per_prompt=1, train_batch_size=4,
                                                       micro_train_batch_size=1, advantage_estimator="gae",
                                                       colocate_all_models=True, critic_learning_rate=1e-3,
                                                       packing_samples=True, max_epochs=2, init_kl_coef=0.01,
                                                       use_dynamic_batch=True, prompt_max_len=8,
                                                       train_max_tokens_per_gpu=12, rollout_max_tokens_per_gpu=12)),
        # DeepSpeed ZeRO-2 with --adam_offload (offload_optimizer) and token budgets (the accumulation boundary
        # set by hand: the micro-batch count varies)
        "w2_dynamic_batch_deepspeed_offload": ("grpo", dict(prompts=4, eval_prompts=1, rollout_batch_size=2,
                                                            n_samples_per_prompt=2, train_batch_size=4,
                                                            micro_train_batch_size=1, colocate_all_models=True,
                                                            backend="deepspeed", zero_stage=2, adam_offload=True,
                                                            use_dynamic_batch=True, prompt_max_len=8,
                                                            train_max_tokens_per_gpu=12)),
        "w2_gae_rm_colocated": ("ppo", dict(RM, prompts=4, eval_prompts=1, rollout_batch_size=2,
                                            n_samples_per_prompt=1, train_batch_size=2, micro_train_batch_size=1,
                                            advantage_estimator="gae", colocate_all_models=True,
                                            critic_learning_rate=1e-3, freezing_actor_steps=1,
                                            save_value_network=True)),
    },
    3: {
        "w3_actor_ref_rollout_blocks": ("grpo", dict(prompts=5, eval_prompts=1, rollout_batch_size=3,
                                                     n_samples_per_prompt=2, train_batch_size=6,
                                                     micro_train_batch_size=3, actor_num_gpus_per_node=1,
                                                     ref_num_gpus_per_node=1, vllm_num_engines=1)),
        "w3_gae_critic_reward_block": ("ppo", dict(RM, prompts=4, eval_prompts=2, rollout_batch_size=2,
                                                   n_samples_per_prompt=1, train_batch_size=2,
                                                   micro_train_batch_size=2, advantage_estimator="gae",
                                                   actor_num_gpus_per_node=1, critic_num_gpus_per_node=1,
                                                   reward_num_gpus_per_node=1, colocate_critic_reward=True,
                                                   colocate_actor_ref=True, vllm_num_engines=1,
                                                   critic_learning_rate=1e-3)),
        # issue 29: the actor alone, 2 engines of their own; K=1 with partial rollout, 3 prompts over 2 engines
        # (quotas 2 and 1), chunks of 1 token
        "w3_async_partial_rb3_two_engines": ("grpo", dict(prompts=7, eval_prompts=1, rollout_batch_size=3,
                                                          n_samples_per_prompt=2, train_batch_size=6,
                                                          micro_train_batch_size=3, actor_num_gpus_per_node=1,
                                                          vllm_num_engines=2, async_train=True, partial_rollout=True,
                                                          partial_rollout_chunk=1, remote_rm_url=FAULT_RM)),
        # issue 29: a reward model on a rank of its own scores each batch ahead (right after the engine produced it,
        # while the actor trains); K=2 with partial rollout; the scores are checked against scoring the batch anew
        "w3_async_rm_own_rank_k2": ("grpo", dict(RM, prompts=7, eval_prompts=1, rollout_batch_size=2,
                                                 n_samples_per_prompt=2, train_batch_size=4, micro_train_batch_size=2,
                                                 actor_num_gpus_per_node=1, reward_num_gpus_per_node=1,
                                                 vllm_num_engines=1, async_train=True, async_queue_size=2,
                                                 partial_rollout=True, partial_rollout_chunk=2, generate_max_len=6,
                                                 max_global_steps=3)),
        "w3_colocated_uneven": ("grpo", dict(prompts=8, eval_prompts=1, rollout_batch_size=3, n_samples_per_prompt=3,
                                             train_batch_size=9, micro_train_batch_size=3,
                                             colocate_all_models=True, micro_rollout_batch_size=1,
                                             advantage_estimator="reinforce_baseline")),
    },
    4: {
        "w4_ppo_every_role_own_ranks": ("ppo", dict(RM, prompts=4, eval_prompts=1, rollout_batch_size=2,
                                                    n_samples_per_prompt=1, train_batch_size=2,
                                                    micro_train_batch_size=2, advantage_estimator="gae",
                                                    actor_num_gpus_per_node=1, ref_num_gpus_per_node=1,
                                                    critic_num_gpus_per_node=1, colocate_critic_reward=True,
                                                    reward_num_gpus_per_node=1, vllm_num_engines=1,
                                                    critic_learning_rate=1e-3)),
        "w4_colocated_tp2_rb1": ("grpo", dict(prompts=3, eval_prompts=1, rollout_batch_size=1, n_samples_per_prompt=4,
                                              train_batch_size=4, micro_train_batch_size=1,
                                              colocate_all_models=True, vllm_tensor_parallel_size=2)),
        # sequence parallelism: --ring_attn_size 2 over 4 colocated ranks = 2 data-parallel ranks x 2; actor (LoRA,
        # gradient checkpointing), critic and reference split each packed row (issue 28)
        "w4_sp2_gae_lora_ckpt": ("ppo", dict(prompts=4, eval_prompts=1, rollout_batch_size=2, n_samples_per_prompt=2,
                                             train_batch_size=4, micro_train_batch_size=1, colocate_all_models=True,
                                             packing_samples=True, ring_attn_size=2, advantage_estimator="gae",
                                             critic_learning_rate=1e-3, init_kl_coef=0.01, lora_rank=4,
                                             lora_alpha=8, gradient_checkpointing=True)),
        # actor on ranks 0-1, reference on 2, rollout on 3 (weights by broadcast), one step off-policy: step 1 is
        # generated with the weights it trains, steps 2-3 with those of one update earlier (the gap shows it)
        "w4_actor2_ref1_rollout1_async_gap": ("grpo", dict(prompts=7, eval_prompts=1, rollout_batch_size=2,
                                                           n_samples_per_prompt=4, train_batch_size=8,
                                                           micro_train_batch_size=4, actor_num_gpus_per_node=2,
                                                           ref_num_gpus_per_node=1, vllm_num_engines=1,
                                                           async_train=True, enable_is_correction=True,
                                                           remote_rm_url=VARIED, max_global_steps=3)),
        "w4_actor2_rollout2_async": ("grpo", dict(prompts=6, eval_prompts=1, rollout_batch_size=3,
                                                  n_samples_per_prompt=2, train_batch_size=6,
                                                  micro_train_batch_size=3, actor_num_gpus_per_node=2,
                                                  vllm_num_engines=2, async_train=True,
                                                  advantage_estimator="group_norm")),
    },
}
NODES2 = {  # 2 nodes x 2 ranks (two torchrun agents, c10d rendezvous)
    "n2_colocated": ("grpo", dict(prompts=4, eval_prompts=1, rollout_batch_size=2, n_samples_per_prompt=2,
                                  train_batch_size=4, micro_train_batch_size=1, colocate_all_models=True)),
    "n2_actor_node_rollout_node": ("grpo", dict(prompts=5, eval_prompts=1, rollout_batch_size=3,
                                                n_samples_per_prompt=2, train_batch_size=6, micro_train_batch_size=3,
                                                actor_num_nodes=1, actor_num_gpus_per_node=2, vllm_num_engines=2)),
}


def write_prompts(path: str, rows) -> str:
    """Every rank writes the same file: atomically (own temp file, then rename), so no rank reads a partial one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
    return path


def resumed_case(name: str, spec: dict, table: dict):
    """(name of the case whose run and files this one resumes, its spec) for a case ``dict(resumes=earlier)``;
    else (name, spec)."""
    earlier = spec[1].get("resumes")
    return (earlier, table[earlier]) if earlier else (name, spec)


def case_argv(name: str, spec: dict, kit: str, data: str, out: str):
    """(kind, argv, expected steps) for one case; writes its prompt files.  A case that ``resumes`` an earlier
    one runs with that case's flags and folders and --load_checkpoint."""
    kind, flags = spec
    flags = {**BASE, **flags}
    with open(os.path.join(kit, "data", "prompts_train.jsonl")) as fh:
        pool = [json.loads(line) for line in fh][:64]
    n, n_eval = flags.pop("prompts"), flags.pop("eval_prompts", None)
    flags["prompt_data"] = write_prompts(os.path.join(data, f"{name}_train.jsonl"), pool[:n])
    if n_eval is not None and n_eval > 0:
        flags["eval_dataset"] = write_prompts(os.path.join(data, f"{name}_eval.jsonl"), pool[32:32 + n_eval])
    elif n_eval == 0:
        flags["eval_holdout"] = 0.0
    flags.update(pretrain=kit, log_dir=os.path.join(out, name, "logs"), save_path=os.path.join(out, name, "model"),
                 ckpt_path=os.path.join(out, name, "ckpt"), no_progress_bar=True)
    if flags.get("reward_pretrain"):
        flags["reward_pretrain"] = flags["reward_pretrain"].format(kit=kit)
    argv = flags_argv(flags)
    n_train = n - (max(1, int(n * flags.get("eval_holdout", 0.0))) if "eval_dataset" not in flags
                   and flags.get("eval_holdout", 0.0) > 0 else 0)
    steps = min(n_train // flags["rollout_batch_size"] * flags.get("num_episodes", 1), flags["max_global_steps"])
    return kind, argv, steps


def _lines(path: str) -> int:
    if not os.path.isfile(path):
        return 0
    with open(path) as fh:
        return sum(1 for _ in fh)


def check_rewards_ahead(trainer) -> list:
    """Under --async_train with a reward model, each batch's scores are computed ahead, on the reward model's ranks
    (rlhf.rl.async_queue.AsyncRollout.score_ahead): wrap ``take`` to score the taken batch anew, the
    synchronous way (every rank), and record the largest difference per step."""
    ar, diffs = trainer.async_rollout, []
    if ar is None or not ar.ahead:
        return diffs
    take = ar.take

    def checked(st):
        batch = take(st)
        again = trainer.scorer.score(batch, trainer.roles, st.labels).rewards
        diffs.append(float((again - st.rewards).abs().max()))
        return batch

    ar.take = checked
    return diffs


def drop_last_checkpoint(ckpt: str, save: str, step: int) -> None:
    """Before a resume: the run's step-``step`` checkpoint and its final model go, so the resume starts from the
    one before (rank 0 removes, every rank waits)."""
    import shutil

    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(ckpt, f"global_step_{step}"))
        os.remove(os.path.join(save, "model.safetensors"))
    dist.barrier()


def queue_places(ckpt: str) -> dict:
    """{step: prompts drawn over the engines} of each checkpoint's async queue state (trainer state)."""
    from rlhf.checkpoint import load_trainer_state

    out = {}
    if os.path.isdir(ckpt):
        for d in sorted(os.listdir(ckpt)):
            if d.startswith("global_step_"):
                q = load_trainer_state(os.path.join(ckpt, d)).get("async_queue")
                if q:
                    out[int(d.split("_")[-1])] = sum(q["drawn"].values())
    return out


def run_cases(cases: dict, kit: str, data: str, out: str, table: dict) -> None:
    import torch.distributed as dist

    from rlhf.config import parse
    from rlhf.rl.trainer import RLTrainer
    from rlhf.train_grpo import GRPO_DEFAULTS
    from rlhf.train_ppo import PPO_DEFAULTS

    defaults = {"grpo": GRPO_DEFAULTS, "ppo": PPO_DEFAULTS}
    for name, spec in cases.items():
        first = 1
        run, run_spec = resumed_case(name, spec, table)
        kind, argv, steps = case_argv(run, run_spec, kit, data, out)
        t0 = time.time()
        if run != name:
            save_steps = run_spec[1]["save_steps"]
            first = (steps - 1) // save_steps * save_steps + 1  # after the last checkpoint before the end
            drop_last_checkpoint(os.path.join(out, run, "ckpt"), os.path.join(out, run, "model"), steps)
            argv = argv + ["--load_checkpoint", "--log_dir", os.path.join(out, name, "logs")]
        cfg = parse(kind, argv, defaults[kind])
        trainer = RLTrainer(cfg, name)
        ahead_diffs = check_rewards_ahead(trainer)
        trainer.fit()
        trainer.watchdog.stop()
        dist.barrier()
        rows = []
        if trainer.rank == 0:
            from rlhf.utils.logging import read_metrics

            rows = read_metrics(os.path.join(cfg.logging.log_dir, "metrics.jsonl"))
            train = [r for r in rows if r["split"] == "train"]
            ev = [r for r in rows if r["split"] == "eval"]
            finite = all(math.isfinite(v) for r in train for k, v in r.items() if isinstance(v, float)
                         and k not in ("rollout_logprob_gap",))
            critic_dir = cfg.checkpoint.save_path + "_critic"
            with open(os.path.join(out, "results.jsonl"), "a") as fh:
                fh.write(json.dumps({"case": name, "world": trainer.world, "steps": [r["step"] for r in train],
                                     "expected_steps": steps, "first_step": first,
                                     "queue_places": queue_places(cfg.checkpoint.ckpt_path), "eval_rows": len(ev),
                                     "eval_samples": [r.get("samples") for r in ev], "finite": finite,
                                     "seconds": round(time.time() - t0, 2),
                                     "exported": any(os.path.isfile(os.path.join(cfg.checkpoint.save_path, f))
                                                     for f in ("model.safetensors", "adapter_model.safetensors")),
                                     "critic_exported": os.path.isfile(os.path.join(critic_dir, "value_head.pt")),
                                     "actor_updates": [("policy_loss" in r) for r in train],
                                     "refill": [(r.get("dynamic_filter_rounds"), r.get("filtered_frac")) for r in train],
                                     "gap": [r.get("rollout_logprob_gap") for r in train],
                                     "eval_last": ev[-1] if ev else None,
                                     "async": [{k: v for k, v in r.items() if k.startswith("async/")}
                                               for r in train],
                                     "max_staleness": cfg.rollout.max_staleness,
                                     "reward_ahead_diff": max(ahead_diffs) if ahead_diffs else None,
                                     "generations": _lines(os.path.join(cfg.logging.log_dir, "generations.jsonl")),
                                     "last": {k: train[-1].get(k) for k in ("reward", "kl", "policy_loss",
                                                                           "value_loss", "response_len")}}) + "\n")
        del trainer


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--kit", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="")
    p.add_argument("--nodes2", action="store_true")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    table = NODES2 if a.nodes2 else CASES[world]
    names = [c for c in a.cases.split(",") if c] or list(table)
    os.makedirs(a.data, exist_ok=True)
    from rlhf.distributed.failfast import guarded

    guarded(lambda: run_cases({n: table[n] for n in names}, a.kit, a.data, a.out, table))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
