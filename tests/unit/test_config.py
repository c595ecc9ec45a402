"""YAML + flag overlay, every rejection path, --help grouping."""
import json
import os
import shlex
import sys

import click
import pytest
from click.testing import CliRunner
from helpers.tasks import make_task

from rlhf.config import ConfigError, build_config, load_yaml, make_command, parse
from rlhf.config.openrlhf_compat import COMPAT, active, translate
from rlhf.config.preflight import preflight
from rlhf.config.schema import flag_index
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

    files = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "*.yaml")))
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


# ---- issue 18, config side (from tests/test_silent_config.py): strict values, flags that must be > 0,
# OpenRLHF's own commands, preflight checks
# OpenRLHF README, "PPO/REINFORCE++ with Ray and vLLM", last flat-CLI version (before the 2026-04 dotted CLI),
# everything after `-- python3 -m openrlhf.cli.train_ppo_ray`
README_PPO = r"""
   --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
   --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
   --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5
   --pretrain OpenRLHF/Llama-3-8b-sft-mixture --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k
   --save_path /openrlhf/examples/test_scripts/final/llama3-8b-rlhf
   --ckpt_path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf
   --save_hf_ckpt --train_batch_size 128 --rollout_batch_size 1024 --use_dynamic_batch --n_samples_per_prompt 1
   --max_epochs 1 --prompt_max_len 1024 --max_samples 100000 --generate_max_len 1024 --zero_stage 3
   --param_dtype bf16 --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01
   --prompt_data OpenRLHF/prompt-collection-v0.1 --input_key context_messages --apply_chat_template
   --normalize_reward --gradient_checkpointing --packing_samples --vllm_sync_backend nccl --enforce_eager
   --vllm_enable_sleep --deepspeed_enable_sleep --use_wandb {wandb_token}
"""
# the same section in 2025-04 (before "single controller"): --bf16 and explicit micro batch sizes
README_PPO_2025 = r"""
   --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
   --critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
   --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5
   --pretrain OpenRLHF/Llama-3-8b-sft-mixture --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k
   --save_path /openrlhf/final --ckpt_path /openrlhf/ckpt --save_hf_ckpt --micro_train_batch_size 8
   --train_batch_size 128 --micro_rollout_batch_size 16 --rollout_batch_size 1024 --n_samples_per_prompt 1
   --max_epochs 1 --prompt_max_len 1024 --max_samples 100000 --generate_max_len 1024 --zero_stage 3 --bf16
   --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --init_kl_coef 0.01
   --prompt_data OpenRLHF/prompt-collection-v0.1 --input_key context_messages --apply_chat_template
   --normalize_reward --gradient_checkpointing --packing_samples --vllm_sync_backend nccl --enforce_eager
   --vllm_enable_sleep --deepspeed_enable_sleep --use_wandb {wandb_token}
"""
# every flag issue 18 found unknown, at an OpenRLHF value
ISSUE_FLAGS = ("--vllm_sync_backend nccl --adam_offload --ref_reward_offload --disable_ds_ckpt --l2 0.01 "
               "--eps_clip 0.25 --ptx_coef 0.05 --aux_loss_coef 0 --max_ckpt_mem 1000 --wandb_group g "
               "--value_head_prefix score --use_liger_kernel --ring_attn_size 1 --enable_prefix_caching "
               "--full_determinism --zpg 1 --overlap_comm --disable_fast_tokenizer --ds_tensor_parallel_size 1 "
               "--freezing_actor_steps -1 --prompt_split train --use_tensorboard /tmp/tb_dir")


def test_openrlhf_readme_ppo_command_parses(capsys):
    cfg = parse("ppo", shlex.split(README_PPO))
    assert (cfg.rollout.rollout_batch_size, cfg.optim.train_batch_size, cfg.rollout.n_samples_per_prompt) == \
        (1024, 128, 1)
    assert cfg.model.bf16 is True, "--param_dtype bf16 must turn on --bf16"
    assert cfg.model.pretrain == "OpenRLHF/Llama-3-8b-sft-mixture"
    assert cfg.data.input_key == "context_messages" and cfg.data.apply_chat_template
    assert cfg.topology.colocate_all_models and cfg.topology.vllm_num_engines == 4
    assert cfg.optim.actor_learning_rate == 5e-7 and cfg.algorithm.init_kl_coef == 0.01
    assert cfg.logging.use_wandb == "{wandb_token}"
    err = capsys.readouterr().err
    assert cfg.optim.use_dynamic_batch, "--use_dynamic_batch is a flag of ours (token-budget micro-batches)"
    for flag in ("--vllm_sync_backend nccl has no effect here", "--param_dtype bf16 -> --bf16"):
        assert flag in err, f"no notice for {flag!r} in:\n{err}"
    old = parse("ppo", shlex.split(README_PPO_2025))
    assert old.model.bf16 and old.optim.micro_train_batch_size == 8 and old.rollout.micro_rollout_batch_size == 16


def test_issue_flags_parse_and_map(capsys):
    cfg = parse("ppo", shlex.split(ISSUE_FLAGS))
    assert cfg.algorithm.clip_eps_low == cfg.algorithm.clip_eps_high == 0.25, "--eps_clip"
    assert cfg.optim.weight_decay == 0.01, "--l2"
    assert cfg.logging.use_tensorboard == "/tmp/tb_dir"
    err = capsys.readouterr().err
    assert cfg.model.value_head_prefix == "score"
    real = flag_index()
    silent = [f for f in ISSUE_FLAGS.split() if f.startswith("--") and f[2:] not in real
              and f"[openrlhf] {f}" not in err]
    assert not silent, f"compat flags without a notice: {silent}"
    assert parse("ppo", ["--use_tensorboard"]).logging.use_tensorboard == "True"  # alone: log_dir/tensorboard
    cfg = parse("ppo", ["--eps_clip_low_high", "0.2", "0.28"])
    assert (cfg.algorithm.clip_eps_low, cfg.algorithm.clip_eps_high) == (0.2, 0.28)


@pytest.mark.parametrize("argv,needle", [
    (["--pretrain_data", "x"], "--pretrain_data x is not supported: PPO-ptx"),
    (["--ring_attn_size", "2"], "--ring_attn_size 2 is not supported"),
    (["--aux_loss_coef", "0.01"], "MoE load-balancing loss"),
    (["--param_dtype", "fp16"], "only bf16"),
    (["--eps_clip", "0.3", "--clip_eps_low", "0.2"], "keep one of them"),
    (["--prompt_split", "test"], "name@test"),
])
def test_compat_rejections(argv, needle):
    if argv[0][2:] in flag_index():
        pytest.skip(f"{argv[0]} became a real flag (implemented): the compat entry no longer applies")
    with pytest.raises(click.UsageError) as e:
        parse("ppo", argv)
    assert needle in str(e.value)


def test_compat_table_is_complete_and_yaml_reads_it(tmp_path):
    index = flag_index()
    for name, c in COMPAT.items():
        assert c.kind in ("alias", "noop", "unsupported"), name
        assert c.why or c.kind == "alias", f"{name}: a no-effect / unsupported flag needs its reason"
    # every OpenRLHF flat-era flag named in the issue is either ours or in the table
    for f in ISSUE_FLAGS.split():
        if f.startswith("--"):
            assert f[2:] in index or f[2:] in active(index), f
    y = tmp_path / "o.yaml"
    y.write_text("eps_clip: 0.3\nl2: 0.1\nvllm_sync_backend: nccl\n")
    cfg = parse("ppo", ["--config", str(y)])
    assert cfg.algorithm.clip_eps_high == 0.3 and cfg.optim.weight_decay == 0.1
    out, notes = translate({"vllm_sync_backend": "gloo", "seed": 1}, index)
    assert out == {"seed": 1} and len(notes) == 1 and "no effect" in notes[0]


@pytest.mark.parametrize("values,needle", [
    ({"n_samples_per_prompt": 4.9}, "expects int, got 4.9"),
    ({"train_batch_size": 32.5}, "expects int, got 32.5"),
    ({"n_samples_per_prompt": "4.9"}, "expects int"),
    ({"bf16": "Ture"}, "--bf16 is a switch: give true or false, got 'Ture'"),
    ({"bf16": 2}, "is a switch"),
    ({"rollout_batch_size": True}, "boolean"),
    ({"init_kl_coef": "lots"}, "expects float"),
    ({"adam_betas": [0.9, "x"]}, "expects float"),
])
def test_strict_yaml_coercion(values, needle):
    with pytest.raises(ConfigError) as e:
        build_config(values, "ppo")
    assert needle in str(e.value)


def test_lenient_where_exact():
    cfg = build_config({"n_samples_per_prompt": 4.0, "train_batch_size": "16", "bf16": "yes",
                        "gradient_checkpointing": "False", "normalize_reward": 1, "rollout_batch_size": 8}, "ppo")
    assert cfg.rollout.n_samples_per_prompt == 4 and cfg.optim.train_batch_size == 16
    assert cfg.model.bf16 is True and cfg.model.gradient_checkpointing is False and cfg.algorithm.normalize_reward


@pytest.mark.parametrize("flag", ["prompt_max_len", "num_episodes", "generate_max_len", "n_samples_per_prompt",
                                  "micro_rollout_batch_size"])
def test_zero_sizes_name_the_flag(flag):
    with pytest.raises(click.UsageError) as e:
        parse("ppo", [f"--{flag}", "0"])
    assert f"--{flag} must be > 0, got 0" in str(e.value)


def test_temperature_zero_with_group_estimator():
    with pytest.raises(click.UsageError) as e:
        parse("grpo", ["--temperature", "0", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8",
                       "--train_batch_size", "32"], GRPO_DEFAULTS)
    assert "--temperature 0" in str(e.value) and "advantage 0" in str(e.value)
    assert parse("ppo", ["--temperature", "0", "--advantage_estimator", "reinforce"]).rollout.temperature == 0


@pytest.mark.parametrize("rb,n,tb,micro", [(3, 4, 8, 4), (6, 1, 4, 4), (5, 3, 4, 2), (7, 1, 4, 4)])
def test_suggested_train_batch_size_passes(rb, n, tb, micro):
    argv = ["--rollout_batch_size", str(rb), "--n_samples_per_prompt", str(n), "--train_batch_size", str(tb),
            "--micro_train_batch_size", str(micro), "--advantage_estimator", "reinforce" if n == 1 else "rloo"]
    with pytest.raises(click.UsageError) as e:
        parse("ppo", argv)
    fix = str(e.value).split("e.g. ", 1)[1].split()
    fixed = dict(zip(argv[::2], argv[1::2]))
    fixed.update(dict(zip(fix[::2], fix[1::2])))
    cfg = parse("ppo", [x for kv in fixed.items() for x in kv])  # the suggestion must pass every check
    assert cfg.optim.train_batch_size == int(fixed["--train_batch_size"])


# ---------------------------------------------------------------------------------------------------- preflight
def _cfg(kind="sft", **kw):
    return build_config(kw, kind)


def test_preflight_model_kinds(tiny_kit, tmp_path):
    rm_dir = os.path.join(tiny_kit, "reward")
    out = dict(save_path=str(tmp_path / "out"), ckpt_path=str(tmp_path / "ck"), log_dir=str(tmp_path / "logs"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny_kit, "r": 4}))
    preflight(_cfg("sft", pretrain=tiny_kit, **out), "sft")
    preflight(_cfg("rm", pretrain=tiny_kit, **out), "rm")             # an LM gets a new head in train_rm: fine
    preflight(_cfg("ppo", pretrain=tiny_kit, reward_pretrain=rm_dir, **out), "ppo")
    bad = [
        ("sft", dict(pretrain=rm_dir), "--pretrain", "is a reward model"),
        ("ppo", dict(pretrain=tiny_kit, reward_pretrain=tiny_kit), "--reward_pretrain", "without a reward head"),
        ("dpo", dict(pretrain=str(tmp_path / "nope")), "--pretrain", "no such directory"),
        ("sft", dict(pretrain=str(tmp_path)), "--pretrain", "not a model directory: no config.json"),
        ("ppo", dict(pretrain=tiny_kit, ref_pretrain=rm_dir), "--ref_pretrain", "is a reward model"),
        # a --lora_rank run's save_path (a peft adapter folder) given as a model: name its base and the merge
        ("ppo", dict(pretrain=str(adapter)), "--pretrain",
         f"is a LoRA adapter (trained on {tiny_kit}), not a model: merge it into its base first, python -m "
         f"rlhf.tools.lora_combiner --model_path {tiny_kit} --lora_path {adapter}"),
    ]
    for kind, kw, flag, needle in bad:
        with pytest.raises(ConfigError) as e:
            preflight(_cfg(kind, **kw, **out), kind)
        assert flag in str(e.value) and needle in str(e.value), (kw, str(e.value))
    notok = tmp_path / "notok"
    notok.mkdir()
    with open(os.path.join(tiny_kit, "config.json")) as fh:
        (notok / "config.json").write_text(fh.read())
    with pytest.raises(ConfigError, match="no tokenizer files"):
        preflight(_cfg("sft", pretrain=str(notok), **out), "sft")


def test_preflight_flash_attn_rejected_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ConfigError, match="--flash_attn needs CUDA"):
        preflight(_cfg("rm", flash_attn=True, log_dir=str(tmp_path)), "rm")


@pytest.mark.parametrize("flag", ["save_path", "ckpt_path", "log_dir"])
def test_preflight_unwritable_paths(tmp_path, flag):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    kw = dict(save_path=str(tmp_path / "s"), ckpt_path=str(tmp_path / "c"), log_dir=str(tmp_path / "l"))
    kw[flag] = str(blocker / "sub")
    with pytest.raises(ConfigError) as e:
        preflight(_cfg("sft", **kw), "sft")
    assert f"--{flag}" in str(e.value) and "not writable" in str(e.value) and "is a file" in str(e.value)
    if os.path.isdir("/proc"):
        kw[flag] = "/proc/rlhf_cannot_write/x"
        with pytest.raises(ConfigError, match=f"--{flag}"):
            preflight(_cfg("sft", **kw), "sft")


def test_preflight_resume_without_checkpoint(tmp_path, capsys):
    """--load_checkpoint with no checkpoint yet starts from step 0 with one line (OpenRLHF); refused only with
    --no_start_fresh_if_no_checkpoint."""
    kw = dict(save_path=str(tmp_path / "s"), log_dir=str(tmp_path / "l"), load_checkpoint=True)
    with pytest.raises(ConfigError) as e:
        preflight(_cfg("sft", ckpt_path=str(tmp_path / "typo"), start_fresh_if_no_checkpoint=False, **kw), "sft")
    assert "it does not exist" in str(e.value) and "--no_start_fresh_if_no_checkpoint" in str(e.value)
    notes = preflight(_cfg("sft", ckpt_path=str(tmp_path / "typo"), **kw), "sft")
    assert len(notes) == 1 and "it does not exist" in notes[0] and "starting from step 0" in notes[0], notes
    (tmp_path / "ck" / ".tmp-global_step_4").mkdir(parents=True)
    notes = preflight(_cfg("sft", ckpt_path=str(tmp_path / "ck"), **kw), "sft")
    assert "saves cut short" in notes[0] and "starting from step 0" in notes[0], notes
    assert "removed 1 save(s) cut short" in notes[1], notes  # the lock proves the earlier run dead (issue 42 item 3)


def _fake_ckpt(root, step, world):
    d = root / f"global_step_{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step, "world_size": world}))
    return d


def test_preflight_resume_other_world_size(tmp_path):
    _fake_ckpt(tmp_path / "ck", 3, 2)
    kw = dict(save_path=str(tmp_path / "s"), log_dir=str(tmp_path / "l"), load_checkpoint=True,
              ckpt_path=str(tmp_path / "ck"), train_batch_size=8, micro_train_batch_size=2)
    notes = preflight(_cfg("sft", **kw), "sft", world_size=4)
    assert "saved by 2 ranks, this run has 4" in notes[0] and "ranks 2..3 get rng seeds" in notes[0]
    assert preflight(_cfg("sft", **kw), "sft", world_size=2) == []
    with pytest.raises(ConfigError) as e:
        preflight(_cfg("sft", backend="deepspeed", **kw), "sft", world_size=4)
    assert "same number of ranks" in str(e.value) and "--nproc_per_node 2" in str(e.value)


def test_preflight_batch_vs_world(tmp_path):
    kw = dict(save_path=str(tmp_path / "s"), log_dir=str(tmp_path / "l"), train_batch_size=12,
              micro_train_batch_size=4)
    with pytest.raises(ConfigError) as e:
        preflight(_cfg("sft", **kw), "sft", world_size=2)
    fix = int(str(e.value).split("e.g. --train_batch_size ")[1])
    kw["train_batch_size"] = fix
    preflight(_cfg("sft", **kw), "sft", world_size=2)  # the suggestion passes


def test_value_head_prefix_loads_openrlhf_heads(tiny_kit, tmp_path):
    """An OpenRLHF reward model whose head is saved as value_head.weight: refused without --value_head_prefix
    (its score head would be random), loaded into HF's score with it or with config.json's value_head_prefix."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from rlhf.models.load import load_reward_model

    src = os.path.join(tiny_kit, "reward")
    dst = tmp_path / "orlhf_rm"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    head = sd.pop("score.weight")
    sd["value_head.weight"] = head
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    out = dict(save_path=str(tmp_path / "s"), log_dir=str(tmp_path / "l"), ckpt_path=str(tmp_path / "c"))
    with pytest.raises(ConfigError) as e:
        preflight(_cfg("ppo", pretrain=tiny_kit, reward_pretrain=str(dst), **out), "ppo")
    assert "no reward head weight 'score.weight'" in str(e.value) and "--value_head_prefix value_head" in str(e.value)
    preflight(_cfg("ppo", pretrain=tiny_kit, reward_pretrain=str(dst), value_head_prefix="value_head", **out), "ppo")
    model, _ = load_reward_model(str(dst), value_head_prefix="value_head")
    assert torch.equal(model.score.weight, head), "the value_head weights must land in score"
    conf = json.loads((dst / "config.json").read_text())
    conf.update(value_head_prefix="value_head", normalize_reward=True, mean=0.5, std=2.0)
    (dst / "config.json").write_text(json.dumps(conf))
    model, stats = load_reward_model(str(dst))
    assert torch.equal(model.score.weight, head) and stats == (0.5, 2.0)


def test_train_rm_flash_attn_honoured(tiny_kit, monkeypatch):
    """RMTask used to hard-code sdpa; --flash_attn now reaches from_pretrained (and is refused at start on CPU)."""
    import torch
    from transformers import AutoTokenizer

    from rlhf.supervised import tasks

    seen = {}

    def fake(auto_cls, path, on_meta=False, config_kwargs=None, **kw):
        seen.update(kw)
        raise RuntimeError("stop")

    monkeypatch.setattr(tasks, "from_pretrained_or_meta", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    task = make_task(tasks.RMTask, build_config({"flash_attn": True}, "rm"), AutoTokenizer.from_pretrained(tiny_kit))
    with pytest.raises(RuntimeError, match="stop"):
        task.build_model(tiny_kit)
    assert seen["attn_implementation"] == "flash_attention_2"
