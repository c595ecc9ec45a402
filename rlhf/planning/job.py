"""The job a memory plan is made for (``Job``): the planner's flags, read from the flag groups once
(``job_from_flags``), with ``Job.on`` settling what depends on the machine (CUDA, vLLM installed).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

DEFAULT_GPU_GB = 80.0          # H100 80GB


@dataclass
class Job:
    """Every flag the planner reads, flat, named as the flags (so a suggestion is a set of flag values)."""
    kind: str = "rl"                      # rl | sft | rm | dpo
    bf16: bool = False
    flash_attn: bool = False
    gradient_checkpointing: bool = False
    packing_samples: bool = False
    logprob_chunk_size: int = 1024
    lm_head_keep_mb: int = 1024
    prompt_max_len: int = 1024
    rl_max_len: int = 0                   # RL: prompt + response budget (--max_len given in RL); 0 = P + R
    generate_max_len: int = 1024
    max_len: int = 2048
    backend: str = "fsdp2"
    zero_stage: int = 3
    grad_accum_no_sync: bool = False
    vllm_enable_sleep: bool = False
    deepspeed_enable_sleep: bool = False
    rollout_engine: str = "vllm"           # auto counts as vllm on CUDA (what auto picks there when installed)
    micro_rollout_batch_size: int = 8
    vllm_gpu_memory_utilization: float = 0.5
    vllm_tensor_parallel_size: int = 1
    micro_train_batch_size: int = 4
    # flags other work adds (read with defaults until they exist)
    ring_attn_size: int = 1
    use_dynamic_batch: bool = False
    train_max_tokens_per_gpu: int = 16192
    rollout_max_tokens_per_gpu: Optional[int] = None    # None: --train_max_tokens_per_gpu
    adam_offload: bool = False
    lora_rank: int = 0
    target_modules: str = "all-linear"
    tp_size: int = 1                      # --tp_size: model roles' tensor parallelism (rlhf.distributed.tensor_parallel)
    fsdp_shard_size: int = 0              # --fsdp_shard_size: HSDP shard group (0: the role's FSDP ranks)
    ep_size: int = 1                      # --ep_size: the actor's and ref's expert parallelism (expert_parallel)

    @property
    def c(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def attn(self) -> str:
        # packed rows under sdpa still get a (block-diagonal) s x s mask; flash_attention_2 runs varlen, no mask
        return "flash" if self.flash_attn else "sdpa"

    @property
    def seq(self) -> int:
        if self.kind == "rl":  # RL's --max_len bounds prompt + response (rlhf.config.openrlhf_meaning)
            total = self.prompt_max_len + self.generate_max_len
            return min(total, self.rl_max_len) if self.rl_max_len else total
        return self.max_len

    @property
    def response_len(self) -> int:
        return self.generate_max_len if self.kind == "rl" else self.max_len

    @property
    def sleeps(self) -> bool:
        return self.vllm_enable_sleep or self.deepspeed_enable_sleep

    def on(self, on_cuda: bool, vllm_installed: bool) -> Job:
        """This job with --rollout_engine auto decided as it picks on the device planned for: vllm on CUDA when
        installed (planning a GPU job: assumed), else hf."""
        if self.rollout_engine != "auto":
            return self
        return replace(self, rollout_engine="vllm" if on_cuda and vllm_installed else "hf")


def job_from_flags(kind: str, model, data, topology, rollout, optim, parallel=None) -> Job:
    """The planner's input from the five flag groups that hold its flags (rlhf.config.schema's ``ModelConfig``,
    ``DataConfig``, ``TopologyConfig``, ``RolloutConfig``, ``OptimConfig``): each ``Job`` field takes the flag of
    its name, a field no group has keeps its default.  ``kind``: ppo / grpo (both "rl"), sft, rm, dpo.
    --rollout_engine auto stays auto here; ``Job.on`` decides it where the device is known.  The one builder of
    the planner's input, called at the top (rlhf/config/preflight.py, ``python -m rlhf.plan``), as torchtitan
    builds a component from its own config there (torchtitan/config/configurable.py ``Config.build``)."""
    groups = (model, data, topology, rollout, optim) + ((parallel,) if parallel is not None else ())
    j = Job()
    for f in fields(Job):
        for grp in groups:
            if f.name != "kind" and hasattr(grp, f.name):
                setattr(j, f.name, getattr(grp, f.name))
                break
    j.kind = "rl" if kind in ("ppo", "grpo", "rl") else kind
    if j.kind == "rl":
        j.rl_max_len = int(data.max_len or 0)
    return j
