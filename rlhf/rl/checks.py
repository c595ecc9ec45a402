"""What an RL run checks before any process group exists: the placement against the backend and the flags, the
batch shapes against each role's data-parallel ranks, the prompts against one step's batch, and the watchdog's
bytes-scaled load/save deadlines; each refusal an ``InputError`` naming the flag and a value that works.

Every function takes the config groups or values it reads (``rlhf.config.schema``), never the whole config.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

from rlhf.data.formatting import build_prompts, format_prompt, row_tools
from rlhf.data.loading import load_train_eval
from rlhf.errors import InputError
from rlhf.utils.cadence import planned_steps


def load_prompt_sets(d, seed: int, tokenizer, kit_dir: Optional[str], tools: Optional[list] = None,
                     images=None):
    """(training prompts, eval prompts, eval prompt -> datasource) from the data flags ``d`` (``DataConfig``), the
    built-in kit's files when ``kit_dir`` is given; ``seed`` (--seed) draws the --eval_holdout rows."""
    kit = None if kit_dir is None else tuple(os.path.join(kit_dir, "data", f"prompts_{s}.jsonl") for s in ("train", "eval"))
    rows, ev = load_train_eval(d, {"input_key": d.input_key, "label_key": d.label_key}, d.prompt_data,
                               d.prompt_data_probs, kit, "--prompt_data is required with --pretrain (the built-in task "
                               "comes with the built-in kit); e.g. --prompt_data prompts.jsonl --input_key input "
                               "--label_key label", seed)
    return (build_prompts(rows, tokenizer, d, tools, images), build_prompts(ev, tokenizer, d, tools, images),
            datasources(ev, tokenizer, d, tools))


def datasources(rows, tokenizer, d, tools: Optional[list] = None) -> dict:
    """Formatted prompt text -> its row's ``datasource`` (rows without one: none, read as "default"): OpenRLHF's
    ``prompt_to_datasource`` (openrlhf/trainer/ppo_trainer.py compute_eval_metrics), which keys pass@k by source."""
    return {format_prompt(r[d.input_key], tokenizer, d.apply_chat_template, d.input_template, row_tools(r, tools)):
            str(r["datasource"])
            for r in rows if r.get("datasource") is not None}


def io_deadlines(m, path: str, plan, nodes: int, floor_s: float) -> dict:
    """The watchdog's "load" and "save" deadlines from the bytes they move (launch/sbatch.py ``io_deadlines_s``):
    a 70B actor + critic write ~2 TB per checkpoint and read it back for the manifest's hashes, far past a fixed
    --watchdog_slow_timeout_s (the floor).  Sizes from each model's config.json (or the size in its name); ``m``: the
    model flags (``ModelConfig``), ``path``: the resolved --pretrain."""
    from launch.sbatch import io_deadlines_s, model_params

    def size(p):
        return (model_params(p)[0] or 0) if p else 0

    actor = size(path)
    critic = size(m.critic_pretrain or path) if plan.ranks.get("critic") else 0
    ref = size(m.ref_pretrain or path) if plan.ranks.get("ref") else 0
    reward = size(m.reward_pretrain) if plan.ranks.get("reward") else 0
    return io_deadlines_s(actor + critic, actor + critic + ref + reward, nodes, floor_s)


def check_backend_placement(backend: str, plan) -> None:
    """--backend deepspeed needs every model role on every rank: ZeRO's set-up runs a world-wide barrier
    (deepspeed/runtime/zero/stage3.py ``_setup_for_real_optimizer``), so a role on ranks of its own would hang
    there.  Checked before any process group exists."""
    if backend != "deepspeed":
        return
    world = list(range(plan.world_size))
    partial = [r for r in ("actor", "ref", "critic", "reward") if plan.ranks.get(r) and plan.ranks[r] != world]
    if partial:
        raise InputError(f"--backend deepspeed needs every model role on every rank, but {', '.join(partial)} "
                         f"sit on ranks of their own in this placement (DeepSpeed's ZeRO set-up waits on the whole "
                         f"job): use --colocate_all_models (and no --vllm_num_engines ranks of their own), or "
                         f"--backend fsdp2 for roles on ranks of their own")


def check_batch_sizes(o, samples: int, plan) -> None:
    """Batch shapes the roles' engines need, checked against the placement before any process group: ``o`` the
    optimizer flags (``OptimConfig``), ``samples`` one step's rows (--rollout_batch_size x --n_samples_per_prompt)."""
    for role in ("actor", "critic"):
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


def check_async_placement(async_train: bool, plan) -> None:
    """--async_train generates on ranks of their own while the trainer ranks train."""
    if async_train and not plan.separate_rollout:
        raise InputError("--async_train needs rollout ranks of their own: set --vllm_num_engines > 0 and give "
                         "the job those extra ranks")


def plan_steps(n_prompts: int, n_eval: int, rb: int, d, optim) -> Tuple[int, int, List[str]]:
    """(steps per episode, steps of the run, the notes that say so): an episode is ``n_prompts // rb`` steps of
    --rollout_batch_size ``rb`` prompts, the run --num_episodes of them capped by --max_global_steps (``optim``);
    fewer prompts than one step's is refused (``d``: the data flags, for the --eval_holdout hint)."""
    if n_prompts < rb:
        raise InputError(f"{n_prompts} training prompts is fewer than --rollout_batch_size {rb} (one "
                         f"step's prompts): use --rollout_batch_size {n_prompts} or fewer, or more data"
                         + (f" (--eval_holdout {d.eval_holdout} held out {n_eval} for eval)"
                            if d.prompt_data and not d.eval_dataset and d.eval_holdout
                            else ""))
    per_episode = n_prompts // rb
    total, capped = planned_steps(per_episode, optim.num_episodes, optim.max_global_steps, "--num_episodes")
    left = n_prompts - per_episode * rb
    notes = [f"[data] {n_prompts} training prompts -> {per_episode} steps per episode of "
             f"--rollout_batch_size {rb}" + (f" ({left} prompts of each shuffled episode are left out)" if left
                                              else "") + f"; {n_eval} eval prompts"
             + ("" if n_eval else " (eval off)")] + ([capped] if capped else [])
    return per_episode, total, notes
