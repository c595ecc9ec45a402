"""Render sbatch scripts (the ones shipped in slurm/ are rendered from here; a test keeps them in sync).

    python -m launch.sbatch --name my-ppo --nodes 2 --gpus_per_node 8 --time 24:00:00 -- \
        rlhf.train_ppo --config configs/ppo_llama3_8b.yaml > my_job.sh
    python -m launch.sbatch --write_shipped        # regenerate slurm/*.sh
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import click

from .env import shell_join

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- preemption lead time: how long before the time limit / on preemption SLURM sends USR1 -------------------------
# The rule (README "## SLURM"): the trainers finish the step they are in, then write a sharded checkpoint, so
#   lead = max(LEAD_FLOOR_S, LEAD_MARGIN * (step_s + save_s))
#   save_s = bytes each node writes / FS_WRITE_GBPS + the same bytes read back for the manifest's hashes / HASH_GBPS;
#            bytes = sum over trained models of params * CKPT_BYTES_PER_PARAM (bf16 weights 2 + fp32 master 4 +
#            Adam m and v 8), spread over the nodes (every rank writes its shard)
#   step_s = FLOPs of one step / (GPUs * effective TFLOP/s per GPU); FLOPs = tokens per step * (k * params of each
#            trained model + 2 * params of each frozen one), k = 6 (forward + backward) for SFT/RM/DPO and 8 for RL
#            (the extra forward for old log-probs / values); RL's effective rate is lower: generation is memory-bound
LEAD_FLOOR_S = 300            # SLURM's usual grace; what the scripts used before the rule
LEAD_MARGIN = 1.5             # a step and a save that run long (a slow straggler, a busy filesystem)
CKPT_BYTES_PER_PARAM = 14     # bf16 weights + fp32 master weights + fp32 Adam exp_avg + exp_avg_sq
FS_WRITE_GBPS = 1.0           # GB/s one node sustains to the shared checkpoint filesystem (a busy Lustre / NFS)
RL_TFLOPS_PER_GPU = 50.0      # effective TFLOP/s of an RL step with generation (~5% of an H100/H200's bf16 peak)
TRAIN_TFLOPS_PER_GPU = 200.0  # effective TFLOP/s of a supervised step (~20% of the bf16 peak, gradient checkpointing)
# After writing, every rank reads its share of the checkpoint back to hash it into manifest.json
# (rlhf/checkpoint/save.py save_checkpoint): a save costs the write and that read-back; a resume's verification
# (pick_checkpoint) has rank 0 hash the whole checkpoint.
HASH_GBPS = 1.0               # GB/s of the read-back + hash (blake2b ~1 GB/s on one core; xxh3 is faster, the FS not)
FS_READ_GBPS = 1.0            # GB/s one node reads from the shared filesystem (weights at start-up, a resume)
WEIGHT_BYTES_PER_PARAM = 4    # HF weights read at start-up: fp32 at worst (bf16 files are half)
IO_MARGIN = 2.0               # the watchdog's load/save deadlines: twice the estimate (a busy filesystem)
_SIZE_IN_NAME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*[bB](?![a-zA-Z])")


def params_from_hf_config(cfg: Dict) -> int:
    """Parameters of a Llama/Qwen2/Mistral-shaped decoder from its config.json fields (embeddings, attention with
    grouped KV heads, gated MLP; norms and biases are noise at this scale)."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    inter = cfg.get("intermediate_size", 4 * h)
    heads = cfg.get("num_attention_heads", max(1, h // 128))
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return int(layers * (attn + 3 * h * inter) + embed)


def _config_json(model: str) -> Optional[str]:
    """config.json of a local model folder, or of a hub name in the local HF cache; None if not on this machine."""
    if os.path.isfile(os.path.join(model, "config.json")):
        return os.path.join(model, "config.json")
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(os.environ.get("HF_HOME", os.path.expanduser(
        "~/.cache/huggingface")), "hub")
    snaps = os.path.join(hub, "models--" + model.replace("/", "--"), "snapshots")
    if os.path.isdir(snaps):
        for snap in sorted(os.listdir(snaps)):
            if os.path.isfile(os.path.join(snaps, snap, "config.json")):
                return os.path.join(snaps, snap, "config.json")
    return None


def model_params(model: Optional[str]) -> Tuple[Optional[int], str]:
    """(parameter count, where it came from): the model's config.json when readable here, else the size in its
    name ("Llama-3-70B" -> 70e9), else (None, why)."""
    if not model:
        return None, "no --pretrain (the built-in tiny model)"
    path = _config_json(model)
    if path:
        try:
            with open(path) as fh:
                return params_from_hf_config(json.load(fh)), path
        except (OSError, ValueError, KeyError) as e:
            return None, f"{path}: {e}"
    m = _SIZE_IN_NAME.search(os.path.basename(model.rstrip("/")))
    if m:
        return int(float(m.group(1)) * 1e9), f"the name {model!r}"
    return None, f"{model!r} (no config.json here, no size in the name)"


def _recipe(args: List[str]) -> Dict:
    """The recipe's flat settings (YAML sections flattened) with the job's flags after it overriding."""
    import yaml

    out: Dict = {}
    if args[:1] == ["--config"]:
        path = args[1] if os.path.isabs(args[1]) else os.path.join(ROOT, args[1])
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
        for k, v in data.items():
            out.update(v if isinstance(v, dict) else {k: v})
        args = args[2:]
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else True
            out[a[2:]] = nxt
    return out


@dataclass
class Estimate:
    """One step's and one save's seconds for a recipe by the rule above (``estimate``)."""
    step_s: float
    save_s: float
    params: int
    source: str
    ckpt_bytes: float
    rl: bool


def estimate(module: str, args: List[str], nodes: int, gpus_per_node: int) -> Tuple[Optional[Estimate], str]:
    """(the estimate, "") from the trainer module and its recipe, or (None, why) when no model size is known."""
    cfg = _recipe(args)
    kind = module.rsplit(".", 1)[-1].replace("train_", "")
    n, src = model_params(cfg.get("pretrain"))
    if n is None:
        return None, src
    sizes = {}
    for key in ("critic_pretrain", "reward_pretrain"):
        if cfg.get(key):
            sizes[key] = model_params(cfg[key])[0] or n
    rl = kind in ("ppo", "grpo", "rloo", "reinforce")
    trained = [n] + ([sizes.get("critic_pretrain", n)] if kind == "ppo" else [])
    frozen = ([n] if (not rl and kind == "dpo") or (rl and float(cfg.get("init_kl_coef", 0.01) or 0) > 0) else [])
    frozen += [sizes["reward_pretrain"]] if rl and "reward_pretrain" in sizes else []
    if rl:
        tokens = (int(cfg.get("rollout_batch_size", 8)) * int(cfg.get("n_samples_per_prompt", 1))
                  * (int(cfg.get("prompt_max_len", 1024)) + int(cfg.get("generate_max_len", 1024))))
    else:
        tokens = int(cfg.get("train_batch_size", 8)) * int(cfg.get("max_len", 2048)) * (2 if kind in ("dpo", "rm")
                                                                                           else 1)
    gpus = max(1, nodes * gpus_per_node)
    k, rate = (8, RL_TFLOPS_PER_GPU) if rl else (6, TRAIN_TFLOPS_PER_GPU)
    step_s = tokens * (k * sum(trained) + 2 * sum(frozen)) / (gpus * rate * 1e12)
    ckpt_bytes = sum(trained) * CKPT_BYTES_PER_PARAM
    return Estimate(step_s, save_seconds(ckpt_bytes, nodes), n, src, ckpt_bytes, rl), ""


def save_seconds(ckpt_bytes: float, nodes: int) -> float:
    """One checkpoint save: each node writes its share, then reads it back for the manifest's hashes."""
    share = ckpt_bytes / max(1, nodes)
    return share / (FS_WRITE_GBPS * 1e9) + share / (HASH_GBPS * 1e9)


def io_deadlines_s(trained_params: int, all_params: int, nodes: int, floor_s: float) -> Dict[str, float]:
    """The watchdog's deadlines for the "load" and "save" phases: IO_MARGIN x the seconds their bytes take, never
    below ``floor_s`` (--watchdog_slow_timeout_s).  save: ``save_seconds`` of the trained models' checkpoint;
    load: the larger of reading every model's weights at start-up (a node's source rank reads whole models) and a
    resume (each node reads its share of the checkpoint; rank 0 first hashes the whole of it)."""
    ckpt = trained_params * CKPT_BYTES_PER_PARAM
    startup = all_params * WEIGHT_BYTES_PER_PARAM / (FS_READ_GBPS * 1e9)
    resume = ckpt / max(1, nodes) / (FS_READ_GBPS * 1e9) + ckpt / (HASH_GBPS * 1e9)
    return {"load": max(floor_s, IO_MARGIN * max(startup, resume)),
            "save": max(floor_s, IO_MARGIN * save_seconds(ckpt, nodes))}


def signal_lead_s(module: str, args: List[str], nodes: int, gpus_per_node: int) -> Tuple[int, str]:
    """(seconds of notice USR1 gives before the time limit, the sum that gave it) by the rule above, from the
    trainer module and its recipe.  Falls back to LEAD_FLOOR_S, saying why, when no model size is known."""
    e, why_not = estimate(module, args, nodes, gpus_per_node)
    if e is None:
        return LEAD_FLOOR_S, f"floor {LEAD_FLOOR_S}s: model size unknown from {why_not}; pass --signal_lead_s"
    lead = max(LEAD_FLOOR_S, int(math.ceil(LEAD_MARGIN * (e.step_s + e.save_s) / 60.0)) * 60)
    why = (f"{LEAD_MARGIN} x (step ~{e.step_s:.0f}s + save ~{e.save_s:.0f}s) rounded up to minutes, floor "
           f"{LEAD_FLOOR_S}s; {e.params / 1e9:.1f}B params from {e.source}; {e.ckpt_bytes / 1e9:.0f} GB "
           f"of checkpoint over {nodes} node(s) at {FS_WRITE_GBPS:g} GB/s each, read back for its hashes at "
           f"{HASH_GBPS:g} GB/s")
    return lead, why


# ---- stop signals with a deadline: torchrun's grace after it forwards SIGTERM ------------------------------------
# torchrun SIGKILLs its ranks --shutdown_timeout seconds after forwarding a TERM (30 s by default; the env variable
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets it, torch/distributed/launcher/api.py).  A TERM cuts an RL step after its
# generation / reward phases (rlhf/rl/trainer.py CUT_STAGES); what may still be running is the update
# (UPDATE_SHARE of a step; a whole step for supervised trainers, which cut nothing), then the save:
#   grace = max(GRACE_FLOOR_S, LEAD_MARGIN * (share * step_s + save_s)) rounded up to minutes
GRACE_FLOOR_S = 60
UPDATE_SHARE = 0.5  # an RL step's phases after generation and reward (ref/old log-probs, update, weight sync)


def shutdown_timeout_s(module: str, args: List[str], nodes: int, gpus_per_node: int) -> Tuple[int, str]:
    """(torchrun's grace after a TERM, the sum that gave it); GRACE_FLOOR_S when no model size is known."""
    e, why_not = estimate(module, args, nodes, gpus_per_node)
    if e is None:
        return GRACE_FLOOR_S, f"floor {GRACE_FLOOR_S}s: model size unknown from {why_not}"
    share = UPDATE_SHARE if e.rl else 1.0
    grace = max(GRACE_FLOOR_S, int(math.ceil(LEAD_MARGIN * (share * e.step_s + e.save_s) / 60.0)) * 60)
    return grace, (f"{LEAD_MARGIN} x ({share:g} x step ~{e.step_s:.0f}s + save ~{e.save_s:.0f}s) rounded up to "
                   f"minutes, floor {GRACE_FLOOR_S}s")


@dataclass
class Job:
    name: str
    module: str
    args: List[str]
    nodes: int = 1
    gpus_per_node: int = 8
    cpus_per_task: int = 64
    time: str = "24:00:00"
    partition: Optional[str] = None
    mem: Optional[str] = None
    cpu_only: bool = False
    extra: List[str] = field(default_factory=list)
    signal_lead_s: int = 0        # 0: by the rule (signal_lead_s()); else seconds, as given
    notes: List[str] = field(default_factory=list)  # comment lines for the reader (e.g. where the data comes from)

    def lead(self) -> Tuple[int, str]:
        if self.signal_lead_s > 0:
            return self.signal_lead_s, "--signal_lead_s, as given"
        return signal_lead_s(self.module, self.args, self.nodes, self.gpus_per_node)


def time_limit_s(time: str) -> int:
    """SLURM's --time ("D-HH:MM:SS", "HH:MM:SS", "MM:SS" or minutes) in seconds."""
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if len(parts) == 1:
        parts = [0, parts[0], 0]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, sec = parts
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + sec


def render(job: Job) -> str:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job.name}", f"#SBATCH --nodes={job.nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --cpus-per-task={job.cpus_per_task}"]
    if not job.cpu_only:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.mem:
        lines.append(f"#SBATCH --mem={job.mem}")
    if job.partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    lead, why = job.lead()
    if lead * 2 > time_limit_s(job.time):
        raise click.UsageError(f"the preemption notice of {lead}s ({why}) is over half of --time {job.time}: give "
                               f"a longer --time, or a smaller --signal_lead_s if steps and saves are faster")
    lines += [f"#SBATCH --time={job.time}", "#SBATCH --output=%x-%j.out", "#SBATCH --open-mode=append",
              f"#SBATCH --signal=B:USR1@{lead}", "#SBATCH --requeue", *[f"#SBATCH {e}" for e in job.extra], "",
              f"# {job.name}: {job.nodes} node(s) x {job.gpus_per_node} ranks. Extra flags after the script name",
              "# override the config, e.g.  sbatch slurm/<this>.sh --actor_learning_rate 1e-6",
              f"# USR1 {lead}s before the time limit (finish the step, save, requeue): {why}",
              *[f"# {n}" for n in job.notes],
              f"export RLHF_SIGNAL_LEAD_S={lead}",
              ]
    grace, grace_why = shutdown_timeout_s(job.module, job.args, job.nodes, job.gpus_per_node)
    lines += [f"# TERM (scancel, a preemption): torchrun gives the ranks {grace}s to save before SIGKILL ({grace_why});",
              f"# SLURM kills after its KillWait (slurm.conf, often 30 s): ask for KillWait >= {grace + 30}s, or stop "
              f"with",
              "# `scancel --signal=USR1 --batch <job>` (no deadline: finish the step, save, requeue)",
              f'export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{grace}}}"']
    if job.cpu_only:
        lines.append(f"export GPUS_PER_NODE=${{GPUS_PER_NODE:-{job.gpus_per_node}}}")
    lines.append('source "${RLHF_HOME:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"')
    args = list(job.args)
    cfg = ""
    if args[:1] == ["--config"]:  # recipes are found in the checkout, wherever the job runs
        cfg = f'--config "$RLHF_HOME/{args[1]}" '
        args = args[2:]
    rest = (shell_join(args) + " ") if args else ""
    # the first start has no checkpoint yet: allowed (and said), a requeued one resumes
    lines.append(f'rlhf_run {job.module} {cfg}{rest}--load_checkpoint --start_fresh_if_no_checkpoint "$@"')
    return "\n".join(lines) + "\n"


GSM8K_NOTES = ["Data: the config's openai/gsm8k@main ('@' names a data_dir, as in OpenRLHF: gsm8k has the configs main "
               "and", "socratic and no default). Nodes without internet read the HF cache: fill it once where there "
               "is internet with",
               "  python -c \"import datasets; datasets.load_dataset('openai/gsm8k', data_dir='main')\""]

SHIPPED = {
    "ppo_70b.sh": Job("ppo-70b", "rlhf.train_ppo", ["--config", "configs/ppo_llama3_70b_hybrid.yaml"], nodes=4,
                      time="48:00:00"),
    "ppo_8b.sh": Job("ppo-8b", "rlhf.train_ppo", ["--config", "configs/ppo_llama3_8b.yaml"]),
    "grpo_7b.sh": Job("grpo-7b", "rlhf.train_grpo", ["--config", "configs/grpo_qwen2.5_7b_math.yaml"],
                      notes=GSM8K_NOTES),
    "grpo_7b_async.sh": Job("grpo-7b-async", "rlhf.train_grpo", ["--config", "configs/grpo_qwen2.5_7b_async.yaml"],
                            notes=GSM8K_NOTES),
    "dpo_8b.sh": Job("dpo-8b", "rlhf.train_dpo", ["--config", "configs/dpo_llama3_8b.yaml"], time="12:00:00"),
    "rm_8b.sh": Job("rm-8b", "rlhf.train_rm", ["--config", "configs/rm_llama3_8b.yaml"], time="12:00:00"),
    "tiny_cpu.sh": Job("tiny-cpu", "rlhf.train_sft",
                       ["--config", "configs/sft_tiny.yaml", "--save_steps", "20", "--max_global_steps", "40"],
                       gpus_per_node=2, cpus_per_task=2, time="00:20:00", cpu_only=True),
}


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--name", default="rlhf")
@click.option("--nodes", default=1, show_default=True)
@click.option("--gpus_per_node", default=8, show_default=True)
@click.option("--cpus_per_task", default=64, show_default=True)
@click.option("--time", "time_", default="24:00:00", show_default=True)
@click.option("--partition", default=None)
@click.option("--signal_lead_s", default=0, show_default=True,
              help="seconds of notice (USR1) before the time limit to finish the step and save; 0 = from the model "
                   "size and recipe (see README, SLURM)")
@click.option("--write_shipped", is_flag=True, help="regenerate slurm/*.sh")
@click.argument("trainer", nargs=-1, type=click.UNPROCESSED)
def main(name, nodes, gpus_per_node, cpus_per_task, time_, partition, signal_lead_s, write_shipped, trainer):
    if write_shipped:
        for fname, job in SHIPPED.items():
            path = os.path.join(ROOT, "slurm", fname)
            with open(path, "w") as fh:
                fh.write(render(job))
            os.chmod(path, 0o755)
        return
    if not trainer:
        raise click.UsageError("give the trainer after --, e.g. -- rlhf.train_ppo --config configs/x.yaml")
    module, *args = trainer
    click.echo(render(Job(name, module, list(args), nodes, gpus_per_node, cpus_per_task, time_, partition,
                          signal_lead_s=signal_lead_s)), nl=False)


if __name__ == "__main__":
    main()
