"""OpenRLHF parity, the flags: both spellings (flat 0.10 and hierarchical 0.11), OpenRLHF's defaults, the parity
flags' checks at parse time."""

import pytest

# ---- OpenRLHF's hierarchical flag spelling: --actor.model_name_or_path == --pretrain, ... ----------------------------
# OpenRLHF: openrlhf/cli/train_ppo_ray.py (0.11 dotted CLI)

FLAT = ["--pretrain", "P", "--reward_pretrain", "R", "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--micro_rollout_batch_size", "2",
        "--train_batch_size", "16", "--micro_train_batch_size", "2", "--actor_learning_rate", "3e-6",
        "--adam_betas", "0.9", "0.99", "--weight_decay", "0.01", "--max_norm", "0.5", "--lr_warmup_ratio", "0.1",
        "--init_kl_coef", "0.02", "--kl_estimator", "k3", "--use_kl_loss", "--kl_unbiased_gradient",
        "--clip_eps_low", "0.2", "--clip_eps_high", "0.28", "--dual_clip", "3", "--entropy_loss_coef", "0.001",
        "--zero_stage", "2", "--temperature", "0.9", "--top_p", "0.95", "--generate_max_len", "64",
        "--max_len", "128", "--reward_clip_range", "-5", "5", "--overlong_buffer_len", "8",
        "--stop_properly_penalty_coef", "-0.5", "--enable_is_correction", "--is_correction_type", "icepop",
        "--is_truncated_threshold_low", "0.3", "--is_truncated_threshold", "3",
        "--dynamic_filtering", "--dynamic_filtering_reward_range", "0.1", "0.9", "--no_advantage_std_norm",
        "--gamma", "1", "--lambd", "0.9", "--ckpt_path", "C", "--save_path", "S", "--load_checkpoint",
        "--save_steps", "5", "--max_ckpt_num", "2", "--logging_steps", "2", "--eval_steps", "4",
        "--wandb_project", "W", "--seed", "7", "--num_episodes", "2", "--max_epochs", "2",
        "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "1", "--colocate_all_models",
        "--vllm_gpu_memory_utilization", "0.4", "--remote_rm_url", "U", "--prompt_data", "D",
        "--input_key", "q", "--label_key", "a", "--apply_chat_template", "--lora_rank", "8",
        "--target_modules", "q_proj,v_proj", "--packing_samples", "--aux_loss_coef", "0.01"]


DOTTED = ["--actor.model_name_or_path", "P", "--reward.model_name_or_path", "R",
          "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
          "--rollout.batch_size", "8", "--rollout.micro_batch_size", "2", "--train.batch_size", "16",
          "--train.micro_batch_size", "2", "--actor.adam.lr", "3e-6", "--actor.adam.betas", "0.9", "0.99",
          "--actor.adam.weight_decay", "0.01", "--actor.max_norm", "0.5", "--actor.lr_warmup_ratio", "0.1",
          "--algo.kl.init_coef", "0.02", "--algo.kl.estimator", "k3", "--algo.kl.use_loss",
          "--algo.kl.unbiased_gradient", "--actor.eps_clip_low_high", "0.2", "0.28", "--actor.dual_clip", "3",
          "--actor.entropy_coef", "0.001", "--ds.zero_stage", "2", "--rollout.temperature", "0.9",
          "--rollout.top_p", "0.95", "--rollout.max_new_tokens", "64", "--data.max_len", "128",
          "--reward.clip_range", "-5", "5", "--reward.overlong_buffer_len", "8",
          "--reward.stop_properly_penalty_coef", "-0.5", "--algo.advantage.is_correction_enable",
          "--algo.advantage.is_correction_type", "icepop", "--algo.advantage.is_correction_threshold", "0.3", "3",
          "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.1", "0.9",
          "--algo.advantage.no_std_norm", "--algo.advantage.gamma", "1", "--algo.advantage.lambd", "0.9",
          "--ckpt.path", "C", "--ckpt.output_dir", "S", "--ckpt.load_enable", "--ckpt.save_steps", "5",
          "--ckpt.max_num", "2", "--logger.logging_steps", "2", "--eval.steps", "4",
          "--logger.wandb.project", "W", "--train.seed", "7", "--train.num_episodes", "2", "--train.max_epochs=2",
          "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "1", "--train.colocate_all",
          "--vllm.gpu_memory_utilization", "0.4", "--reward.remote_url", "U", "--data.prompt_dataset", "D",
          "--data.input_key", "q", "--data.label_key", "a", "--data.apply_chat_template", "--ds.lora.rank", "8",
          "--ds.lora.target_modules", "q_proj", "v_proj", "--ds.packing_samples", "--actor.aux_loss_coef", "0.01",
          "--actor.adam.eps", "1e-8", "--actor.optim", "adam", "--actor.muon.no_nesterov"]


def _config_fields(cfg):
    return {g: dict(v) for g, v in cfg.to_dict().items()}


def test_both_flag_spellings_give_the_same_config(capsys):
    from rlhf.config.cli import parse

    flat, dotted = parse("ppo", FLAT), parse("ppo", DOTTED)
    assert _config_fields(dotted) == _config_fields(flat)
    assert flat.optim.actor_learning_rate == 3e-6 and dotted.algorithm.is_truncated_threshold_low == 0.3
    assert dotted.model.target_modules == "q_proj,v_proj" and dotted.algorithm.clip_eps_high == 0.28
    err = capsys.readouterr().err
    assert "--actor.adam.eps has no effect here" in err and "--actor.muon.no_nesterov has no effect" in err


def test_both_spellings_in_yaml(tmp_path):
    from rlhf.config.cli import parse

    (tmp_path / "flat.yaml").write_text("pretrain: P\nactor_learning_rate: 3.0e-6\ninit_kl_coef: 0.05\n"
                                        "clip_eps_low: 0.1\nclip_eps_high: 0.1\nzero_stage: 2\nuse_kl_loss: true\n"
                                        "algorithm:\n  advantage_estimator: rloo\n"
                                        "rollout:\n  n_samples_per_prompt: 4\n")
    (tmp_path / "dotted.yaml").write_text("actor.model_name_or_path: P\nactor.adam.lr: 3.0e-6\n"
                                          "algo.kl.init_coef: 0.05\nactor.eps_clip: 0.1\nds.zero_stage: 2\n"
                                          "algo.kl.use_loss: true\nalgorithm:\n  advantage_estimator: rloo\n"
                                          "rollout.n_samples_per_prompt: 4\n")
    (tmp_path / "nested.yaml").write_text("actor:\n  model_name_or_path: P\n  adam: {lr: 3.0e-6}\n"
                                          "  eps_clip: 0.1\nalgo:\n  kl: {init_coef: 0.05, use_loss: true}\n"
                                          "  advantage: {estimator: rloo}\nds: {zero_stage: 2}\n"
                                          "rollout:\n  n_samples_per_prompt: 4\n")
    cfgs = [parse("ppo", ["--config", str(tmp_path / f"{n}.yaml")]) for n in ("flat", "dotted", "nested")]
    assert _config_fields(cfgs[0]) == _config_fields(cfgs[1]) == _config_fields(cfgs[2])
    assert cfgs[2].optim.actor_learning_rate == 3e-6 and cfgs[2].algorithm.clip_eps_high == 0.1


def test_unknown_dotted_names_fail_with_did_you_mean(tmp_path):
    import click

    from rlhf.config.cli import parse

    with pytest.raises(click.UsageError, match=r"unknown flag --algo.kl.init_cof; did you mean --algo.kl.init_coef"):
        parse("ppo", ["--algo.kl.init_cof", "0.1"])
    with pytest.raises(click.UsageError, match=r"--actor.max_norm and --critic.max_norm both set --max_norm"):
        parse("ppo", ["--actor.max_norm", "1", "--critic.max_norm", "2"])
    with pytest.raises(click.UsageError, match=r"--actor.optim muon is not supported: the Muon optimizer"):
        parse("ppo", ["--actor.optim", "muon"])
    (tmp_path / "bad.yaml").write_text("actor:\n  adam: {lrr: 1.0e-6}\n")
    with pytest.raises(click.UsageError, match=r"bad.yaml: unknown flag --actor.adam.lrr; did you mean --actor.adam.lr"):
        parse("ppo", ["--config", str(tmp_path / "bad.yaml")])
    (tmp_path / "bad2.yaml").write_text("algorithm:\n  gammma: 1.0\n")
    with pytest.raises(click.UsageError, match=r"'gammma' is not a flag of group 'algorithm'"):
        parse("ppo", ["--config", str(tmp_path / "bad2.yaml")])


# OpenRLHF flat-era names this project accepts through openrlhf_compat (issue 18) rather than as its own flags
OPENRLHF_FLAT_ERA = {
    "adam_offload", "async_queue_size", "dataset_split", "prompt_split", "attn_implementation", "best_metric_key", "compute_fp32_loss",
    "dataloader_num_workers", "deepcompile", "disable_ds_ckpt", "disable_fast_tokenizer", "ds_tensor_parallel_size",
    "ema_beta", "enable_ema", "enable_prefix_caching", "freeze_visual_encoder", "freezing_actor_steps",
    "full_determinism", "grad_accum_dtype", "gradient_checkpointing_use_reentrant", "image_key", "load_in_4bit",
    "lora_dropout", "max_ckpt_mem", "max_images_per_prompt", "multiturn", "overlap_comm", "param_dtype",
    "partial_rollout", "pretrain_mode", "prompt_key", "ref_reward_offload", "ring_attn_size", "ring_head_stride",
    "rollout_max_tokens_per_gpu", "save_value_network", "tokenizer_chat_template", "train_max_tokens_per_gpu",
    "use_ds_universal_ckpt", "use_dynamic_batch", "use_liger_kernel", "value_head_prefix", "vllm_generate_batch_size",
    "vllm_sync_backend", "vllm_sync_with_ray", "wandb_group", "zpg"}


def test_every_dotted_name_maps_to_a_known_flat_name():
    from rlhf.config.hierarchical import HIERARCHICAL, Fanout, Notice, Split, Switch
    from rlhf.config.schema import flag_index

    ours = set(flag_index())
    for dotted, e in HIERARCHICAL.items():
        targets = ([e] if isinstance(e, str) else [e.first, e.second] if isinstance(e, Split)
                   else list(e.targets) if isinstance(e, Fanout) else [e.target] if isinstance(e, Switch) else [])
        for t in targets:
            assert t in ours or t in OPENRLHF_FLAT_ERA, f"--{dotted} maps to --{t}, which is neither ours nor OpenRLHF's"
        assert "." in dotted and (isinstance(e, (str, Split, Fanout, Switch)) or isinstance(e, Notice) or e.target == "")


def test_flash_reinforce_dotted_flag():
    """--algo.advantage.estimator flash_reinforce (OpenRLHF 0.11.2 train_flash_reinforce_ray_agent_async.sh)."""
    from rlhf.config import parse

    cfg = parse("ppo", ["--algo.advantage.estimator", "flash_reinforce", "--rollout.n_samples_per_prompt", "1",
                        "--rollout.batch_size", "8", "--train.batch_size", "8"])
    assert cfg.algorithm.advantage_estimator == "flash_reinforce"


# ---- defaults and their checks: lambd 1, gamma 1, reward clip (-10, 10), lr 1e-6 / 9e-6, betas (0.9, 0.95) -----------
# OpenRLHF: openrlhf/cli/train_ppo_ray.py

@pytest.mark.parametrize("argv,msg", [
    (["--enable_is_correction", "--is_truncated_threshold_low", "2", "--is_truncated_threshold", "1"],
     "is_truncated_threshold_low < --is_truncated_threshold"),
    (["--stop_properly_penalty_coef", "2"], "--stop_properly_penalty_coef 2.0: use a factor in"),
    (["--scale_rewards", "batch", "--advantage_estimator", "rloo", "--n_samples_per_prompt", "2"],
     "--scale_rewards batch changes group_norm's std only"),
    (["--kl_unbiased_gradient"], "--kl_unbiased_gradient changes the gradient of the KL loss"),
    (["--policy_loss_type", "sapo", "--sapo_tau_neg", "0"], "--sapo_tau_pos and --sapo_tau_neg must be > 0"),
    (["--max_invalid_reward_batches", "-1"], "--max_invalid_reward_batches must be >= 0"),
])
def test_parity_flags_checked_at_parse_time(argv, msg):
    import click

    from rlhf.config.cli import parse

    with pytest.raises(click.UsageError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse("ppo", argv)


def test_ppo_defaults_match_openrlhf():
    """OpenRLHF 0.11.2 openrlhf/cli/train_ppo_ray.py (and 0.10.1's flat --lambd / --gamma): --algo.advantage.lambd 1,
    --algo.advantage.gamma 1, eps_clip 0.2, value_clip 0.5, kl init_coef 0.01, kl horizon 10000, kl estimator k1,
    reward clip (-10, 10), actor / critic lr 1e-6 / 9e-6, betas (0.9, 0.95), warmup 0.03, max_norm 1."""
    from rlhf.config import parse

    cfg = parse("ppo", [])
    a, o = cfg.algorithm, cfg.optim
    got = (a.lambd, a.gamma, a.clip_eps_low, a.clip_eps_high, a.value_clip, a.init_kl_coef, a.kl_horizon,
           a.kl_estimator, a.reward_clip_range, o.actor_learning_rate, o.critic_learning_rate, o.adam_betas,
           o.lr_warmup_ratio, o.max_norm, o.lr_scheduler)
    want = (1.0, 1.0, 0.2, 0.2, 0.5, 0.01, 10000, "k1", (-10.0, 10.0), 1e-6, 9e-6, (0.9, 0.95), 0.03, 1.0,
            "cosine_with_min_lr")
    assert got == want, f"PPO defaults differ from OpenRLHF's: got {got}, want {want}"
