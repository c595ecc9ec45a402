"""Typed configuration, one dataclass per concern.

Every field is a command-line flag of the same name (OpenRLHF's spelling) and a
key a YAML file may set, either flat (``pretrain: ...``) or under its group
(``model: {pretrain: ...}``).  ``metadata`` carries the help text and, where the
type alone does not say it, the choices or ``nargs``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Tuple

from rlhf.config.agent_schema import AgentConfig
from rlhf.config.fields import opt  # noqa: F401  (also imported from here)
from rlhf.config.parallel_schema import ParallelConfig
from rlhf.config.teacher_schema import TeacherConfig
from rlhf.config.vision_schema import VisionConfig
from rlhf.engines.rollout_registry import engine_kinds


@dataclass
class ModelConfig:
    pretrain: Optional[str] = opt(None, "HF model dir or hub name of the actor / policy (default: the built-in tiny kit)")
    reward_pretrain: Optional[str] = opt(None, "HF dir of the sequence-classification reward model")
    value_head_prefix: Optional[str] = opt(None, "name of the reward head's weights in --reward_pretrain (OpenRLHF: "
                                                 "score or value_head; default: config.json's value_head_prefix, "
                                                 "else score)")
    critic_pretrain: Optional[str] = opt(None, "HF dir the critic is initialised from (default: with gae, the reward "
                                               "model of --reward_pretrain, as OpenRLHF; without one, --pretrain)")
    ref_pretrain: Optional[str] = opt(None, "HF dir of the reference model (default: --pretrain)")
    bf16: bool = opt(False, "train in bfloat16 mixed precision")
    flash_attn: bool = opt(False, "use flash_attention_2 (needs the [flash] extra and CUDA)")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward")
    packing_samples: bool = opt(False, "pack sequences into one row with position ids instead of padding")
    pretrain_mode: bool = opt(False, "SFT: continued pre-training, loss on every token of the plain text in "
                                     "--input_key (no chat template, no --input_template; OpenRLHF "
                                     "--pretrain_mode / --model.pretrain_mode_enable)")
    lora_rank: int = opt(0, "LoRA rank (0 = full fine-tuning)")
    lora_alpha: int = opt(16, "LoRA alpha")
    target_modules: str = opt("all-linear", "LoRA target modules (comma separated or all-linear)")
    lora_sync: str = opt("adapter", "--lora_rank: send the rollout engine the adapter (A, B, scaling; base once) "
                                   "or the merged W + s*B@A each sync", choices=("adapter", "merged"))
    load_in_4bit: bool = opt(False, "QLoRA: 4-bit (nf4) frozen base via bitsandbytes (CUDA only)")
    logprob_chunk_size: int = opt(1024, "tokens per chunk when computing log-probs (bounds the vocab-sized buffer)")
    lm_head_keep_mb: int = opt(1024, "MiB of softmax probabilities the fused LM head may keep from forward for "
                                     "backward instead of recomputing the logits (0 = always recompute)")
    lm_head_fp32: bool = opt(False, "compute the LM head's logits in float32 from the bf16 hidden states (actor, "
                                    "reference, SFT, DPO; TRL's cast_lm_head_to_fp32): log-probs without bf16 logit "
                                    "rounding (5e-3..2e-2 per token where top logits reach 10..20), for a float32 "
                                    "copy of the head weight per micro-batch and fp32 head matmuls")

    @property
    def lm_head_keep_bytes(self) -> int:
        return max(0, int(self.lm_head_keep_mb)) << 20


@dataclass
class DataConfig:
    dataset: Optional[str] = opt(None, "SFT/RM/DPO data, comma separated: .jsonl/.json/.parquet/.csv/.arrow files, "
                                       "folders (save_to_disk or data files), hub names; name@data_dir reads a folder "
                                       "inside it (OpenRLHF: openai/gsm8k@main), name:config a config")
    dataset_split: str = opt("train", "split of --dataset (OpenRLHF --dataset_split; a single file is 'train')")
    dataset_probs: Optional[str] = opt(None, "mixture weights for --dataset, comma separated")
    eval_dataset: Optional[str] = opt(None, "eval data, spelled as --dataset (default: none, eval off, as OpenRLHF; "
                                            "see --eval_holdout)")
    eval_split: str = opt("train", "split of --eval_dataset (OpenRLHF --eval_split / --eval.split)")
    prompt_data: Optional[str] = opt(None, "RL prompts, spelled as --dataset (name@data_dir, name:config; default: "
                                           "the built-in arithmetic task)")
    prompt_split: str = opt("train", "split of --prompt_data (OpenRLHF --prompt_split)")
    prompt_data_probs: Optional[str] = opt(None, "mixture weights for --prompt_data")
    input_key: str = opt("input", "key of the prompt / input text")
    output_key: str = opt("output", "key of the SFT response text")
    label_key: Optional[str] = opt(None, "key of the label passed to the reward function (default none, as OpenRLHF: "
                                         "labels are None; the built-in arithmetic reward reads 'label')")
    chosen_key: str = opt("chosen", "key of the preferred response")
    rejected_key: str = opt("rejected", "key of the rejected response")
    margin_key: str = opt("margin", "key of the per-pair reward-model margin (read with --margin_loss)")
    input_template: Optional[str] = opt(None, "template with {} applied to the prompt when no chat template is used "
                                              "(SFT defaults to OpenRLHF's; --input_template \"\" for the bare input)")
    apply_chat_template: bool = opt(False, "format prompts with the tokenizer's chat template")
    multiturn: bool = opt(False, "SFT: --input_key holds a whole conversation (chat messages); loss on every "
                                 "assistant turn (needs --apply_chat_template; OpenRLHF --multiturn)")
    max_samples: int = opt(10**9, "use at most this many samples from each data set")
    eval_holdout: float = opt(0.0, "fraction of the training rows held out for eval when no --eval_dataset is given "
                                   "(default 0: every row trains and eval is off, as OpenRLHF)")
    prompt_max_len: int = opt(1024, "max prompt tokens (longer prompts are left-truncated)")
    generate_max_len: int = opt(1024, "max new tokens per response (OpenRLHF --max_new_tokens / "
                                      "--rollout.max_new_tokens)")
    max_len: int = opt(2048, "SFT/RM/DPO: max tokens of a sample; RL (OpenRLHF --data.max_len): the prompt + "
                             "response budget of each sample, when given: with --generate_max_len prompts keep "
                             "their last max_len - generate_max_len tokens, without it each response may take "
                             "max_len minus its prompt's tokens (prompts keep max_len - 1); not given in RL: "
                             "--prompt_max_len + --generate_max_len")


@dataclass
class TopologyConfig:
    actor_num_nodes: int = opt(1, "nodes for the actor role")
    actor_num_gpus_per_node: int = opt(0, "ranks per node for the actor (0 = all ranks)")
    critic_num_nodes: int = opt(1, "nodes for the critic role")
    critic_num_gpus_per_node: int = opt(0, "ranks per node for the critic (0 = same as actor / colocated)")
    ref_num_nodes: int = opt(1, "nodes for the reference role")
    ref_num_gpus_per_node: int = opt(0, "ranks per node for the reference model (0 = same as actor / colocated)")
    reward_num_nodes: int = opt(1, "nodes for the reward-model role")
    reward_num_gpus_per_node: int = opt(0, "ranks per node for the reward model (0 = same as actor / colocated)")
    teacher_num_nodes: int = opt(1, "nodes for the teacher role (--teacher_pretrain)")
    teacher_num_gpus_per_node: int = opt(0, "ranks per node for the teacher (0 = on the actor's ranks, asleep)")
    vllm_num_engines: int = opt(0, "rollout engines (0 = one per actor rank, colocated)")
    vllm_tensor_parallel_size: int = opt(1, "tensor-parallel ranks per rollout engine")
    colocate_all_models: bool = opt(False, "all roles share the same ranks and take turns (hybrid engine); with "
                                           "--async_train only the training models share the actor's ranks and the "
                                           "rollout runs on --vllm_num_engines ranks of its own (OpenRLHF; a notice "
                                           "says so)")
    colocate_actor_ref: bool = opt(False, "reference model on the actor's ranks")
    colocate_critic_reward: bool = opt(False, "reward model on the critic's ranks")
    vllm_enable_sleep: bool = opt(False, "put the rollout engine to sleep while other roles run")
    deepspeed_enable_sleep: bool = opt(False, "offload training state while the rollout runs")
    adam_offload: bool = opt(False, "keep the optimizer state (and, fsdp2, the sharded parameters and gradients) in "
                                    "host memory; the optimizer steps on the CPU (fsdp2: CPUOffloadPolicy; deepspeed: "
                                    "ZeRO offload_optimizer, stage >= 1); apart from the sleep/wake offload between "
                                    "phases")
    backend: str = opt("fsdp2", "training backend", choices=("fsdp2", "deepspeed"))
    zero_stage: int = opt(3, "ZeRO stage (fsdp2: 3 reshards after forward, 2/1 keep params gathered)", choices=(0, 1, 2, 3), flag_type=int)
    dist_timeout_s: int = opt(1800, "timeout for collectives and weight sync, seconds")
    grad_accum_no_sync: bool = opt(False, "fsdp2: skip the gradient reduce-scatter on all but the last micro-batch of "
                                          "an optimizer step; costs full unsharded fp32 gradients on every rank "
                                          "(4 bytes x parameters; printed at start-up)")
    watchdog_timeout_s: float = opt(600.0, "end the job when a rank stays longer than this in one phase (reward, ref, "
                                    "update, sync, ...), printing every rank's phase; seconds")
    watchdog_slow_timeout_s: float = opt(1200.0, "the same deadline for generation, eval, loading, saving and the "
                                         "first run of every phase (compilation, warm-up); seconds")
    nnodes_hint: int = opt(0, "nodes in the job (0 = from torchrun/SLURM env); used to check node boundaries")
    ring_attn_size: int = opt(1, "sequence parallelism (Ulysses): ranks that split one packed sequence for training and "
                                 "the actor/critic/ref log-prob and value forwards (OpenRLHF's flag; needs "
                                 "--packing_samples, heads and each role's ranks divisible by it; groups of consecutive "
                                 "ranks inside a node; generation is not split)")
    gpu_memory_gb: Optional[float] = opt(None, "device memory per rank, GiB, for the memory plan (rlhf.plan --memory: "
                                               "default 80, an H100; the trainers' start-up check: the GPU's own; on "
                                               "CPU the check runs only when this is given; a finite number > 0)")
    skip_memory_check: bool = opt(False, "start even when the memory plan says a stage cannot fit the device "
                                         "(python -m rlhf.plan --memory prints the plan)")


@dataclass
class RolloutConfig:
    rollout_engine: str = opt("auto", "generation engine; auto = vllm on CUDA when installed, on CPU when installed and "
                                      "the model has >= ~5M parameters and a head_dim vLLM's CPU attention supports, "
                                      "else hf (measured: README, vLLM section)", choices=("auto",) + engine_kinds())
    rollout_batch_size: int = opt(8, "prompts per RL step (global)")
    micro_rollout_batch_size: int = opt(8, "samples (not prompts: as OpenRLHF) per generation / inference "
                                           "micro batch per rank (reference, old log-probs, values, reward model)")
    rollout_max_tokens_per_gpu: Optional[int] = opt(None, "--use_dynamic_batch: tokens per inference micro-batch "
                                                          "per rank (reference, old log-probs, values, reward model; "
                                                          "default: --train_max_tokens_per_gpu)")
    n_samples_per_prompt: int = opt(1, "responses sampled per prompt")
    temperature: float = opt(1.0, "sampling temperature")
    top_p: float = opt(1.0, "nucleus sampling")
    top_k: int = opt(-1, "top-k sampling (-1 = off)")
    eval_temperature: float = opt(0.6, "temperature for eval generation (0 = greedy; OpenRLHF's default 0.6)")
    eval_n_samples_per_prompt: int = opt(4, "samples per eval prompt (OpenRLHF's default 4)")
    vllm_gpu_memory_utilization: float = opt(0.5, "fraction of GPU memory vLLM may take")
    vllm_sleep_level: int = opt(2, "vLLM sleep level where a weight sync follows before the next generate (after "
                                   "the step's rollout): 2 discards the weights (no host copy), 1 copies them to host "
                                   "memory; every other sleep (start, eval, refill rounds) is level 1",
                                choices=(1, 2), flag_type=int)
    enforce_eager: bool = opt(False, "disable CUDA graphs in vLLM")
    remote_rm_url: Optional[str] = opt(None, "reward_func.py path or http(s) URL of a reward server (comma separated)")
    reward_timeout_s: float = opt(120.0, "deadline of one reward call (reward_func.py or the reward server, all tries)")
    remote_rm_retries: int = opt(2, "extra tries of a reward-server request after a connection error, timeout or 5xx "
                                    "(all within --reward_timeout_s)")
    agent_func_path: Optional[str] = opt(None, "python file defining AgentInstance / AgentExecutor for multi-turn rollouts")
    max_steps: int = opt(4, "max environment steps per agent episode")
    async_train: bool = opt(False, "rollout ranks of their own generate ahead while the actor trains (see "
                                   "--async_queue_size)")
    async_queue_size: int = opt(1, "--async_train: rollout batches generated ahead of training (K); the batch "
                                   "trained at step t was generated with the weights of step t - K")
    max_staleness: Optional[int] = opt(None, "--async_train: the oldest token a trained sample may hold, in weight "
                                             "syncs; older groups are generated again or dropped (default: the "
                                             "pipeline's own bound, K plus the steps oversampled groups wait plus "
                                             "the syncs a partial rollout spans)")
    partial_rollout: bool = opt(False, "--async_train: unfinished samples continue under the new weights after a "
                                       "sync (tokens and log-probs kept, each token's weight version recorded)")
    partial_rollout_chunk: Optional[int] = opt(None, "--partial_rollout: new tokens per generation round (default "
                                                     "--generate_max_len / 4)")
    vllm_generate_batch_size: Optional[int] = opt(None, "--async_train: prompts in flight over the engines "
                                                        "(oversampling when > --rollout_batch_size; default "
                                                        "--rollout_batch_size); extra groups wait for a later batch")


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = opt("gae", "advantage estimator: gae, reinforce, reinforce_baseline, group_norm, "
                                          "dr_grpo, rloo, flash_reinforce (reward minus the rollout batch's mean, "
                                          "no group, no whitening; OpenRLHF 0.11.2); see rlhf.algorithms.advantages")
    gamma: float = opt(1.0, "discount (rloo / group_norm / dr_grpo / reinforce_baseline use 1, as OpenRLHF: a warning says so)")
    lambd: float = opt(1.0, "GAE lambda (OpenRLHF --lambd / --algo.advantage.lambd: default 1)")
    init_kl_coef: float = opt(0.01, "initial KL coefficient (a negative value counts as 0, as OpenRLHF)")
    kl_target: Optional[float] = opt(None, "target KL for the adaptive controller (unset = fixed coefficient)")
    kl_horizon: int = opt(10000, "horizon of the adaptive KL controller")
    use_kl_loss: bool = opt(False, "KL as a loss term instead of a per-token reward penalty")
    kl_estimator: str = opt("k1", "KL estimator (values clamped to [-10, 10])", choices=("k1", "k2", "k3"))
    kl_unbiased_gradient: bool = opt(False, "KL loss: keep the estimator's value but back-propagate the "
                                            "importance-weighted reverse-KL gradient (OpenRLHF "
                                            "algo.kl.unbiased_gradient)")
    normalize_reward: bool = opt(False, "rescale the reward model's score by the mean / std saved with it "
                                        "((r - mean) / std; train_rm's reward_norm.json or OpenRLHF's config.json "
                                        "mean / std), as OpenRLHF; reward functions and agents are untouched "
                                        "(a running normalisation of every reward: --running_reward_norm)")
    running_reward_norm: bool = opt(False, "normalise every reward (reward model, reward function, agent) by a "
                                           "running mean / std over the valid rewards seen so far (not in "
                                           "OpenRLHF; what --normalize_reward did here before)")
    no_advantage_std_norm: bool = opt(False, "subtract the mean only: no std in group_norm, and no std in the global "
                                             "whitening of gae / reinforce / reinforce_baseline")
    scale_rewards: str = opt("group", "group_norm's std: the group's, the whole batch's (TRL scale_rewards=batch), or "
                                      "none", choices=("group", "batch", "none"))
    clip_eps_low: float = opt(0.2, "PPO clip lower epsilon")
    clip_eps_high: float = opt(0.2, "PPO clip upper epsilon")
    dual_clip: Optional[float] = opt(None, "dual-clip constant c > 1 (unset = off)")
    value_clip: float = opt(0.5, "value clip range")
    reward_clip_range: Optional[Tuple[float, float]] = opt((-10.0, 10.0), "clamp the shaped reward (after penalties "
                                                                          "and group baseline, before KL) to [lo, hi]",
                                                           nargs=2, flag_type=float)
    policy_loss_type: str = opt("ppo", "policy loss (gspo and sapo aggregate seq-mean-token-mean whatever "
                                       "--loss_agg_mode says)", choices=("ppo", "gspo", "cispo", "sapo"))
    sapo_tau_pos: float = opt(1.0, "SAPO gate temperature for positive advantages")
    sapo_tau_neg: float = opt(1.05, "SAPO gate temperature for negative advantages")
    loss_agg_mode: str = opt("token-mean", "loss aggregation, normalised over the whole optimizer step (all "
                                           "micro-batches and data-parallel ranks)",
                             choices=("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    entropy_loss_coef: float = opt(0.0, "entropy bonus coefficient (token-mean; negative values penalise entropy; 0 logs it only)")
    aux_loss_coef: float = opt(0.0, "MoE load-balancing loss coefficient (reads the model's aux_loss; 0 = off)")
    enable_is_correction: bool = opt(False, "importance-sampling correction for the rollout engine's vs the trainer's log-probs")
    is_correction_type: str = opt("tis", "tis: clamp w to [low, high]; icepop: drop tokens with w outside; "
                                         "seq-mask-tis: drop sequences whose geometric-mean w is outside",
                                  choices=("tis", "icepop", "seq-mask-tis"))
    is_truncated_threshold: float = opt(5.0, "upper bound (high) of the importance-weight band")
    is_truncated_threshold_low: float = opt(0.5, "lower bound (low) of the importance-weight band (0 = none)")
    is_correction_level: Optional[str] = opt(None, "OpenRLHF 0.11.2: off, or gate per token / per sequence; when set "
                                                   "it decides --enable_is_correction and, with --is_correction_mode, "
                                                   "--is_correction_type (token+clip = tis, token+mask = icepop, "
                                                   "seq+mask = seq-mask-tis)", choices=("off", "token", "seq"))
    is_correction_mode: str = opt("mask", "OpenRLHF 0.11.2: mask drops units outside the band (survivors keep their "
                                          "weight); clip clamps the token ratio (token level and ratio gating only); "
                                          "read with --is_correction_level", choices=("mask", "clip"))
    is_correction_gating: str = opt("ratio", "statistic the band gates: the IS ratio, or the sampled token's "
                                             "binary_kl / tv divergence (rollout vs trainer; upper bound only: "
                                             "--is_truncated_threshold_low 0)", choices=("ratio", "binary_kl", "tv"))
    overlong_buffer_len: int = opt(0, "overlong penalty: soft buffer length in tokens (0 = off)")
    overlong_penalty_factor: float = opt(1.0, "overlong penalty: max penalty (the penalty never goes below -factor)")
    stop_properly_penalty_coef: Optional[float] = opt(None, "ProRL: truncated samples' reward times c (c in [0, 1]) or "
                                                            "set to c (c < 0); unset = off")
    max_invalid_reward_batches: int = opt(3, "stop after this many consecutive batches whose rewards are all invalid "
                                             "(NaN / failed); 0 = never stop")
    dynamic_filtering: bool = opt(False, "drop prompt groups whose mean score is outside the range (DAPO dynamic sampling)")
    dynamic_filtering_reward_range: Tuple[float, float] = opt((0.0, 1.0), "keep groups whose mean score lies strictly "
                                                                          "inside", nargs=2, flag_type=float)
    dynamic_filtering_max_rounds: int = opt(8, "dynamic filtering: generate for more prompts, up to this many extra "
                                               "rounds per step, until --rollout_batch_size groups pass (0 = only mask "
                                               "the filtered groups; the batch shrinks)")
    beta: float = opt(0.1, "DPO beta")
    loss_type: str = opt("sigmoid", "DPO loss", choices=("sigmoid", "ipo", "hinge"))
    label_smoothing: float = opt(0.0, "conservative DPO label smoothing")
    nll_loss_coef: float = opt(0.0, "DPO: add chosen NLL times this")
    rm_loss: str = opt("sigmoid", "reward-model loss", choices=("sigmoid", "logexp"))
    margin: float = opt(0.0, "reward-model margin")
    margin_loss: bool = opt(False, "reward model: per-pair margin from the data's 'margin' column (OpenRLHF --margin_loss)")


@dataclass
class OptimConfig:
    learning_rate: float = opt(5e-6, "learning rate (SFT/RM/DPO)")
    actor_learning_rate: float = opt(1e-6, "actor learning rate")
    critic_learning_rate: float = opt(9e-6, "critic learning rate")
    adam_betas: Tuple[float, float] = opt((0.9, 0.95), "AdamW betas", nargs=2, flag_type=float)
    weight_decay: float = opt(0.0, "AdamW weight decay")
    lr_warmup_ratio: float = opt(0.03, "warmup fraction of the schedule")
    lr_scheduler: str = opt("cosine_with_min_lr", "schedule", choices=("constant", "cosine", "cosine_with_min_lr", "linear"))
    max_norm: float = opt(1.0, "gradient clipping norm")
    micro_train_batch_size: int = opt(4, "samples per forward/backward per rank")
    train_batch_size: int = opt(8, "samples per optimizer step (global)")
    use_dynamic_batch: bool = opt(False, "token-budget micro-batches: each optimizer step's rows are split over the "
                                         "data-parallel ranks with near-equal token counts, then into micro-batches "
                                         "of at most --train_max_tokens_per_gpu tokens (inference forwards: "
                                         "--rollout_max_tokens_per_gpu); replaces --micro_train_batch_size / "
                                         "--micro_rollout_batch_size as the micro-batch size (OpenRLHF "
                                         "--train.dynamic_batch_enable)")
    train_max_tokens_per_gpu: int = opt(16192, "--use_dynamic_batch: tokens per training micro-batch per rank (padded: "
                                               "rows x padded width; --packing_samples: the packed row's length); "
                                               "a longer sequence runs alone in a micro-batch, as OpenRLHF (metric "
                                               "over_budget_micro_batches); without --use_dynamic_batch a notice "
                                               "says it has no effect")
    max_epochs: int = opt(1, "SFT/RM/DPO: passes over the data; PPO: epochs over each rollout batch")
    freezing_actor_steps: int = opt(-1, "RL: train only the critic for the first N steps (the actor stays frozen "
                                        "and the rollout keeps its weights); -1 = off")
    num_episodes: int = opt(1, "RL: passes over the prompt data")
    max_global_steps: int = opt(0, "stop after this many steps (0 = run the full schedule)")
    seed: int = opt(42, "random seed")


@dataclass
class CheckpointConfig:
    save_path: str = opt("./output/model", "final HF-format model")
    ckpt_path: str = opt("./output/ckpt", "training checkpoints (global_step_N/)")
    save_steps: int = opt(-1, "save a checkpoint every N steps (-1 = off)")
    load_checkpoint: bool = opt(False, "resume from the newest intact checkpoint in --ckpt_path (none there yet: start "
                                       "from step 0, said in the log, as OpenRLHF; a damaged one: an error)")
    start_fresh_if_no_checkpoint: bool = opt(True, "with --load_checkpoint: start from step 0 when --ckpt_path holds "
                                                   "no checkpoint yet (OpenRLHF's behaviour); "
                                                   "--no_start_fresh_if_no_checkpoint refuses instead")
    save_hf_ckpt: bool = opt(False, "also write an HF model into each checkpoint")
    save_value_network: bool = opt(False, "PPO: also write the trained critic (backbone + value head) to "
                                          "<--save_path>_critic at the end")
    max_ckpt_num: int = opt(3, "keep at most this many checkpoints")
    strict_resume: bool = opt(False, "with --load_checkpoint: refuse to resume when the newest checkpoint fails its "
                                     "manifest check (default: fall back to the newest intact one, said in the log)")
    max_nonfinite_steps: int = opt(3, "stop after this many steps in a row with a NaN/inf grad norm (the optimizer "
                                      "step is skipped on each; 0 = never stop)")


@dataclass
class LoggingConfig:
    logging_steps: int = opt(1, "log metrics every N steps")
    eval_steps: int = opt(-1, "evaluate every N steps (-1 = only at the end)")
    log_dir: str = opt("./output/logs", "where metrics.jsonl (always) and TensorBoard files go")
    use_wandb: Optional[str] = opt(None, "wandb API key or 'True' to use the logged-in account / WANDB_MODE")
    wandb_org: Optional[str] = opt(None, "wandb entity")
    wandb_project: str = opt("rlhf", "wandb project")
    wandb_run_name: Optional[str] = opt(None, "wandb run name")
    use_tensorboard: Optional[str] = opt(None, "write TensorBoard events: to DIR (OpenRLHF's --use_tensorboard DIR), "
                                              "or to --log_dir/tensorboard when given alone", optional_value="True")
    progress_bar: bool = opt(True, "rank-0 progress bar with ETA")
    log_val_generations: int = opt(4, "RL eval: write N prompt/response/reward rows per eval to "
                                      "<--log_dir>/generations.jsonl, and a wandb table eval/generations with "
                                      "--use_wandb; the same rows every eval (veRL's trainer.log_val_generations; "
                                      "0 = off)")
    logprob_gap_interval: int = opt(10, "RL: where the update is one on-policy step and skips the trainer's own "
                                        "log-prob forward, run it anyway on the first step and every N steps to log "
                                        "rollout_logprob_gap (training unchanged; 0 = never); measured every step "
                                        "wherever old log-probs are computed anyway")


GROUPS = {
    "model": ModelConfig,
    "data": DataConfig,
    "topology": TopologyConfig,
    "rollout": RolloutConfig,
    "algorithm": AlgorithmConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "agent": AgentConfig,
    "parallel": ParallelConfig,
    "teacher": TeacherConfig,
    "vision": VisionConfig,
}


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def flag_index() -> dict:
    """flag name -> (group name, dataclass field)."""
    out = {}
    for gname, cls in GROUPS.items():
        for f in fields(cls):
            assert f.name not in out, f"duplicate flag {f.name}"
            out[f.name] = (gname, f)
    return out
