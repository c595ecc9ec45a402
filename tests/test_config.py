"""YAML + flag overlay, every rejection path, --help grouping."""
import sys

import click
import pytest
from click.testing import CliRunner

from rlhf.config import ConfigError, build_config, load_yaml, make_command, parse
from rlhf.train_grpo import GRPO_DEFAULTS

SEED_FLAGS = ("pretrain reward_pretrain critic_pretrain save_path ckpt_path save_steps logging_steps eval_steps "
              "load_checkpoint save_hf_ckpt micro_train_batch_size train_batch_size micro_rollout_batch_size "
              "rollout_batch_size max_epochs prompt_max_len generate_max_len max_len zero_stage bf16 "
              "actor_learning_rate critic_learning_rate learning_rate init_kl_coef kl_target kl_horizon use_kl_loss "
              "kl_estimator normalize_reward no_advantage_std_norm advantage_estimator clip_eps_low clip_eps_high "
              "reward_clip_range n_samples_per_prompt gradient_checkpointing packing_samples flash_attn beta dataset "
              "prompt_data apply_chat_template chosen_key rejected_key label_key remote_rm_url agent_func_path "
              "async_train vllm_num_engines vllm_tensor_parallel_size vllm_gpu_memory_utilization "
              "colocate_all_models colocate_actor_ref colocate_critic_reward vllm_enable_sleep deepspeed_enable_sleep "
              "use_wandb wandb_org wandb_project").split()
SEED_FLAGS += [f"{r}_{s}" for r in ("actor", "critic", "ref", "reward") for s in ("num_nodes", "num_gpus_per_node")]


def test_every_seed_flag_exists():
    cmd = make_command("ppo", lambda cfg: None)
    names = {o for p in cmd.params for o in p.opts}
    missing = [f for f in SEED_FLAGS if f"--{f}" not in names]
    assert not missing


def test_yaml_then_flags_overlay(tmp_path):
    y = tmp_path / "r.yaml"
    y.write_text("algorithm:\n  advantage_estimator: rloo\n  init_kl_coef: 0.05\n"
                 "n_samples_per_prompt: 4\nrollout_batch_size: 8\ntrain_batch_size: 16\nbf16: true\n"
                 "reward_clip_range: [-2, 2]\n")
    cfg = parse("ppo", ["--config", str(y), "--init_kl_coef", "0.2"])
    assert cfg.algorithm.advantage_estimator == "rloo"     # from YAML (group form)
    assert cfg.rollout.n_samples_per_prompt == 4            # from YAML (flat form)
    assert cfg.model.bf16 is True
    assert cfg.algorithm.init_kl_coef == 0.2                # flag beats YAML
    assert cfg.algorithm.reward_clip_range == (-2.0, 2.0)
    assert cfg.optim.seed == 42                             # dataclass default


def test_trainer_defaults_below_yaml_and_flags(tmp_path):
    cfg = parse("grpo", ["--n_samples_per_prompt", "8"], GRPO_DEFAULTS)
    assert cfg.algorithm.advantage_estimator == "group_norm" and cfg.algorithm.use_kl_loss
    assert cfg.rollout.n_samples_per_prompt == 8
    y = tmp_path / "g.yaml"
    y.write_text("kl_estimator: k2\n")
    assert parse("grpo", ["--config", str(y)], GRPO_DEFAULTS).algorithm.kl_estimator == "k2"


@pytest.mark.parametrize("argv,needle", [
    (["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "1"], "--n_samples_per_prompt > 1"),
    (["--advantage_estimator", "grpo_typo"], "unknown"),
    (["--advantage_estimator", "rloo", "--n_samples_per_prompt", "2", "--critic_pretrain", "x"], "trains no critic"),
    (["--advantage_estimator", "reinforce", "--critic_num_gpus_per_node", "2"], "trains no critic"),
    (["--rollout_batch_size", "3", "--train_batch_size", "8"], "multiple of"),
    (["--train_batch_size", "10", "--micro_train_batch_size", "4"], "multiple of --micro_train_batch_size"),
    (["--async_train", "--colocate_all_models"], "--async_train"),
    (["--dual_clip", "0.5"], "--dual_clip must be > 1"),
    (["--reward_clip_range", "2", "1"], "lo < hi"),
    (["--prompt_data", "x.jsonl"], "no reward source"),
    (["--dynamic_filtering"], "n_samples_per_prompt > 1"),
    (["--logprob_chunk_size", "0"], "--logprob_chunk_size must be > 0"),
])
def test_rejections_name_the_flag(argv, needle):
    with pytest.raises(click.UsageError) as e:
        parse("ppo", argv)
    assert needle in str(e.value)


def test_unknown_flag_suggests(tmp_path):
    with pytest.raises(click.UsageError, match="did you mean --n_samples_per_prompt"):
        parse("ppo", ["--n_sample_per_prompt", "4"])
    y = tmp_path / "bad.yaml"
    y.write_text("actor_learning_rat: 1e-6\n")
    with pytest.raises(ConfigError, match="did you mean 'actor_learning_rate'"):
        load_yaml(str(y))
    y.write_text("model:\n  advantage_estimator: gae\n")
    with pytest.raises(ConfigError, match="not a flag of group 'model'"):
        load_yaml(str(y))
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(str(tmp_path / "nope.yaml"))


def test_bad_yaml_values():
    with pytest.raises(ConfigError, match="expects int"):
        build_config({"rollout_batch_size": "many"}, "ppo")
    with pytest.raises(ConfigError, match="must be one of"):
        build_config({"kl_estimator": "k9"}, "ppo")
    with pytest.raises(ConfigError, match="must be one of"):
        build_config({"zero_stage": 5}, "ppo")


def test_help_groups_flags_by_concern():
    out = CliRunner().invoke(make_command("ppo", lambda c: None), ["--help"], terminal_width=200).output
    for section in ("Model:", "Data:", "Topology:", "Rollout:", "Algorithm:", "Optim:", "Checkpoint:", "Logging:"):
        assert section in out
    assert out.index("Topology:") < out.index("--colocate_all_models") < out.index("Rollout:")


def test_shipped_recipes_parse():
    import glob
    import os

    files = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.yaml")))
    assert files
    for f in files:
        kind = os.path.basename(f).split("_")[0]
        kind = kind if kind in ("ppo", "grpo", "sft", "rm", "dpo") else "ppo"
        parse(kind, ["--config", f], GRPO_DEFAULTS if kind == "grpo" else None)


def test_flag_reference_in_sync():
    from rlhf.tools.flags_md import PATH, render

    with open(PATH) as fh:
        assert fh.read() == render(), "docs/FLAGS.md is stale: python -m rlhf.tools.flags_md"


def test_deepspeed_launcher_local_rank_accepted(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = parse("dpo", ["--local_rank=1", "--beta", "0.2"])
    import os

    assert cfg.algorithm.beta == 0.2 and os.environ["LOCAL_RANK"] == "1"


@pytest.mark.parametrize("rank,shown", [("0", True), ("1", False)])
def test_bad_flag_message_once_from_rank_zero(monkeypatch, capsys, rank, shown):
    """Every rank parses the same argv: the usage error is printed by rank 0 only, every rank exits 2."""
    from rlhf.config.cli import main_entry

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(sys, "argv", ["rlhf.train_sft", "--learning_rat", "1e-5"])
    with pytest.raises(SystemExit) as e:
        main_entry("sft", lambda cfg: pytest.fail("ran with a bad flag"))
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert ("unknown flag --learning_rat" in err) is shown and ("did you mean" in err) is shown, err


def test_help_still_exits_zero(monkeypatch, capsys):
    from rlhf.config.cli import main_entry

    monkeypatch.setattr(sys, "argv", ["rlhf.train_sft", "--help"])
    main_entry("sft", lambda cfg: pytest.fail("ran on --help"))
    assert "--learning_rate" in capsys.readouterr().out
