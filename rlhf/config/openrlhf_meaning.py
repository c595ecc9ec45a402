"""OpenRLHF's meaning for flags whose effect depends on other flags, or on whether they were given at all.

Run from ``cli.build_config`` before ``validate`` (``resolve_given``: it needs the names given on the command line
or in YAML) and from ``validate`` (``resolve_async_colocate``).  Each rule cites the OpenRLHF code it follows;
each change it makes is said in one line on stderr (rank 0), never silently.

* ``--max_len`` in RL (OpenRLHF ``--data.max_len``, default 2048, "Max total sequence length (prompt + response)";
  openrlhf/utils/agent.py ``SingleTurnAgentExecutor.execute`` / ``MultiTurnAgentExecutor.execute``): the
  prompt + response budget of each sample.  With ``--generate_max_len`` (``--rollout.max_new_tokens``) given,
  prompts keep their last ``max_len - generate_max_len`` tokens (74240 - 64000 = 10240 in OpenRLHF's agent
  scripts); without it each response may take ``max_len - its prompt's tokens`` (vLLM ``max_tokens=None``), here
  ``SamplingParams.max_total_len``.
* ``--train_max_tokens_per_gpu`` / ``--rollout_max_tokens_per_gpu`` without ``--use_dynamic_batch``: read only
  under it (OpenRLHF ``--train.dynamic_batch_enable``), said so.
* ``--normalize_reward`` without ``--reward_pretrain``: it rescales the reward model's score only (OpenRLHF
  openrlhf/models/model.py); reward functions and agents are untouched, said so.
* ``--critic_pretrain`` not given with gae and a reward model: the critic starts from the reward model
  (openrlhf/cli/train_ppo_ray.py).
* ``--async_train`` with ``--colocate_all_models``: OpenRLHF warns "Using --colocate_all_models in async RLHF only
  colocates DeepSpeed models." (openrlhf/cli/train_ppo_ray.py) and puts vLLM on GPUs of its own.
"""
from __future__ import annotations

import sys
from typing import Iterable

from rlhf.console import print0
from rlhf.errors import ConfigError

RL_KINDS = ("ppo", "grpo")


def notice(msg: str) -> None:
    print0(f"[openrlhf] {msg}", file=sys.stderr)


def resolve_given(cfg, kind: str, given: Iterable[str]) -> None:
    """Apply the rules that depend on which flags were given (``given``: flat flag names from the command line
    and YAML, after the OpenRLHF spellings were translated)."""
    given = set(given)
    if kind in RL_KINDS + ("plan",):  # rlhf.plan plans an RL job unless told --kind sft|rm|dpo
        resolve_rl_lengths(cfg, given)
    if kind in RL_KINDS:
        _critic_from_reward_model(cfg, given)
    _budget_without_dynamic_batch(cfg, given)
    if kind in RL_KINDS:
        _agent_partial_rollout(cfg)
    if kind in RL_KINDS and "normalize_reward" in given and cfg.algorithm.normalize_reward \
            and not cfg.model.reward_pretrain:
        notice("--normalize_reward rescales the reward model's score by the mean / std saved with it (OpenRLHF); "
               "there is no --reward_pretrain here, so it does nothing (reward functions and agents are not "
               "rescaled); a running mean / std over every reward: --running_reward_norm")


def resolve_rl_lengths(cfg, given: set) -> None:
    """RL: ``--max_len`` given is the prompt + response budget of every sample (see the module docstring);
    ``data.max_len`` is that budget in RL either way (``--prompt_max_len + --generate_max_len`` when not given, a
    budget that never binds)."""
    d = cfg.data
    if "max_len" not in given:
        d.max_len = d.prompt_max_len + d.generate_max_len
        return
    total = d.max_len
    if total < 2:
        raise ConfigError("max_len", f"--max_len is the prompt + response budget in RL (OpenRLHF); got {total}, "
                                     f"e.g. --max_len 2048")
    if "generate_max_len" in given:
        room = total - d.generate_max_len
        if room < 1:
            raise ConfigError("max_len", f"--max_len {total} leaves no prompt token beside --generate_max_len "
                                         f"{d.generate_max_len} (OpenRLHF --rollout.max_new_tokens): prompts keep "
                                         f"max_len - max_new_tokens tokens; use --max_len {d.generate_max_len + 1024} "
                                         f"or more")
        if "prompt_max_len" in given and d.prompt_max_len > room:
            raise ConfigError("prompt_max_len", f"--prompt_max_len {d.prompt_max_len} + --generate_max_len "
                                                f"{d.generate_max_len} exceeds --max_len {total}; drop "
                                                f"--prompt_max_len (it is then {room}) or lower it")
        if "prompt_max_len" not in given:
            d.prompt_max_len = room
        notice(f"--max_len {total} with --generate_max_len {d.generate_max_len}: prompts keep their last "
               f"{d.prompt_max_len} tokens (max_len - max_new_tokens, as OpenRLHF)")
        return
    # no --generate_max_len: each response may take what its prompt leaves of max_len (at least 1 token)
    if "prompt_max_len" not in given:
        d.prompt_max_len = total - 1
    d.generate_max_len = total  # an upper bound (the engines stop at max_len); OpenRLHF's overlong penalty reads
    #                             max_new_tokens or max_len (openrlhf/trainer/ppo_utils/length_penalty.py)
    notice(f"--max_len {total} without --generate_max_len: each response may take --max_len minus its prompt's "
           f"tokens (OpenRLHF's dynamic max_new_tokens); prompts keep their last {d.prompt_max_len} tokens")


def _critic_from_reward_model(cfg, given: set) -> None:
    """OpenRLHF openrlhf/cli/train_ppo_ray.py: with --advantage_estimator gae and no --critic_pretrain, the critic
    starts from the (first) reward model, its value head from the reward model's score head
    (``args.critic.model_name_or_path = args.reward.model_name_or_path.split(",")[0]``); with a remote reward it
    starts from the actor (here: --critic_pretrain's own default, --pretrain)."""
    from rlhf.algorithms import ADVANTAGE_ESTIMATORS

    m, est = cfg.model, cfg.algorithm.advantage_estimator
    spec = ADVANTAGE_ESTIMATORS.get(est)
    if "critic_pretrain" in given or m.critic_pretrain or not m.reward_pretrain or not getattr(spec, "needs_critic",
                                                                                                 False):
        return
    m.critic_pretrain = m.reward_pretrain.split(",")[0]
    notice(f"the critic starts from the reward model {m.critic_pretrain} (its value head from the reward model's "
           f"score head), as OpenRLHF when --critic_pretrain is not given; give --critic_pretrain to choose")


def _budget_without_dynamic_batch(cfg, given: set) -> None:
    if cfg.optim.use_dynamic_batch:
        return
    for flag in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu"):
        if flag in given:
            notice(f"--{flag} has no effect without --use_dynamic_batch (OpenRLHF --train.dynamic_batch_enable): "
                   f"micro-batches are --micro_train_batch_size / --micro_rollout_batch_size rows; add "
                   f"--use_dynamic_batch for token-budget micro-batches")


def _agent_partial_rollout(cfg) -> None:
    """``--partial_rollout`` (``--train.partial_rollout_enable``) with ``--agent_func_path``: OpenRLHF accepts it
    (examples/scripts/train_reinforce_baseline_ray_agent_async.sh; its async trainer pauses and resumes vLLM around
    the weight broadcast, openrlhf/trainer/ppo_trainer_async.py).  Here an agent's episode (its turns and
    environment steps) runs whole in the weights of one step and is never cut at a weight sync, so the flag has no
    effect with an agent: turned off and said so, instead of refused."""
    r = cfg.rollout
    if not (r.agent_func_path and r.partial_rollout):
        return
    r.partial_rollout, r.partial_rollout_chunk = False, None
    notice("--partial_rollout with --agent_func_path: an agent's episode runs whole (its turns and environment "
           "steps) in the weights of one step here, never cut at a weight sync, so --partial_rollout has no effect "
           "(the async queue, --async_queue_size and --vllm_generate_batch_size still apply)")


def resolve_async_colocate(cfg) -> None:
    """``--async_train --colocate_all_models``: the training models (actor, reference, critic, reward model) share
    the actor's ranks; the rollout runs on ``--vllm_num_engines x --vllm_tensor_parallel_size`` ranks of its own
    (OpenRLHF: vLLM engines get no placement group under async, the DeepSpeed models share one)."""
    t = cfg.topology
    if not (cfg.rollout.async_train and t.colocate_all_models):
        return
    if t.vllm_num_engines < 1:
        raise ConfigError("vllm_num_engines", "--async_train with --colocate_all_models colocates only the "
                                              "training models (as OpenRLHF): the rollout needs ranks of its own; "
                                              "add --vllm_num_engines 1 (or more; each takes "
                                              "--vllm_tensor_parallel_size ranks)")
    t.colocate_all_models = False
    for role in ("ref", "critic", "reward"):
        setattr(t, f"{role}_num_gpus_per_node", 0)   # 0: on the actor's ranks (rlhf.distributed.placement)
    notice("--colocate_all_models with --async_train colocates only the training models (actor, reference, "
           "critic, reward model on the actor's ranks); the rollout runs on --vllm_num_engines x "
           "--vllm_tensor_parallel_size ranks of its own (OpenRLHF: \"Using --colocate_all_models in async RLHF "
           "only colocates DeepSpeed models.\")")
