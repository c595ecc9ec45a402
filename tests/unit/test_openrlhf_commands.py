"""Issue 41: OpenRLHF's own example commands, one per family, run unchanged here (launcher, model paths, data paths,
GPU counts and sizes aside; the conversion is bench/openrlhf_examples.py, which runs the whole corpus).

The command texts below are OpenRLHF's, as written in its repository (OpenRLHF/OpenRLHF): examples/scripts/
train_sft.sh, train_dpo_llama.sh, train_ppo_ray_hybrid_engine.sh, train_ppo_with_reward_fn.sh (tag v0.11.0, dotted
flags), train_rm.sh, train_reinforce_baseline_hybrid_engine.sh, serve_remote_rm.sh (tag v0.10.1, flat flags).
Each is parsed as our entry point parses it and the values OpenRLHF's parser and ``train_ppo_ray.py``'s
post-processing give are asserted (openrlhf/cli/train_*.py of the 0.10.1 / 0.11.0 / 0.11.2 wheels); one of them
(PPO with a critic, reward model, reference) is launched for one step.
"""
import os
import sys

import click
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import openrlhf_examples as ex  # noqa: E402

from rlhf.config import parse  # noqa: E402
from rlhf.config.schema import flag_index  # noqa: E402

SFT_0110 = r"""
read -r -d '' training_commands <<EOF
openrlhf.cli.train_sft \
   --data.max_len 2048 \
   --data.dataset Open-Orca/OpenOrca \
   --data.input_key question \
   --data.output_key response \
   --train.batch_size 256 \
   --train.micro_batch_size 2 \
   --data.max_samples 500000 \
   --model.model_name_or_path meta-llama/Meta-Llama-3-8B \
   --ckpt.output_dir ./checkpoint/llama3-8b-sft \
   --ckpt.save_steps -1 \
   --logger.logging_steps 1 \
   --eval.steps -1 \
   --ds.zero_stage 2 \
   --train.max_epochs 1 \
   --ds.param_dtype bf16 \
   --ds.attn_implementation flash_attention_2 \
   --adam.lr 5e-6 \
   --ckpt.load_enable \
   --ds.packing_samples \
   --model.gradient_checkpointing_enable
EOF
    # --wandb [WANDB_TOKENS]
deepspeed --module $training_commands
"""

RM_0101 = r"""
read -r -d '' training_commands <<EOF
openrlhf.cli.train_rm \
   --save_path ./checkpoint/llama3-8b-rm \
   --save_steps -1 \
   --logging_steps 1 \
   --eval_steps -1 \
   --train_batch_size 256 \
   --micro_train_batch_size 1 \
   --pretrain OpenRLHF/Llama-3-8b-sft-mixture \
   --param_dtype bf16 \
   --max_epochs 1 \
   --max_len 8192 \
   --zero_stage 3 \
   --learning_rate 9e-6 \
   --dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku \
   --apply_chat_template \
   --chosen_key chosen \
   --rejected_key rejected \
   --attn_implementation flash_attention_2 \
   --load_checkpoint \
   --packing_samples \
   --gradient_checkpointing
EOF
deepspeed --module $training_commands
"""

DPO_0110 = r"""
read -r -d '' training_commands <<EOF
openrlhf.cli.train_dpo \
   --ckpt.output_dir ./checkpoint/llama3-8b-dpo \
   --ckpt.save_steps -1 \
   --logger.logging_steps 1 \
   --eval.steps -1 \
   --train.batch_size 256 \
   --train.micro_batch_size 1 \
   --model.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
   --ds.param_dtype bf16 \
   --train.max_epochs 1 \
   --data.max_len 8192 \
   --ds.zero_stage 3 \
   --adam.lr 5e-7 \
   --model.beta 0.1 \
   --data.dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku \
   --data.apply_chat_template \
   --data.chosen_key chosen \
   --data.rejected_key rejected \
   --ds.attn_implementation flash_attention_2 \
   --ckpt.load_enable \
   --ds.packing_samples \
   --model.gradient_checkpointing_enable
EOF
deepspeed --module $training_commands
"""

PPO_0110 = r"""
python3 -m openrlhf.cli.train_ppo_ray \
   --ref.num_nodes 1 \
   --ref.num_gpus_per_node 8 \
   --reward.num_nodes 1 \
   --reward.num_gpus_per_node 8 \
   --critic.num_nodes 1 \
   --critic.num_gpus_per_node 8 \
   --actor.num_nodes 1 \
   --actor.num_gpus_per_node 8 \
   --vllm.num_engines 4 \
   --vllm.tensor_parallel_size 2 \
   --train.colocate_all \
   --vllm.gpu_memory_utilization 0.5 \
   --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
   --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k \
   --ckpt.output_dir /openrlhf/examples/test_scripts/final/llama3-8b-rlhf \
   --ckpt.path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf \
   --ckpt.save_hf \
   --train.batch_size 128 \
   --rollout.batch_size 1024 \
   --rollout.n_samples_per_prompt 1 \
   --train.max_epochs 1 \
   --data.max_len 2048 \
   --data.max_samples 100000 \
   --ds.zero_stage 3 \
   --ds.param_dtype bf16 \
   --actor.adam.lr 5e-7 \
   --critic.adam.lr 9e-6 \
   --algo.kl.init_coef 0.01 \
   --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 \
   --data.input_key context_messages \
   --data.apply_chat_template \
   --reward.normalize_enable \
   --actor.gradient_checkpointing_enable \
   --ds.packing_samples \
   --vllm.sync_backend nccl \
   --vllm.enforce_eager \
   --vllm.enable_sleep \
   --ds.enable_sleep \
   --train.dynamic_batch_enable \
   --train.max_tokens_per_gpu 16384 \
   --algo.advantage.is_correction_enable
"""

REINFORCE_0101 = r"""
MODEL_PATH="Qwen/Qwen3-4B-Thinking-2507"
DATASET_PATH="zhuzilin/dapo-math-17k"
SAVE_PATH="${WORK_DIR}/exp/Qwen3-4B-Thinking"
REWARD_FUNC_FILENAME="math_reward_func.py"

CKPT_ARGS=(
   --pretrain ${MODEL_PATH}
   --load_checkpoint
   --save_path ${SAVE_PATH}
   --ckpt_path "${SAVE_PATH}/ckpt"
   --save_hf_ckpt
   --max_ckpt_num 3
   --save_steps 10
)
ROLLOUT_ARGS=(
   --remote_rm_url ${REWARD_FUNC_FILENAME}
   --prompt_data ${DATASET_PATH}
   --input_key prompt
   --label_key label
   --max_len 74240
   --max_new_tokens 64000
   --apply_chat_template
   --packing_samples
   --rollout_batch_size 128
   --n_samples_per_prompt 8
   --train_batch_size 1024
   --dynamic_filtering
   --dynamic_filtering_reward_range 0.0 1.0
   --use_dynamic_batch
   --train_max_tokens_per_gpu 16192
   --rollout_max_tokens_per_gpu 32768
   --micro_train_batch_size 1
   --micro_rollout_batch_size 8
   --max_samples 128000
   --max_epochs 1
   --num_episodes 1
)
ENGINE_ARGS=(
   --ref_num_nodes 1
   --ref_num_gpus_per_node 8
   --actor_num_nodes 1
   --actor_num_gpus_per_node 8
   --vllm_num_engines 8
   --vllm_tensor_parallel_size 1
   --colocate_all_models
   --vllm_gpu_memory_utilization 0.8
   --vllm_enable_sleep
   --deepspeed_enable_sleep
   --zero_stage 3
   --gradient_checkpointing
   --ring_attn_size 2
   --ring_head_stride 2
   --param_dtype bf16
)
OPTIMIZER_ARGS=(
   --advantage_estimator reinforce_baseline
   --actor_learning_rate 5e-7
   --entropy_loss_coef 0.0
   --init_kl_coef 1e-5
   --use_kl_loss
   --kl_estimator k2
)
python3 -m openrlhf.cli.train_ppo_ray ${CKPT_ARGS[@]} ${ROLLOUT_ARGS[@]} ${ENGINE_ARGS[@]} ${OPTIMIZER_ARGS[@]}
"""

REWARD_FN_0110 = r"""
ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"working_dir": "/openrlhf"}' \
   -- python3 -m openrlhf.cli.train_ppo_ray \
   --ref.num_nodes 1 \
   --ref.num_gpus_per_node 2 \
   --critic.num_nodes 1 \
   --critic.num_gpus_per_node 2 \
   --actor.num_nodes 1 \
   --actor.num_gpus_per_node 2 \
   --vllm.num_engines 2 \
   --vllm.tensor_parallel_size 2 \
   --train.colocate_actor_ref \
   --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
   --reward.remote_url /openrlhf/examples/python/reward_func.py \
   --ckpt.output_dir /openrlhf/examples/checkpoint/llama3-8b-rlhf \
   --train.micro_batch_size 8 \
   --train.batch_size 128 \
   --rollout.micro_batch_size 16 \
   --rollout.batch_size 1024 \
   --data.max_samples 100000 \
   --train.max_epochs 1 \
   --data.max_len 2048 \
   --ds.zero_stage 3 \
   --ds.param_dtype bf16 \
   --actor.adam.lr 5e-7 \
   --critic.adam.lr 9e-6 \
   --algo.kl.init_coef 0.01 \
   --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 \
   --data.input_key context_messages \
   --data.apply_chat_template \
   --reward.normalize_enable \
   --ds.packing_samples \
   --ds.adam_offload \
   --ds.attn_implementation flash_attention_2 \
   --actor.gradient_checkpointing_enable
"""

# OpenRLHF examples/python/reward_func.py (v0.11.0), the file the command above names
REWARD_FUNC = '''import torch


def reward_func(queries, prompts, labels, **kwargs):
    reward = torch.randint(0, 2, (len(queries),)).float()
    return {"rewards": reward, "scores": reward, "extra_logs": {"dummy_scores": reward}}
'''

SERVE_0101 = r"""
python -m openrlhf.cli.serve_rm \
    --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \
    --port 5000 \
    --param_dtype bf16 \
    --attn_implementation flash_attention_2 \
    --normalize_reward \
    --max_len 8192 \
    --batch_size 16
"""
SERVE_0110 = r"""
python -m openrlhf.cli.serve_rm \
    --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k \
    --port 5000 \
    --ds.param_dtype bf16 \
    --ds.attn_implementation flash_attention_2 \
    --reward.normalize_enable \
    --data.max_len 8192 \
    --batch_size 16
"""


def _one(text, version):
    [(module, argv)] = ex.commands(text)
    assert not ex.openrlhf_refuses(version, module, argv), "OpenRLHF's own parser must accept its own command"
    return module, argv


def _ours(text, version, kit, tmp_path, src_dir=None):
    """(module, our argv, config as our entry point builds it)."""
    module, argv = _one(text, version)
    ours, _ = ex.convert(module, argv, kit, str(tmp_path / module), src_dir or str(tmp_path))
    kind = ex.OURS[module][1]
    return module, ours, parse(kind, ours, ex.trainer_defaults(kind))


def _get(cfg, name):
    g, _ = flag_index()[name]
    return getattr(getattr(cfg, g), name)


def _check(cfg, expected):
    got = {k: _get(cfg, k) for k in expected}
    assert got == expected, {k: (got[k], v) for k, v in expected.items() if got[k] != v}


def test_sft_command_keeps_openrlhf_meaning(tiny_kit, tmp_path):
    """openrlhf/cli/train_sft.py (0.11): --data.input_template defaults to "User: {}\\nAssistant: " (no chat
    template), --ckpt.load_enable starts fresh on an empty folder, --ds.packing_samples, ZeRO stage 2."""
    _, ours, cfg = _ours(SFT_0110, "0.11.0", tiny_kit, tmp_path)
    _check(cfg, {"input_key": "question", "output_key": "response", "input_template": "User: {}\nAssistant: ",
                 "learning_rate": 5e-6, "zero_stage": 2, "packing_samples": True, "load_checkpoint": True,
                 "gradient_checkpointing": True, "bf16": True})
    # OpenRLHF's SFT --max_epochs default is 2 (openrlhf/cli/train_sft.py); its scripts pass 1, a command that
    # leaves it out trains two epochs there and here
    flags = ("--max_epochs", "--train.max_epochs")
    without = [a for i, a in enumerate(ours) if a not in flags and (i == 0 or ours[i - 1] not in flags)]
    assert "--train.max_epochs" in ours, "the 0.11 command sets its epochs"
    assert _get(parse("sft", without, ex.trainer_defaults("sft")), "max_epochs") == 2, "SFT --max_epochs default"


def test_rm_command_keeps_openrlhf_meaning(tiny_kit, tmp_path):
    """openrlhf/cli/train_rm.py (0.10.1, flat): --loss default sigmoid, chosen/rejected whole conversations read
    with the chat template (OpenRLHF/preference_dataset_mixture2_and_safe_pku's shape, written by the harness)."""
    _, _, cfg = _ours(RM_0101, "0.10.1", tiny_kit, tmp_path)
    _check(cfg, {"chosen_key": "chosen", "rejected_key": "rejected", "apply_chat_template": True,
                 "rm_loss": "sigmoid", "learning_rate": 9e-6, "zero_stage": 3, "load_checkpoint": True})


def test_dpo_command_keeps_openrlhf_meaning(tiny_kit, tmp_path):
    """openrlhf/cli/train_dpo.py (0.11): --model.beta 0.1, sigmoid DPO loss, --adam.lr."""
    _, _, cfg = _ours(DPO_0110, "0.11.0", tiny_kit, tmp_path)
    _check(cfg, {"beta": 0.1, "loss_type": "sigmoid", "learning_rate": 5e-7, "chosen_key": "chosen"})


def test_ppo_with_critic_command_keeps_openrlhf_meaning(tiny_kit, tmp_path):
    """openrlhf/cli/train_ppo_ray.py (0.11.2): gae with lambd 1 and gamma 1, the critic starts from the reward model
    when --critic.model_name_or_path is not given, eval at temperature 0.6 with 4 samples per prompt, no label key,
    no hold-out, --rollout.max_tokens_per_gpu = --train.max_tokens_per_gpu when unset."""
    _, _, cfg = _ours(PPO_0110, "0.11.0", tiny_kit, tmp_path)
    reward = os.path.join(tiny_kit, "reward")
    _check(cfg, {"advantage_estimator": "gae", "lambd": 1.0, "gamma": 1.0, "critic_pretrain": reward,
                 "reward_pretrain": reward, "normalize_reward": True, "init_kl_coef": 0.01, "clip_eps_low": 0.2,
                 "clip_eps_high": 0.2, "actor_learning_rate": 5e-7, "critic_learning_rate": 9e-6,
                 "eval_temperature": 0.6, "eval_n_samples_per_prompt": 4, "label_key": None, "eval_holdout": 0.0,
                 "colocate_all_models": True, "use_dynamic_batch": True, "train_max_tokens_per_gpu": 16384,
                 "enable_is_correction": True, "apply_chat_template": True})
    from rlhf.config.batching_checks import row_budgets

    assert row_budgets(cfg) == (16384, 16384), "the rollout's token budget defaults to the training one"


def test_reinforce_baseline_command_keeps_openrlhf_meaning(tiny_kit, tmp_path):
    """OpenRLHF 0.10.1 train_reinforce_baseline_hybrid_engine.sh (flat, bash arrays): --max_new_tokens is
    --generate_max_len, prompts keep max_len - max_new_tokens, k2 KL as a loss, no critic."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "math_reward_func.py").write_text(REWARD_FUNC)
    _, ours, cfg = _ours(REINFORCE_0101, "0.10.1", tiny_kit, tmp_path, str(src))
    _check(cfg, {"advantage_estimator": "reinforce_baseline", "use_kl_loss": True, "kl_estimator": "k2",
                 "init_kl_coef": 1e-5, "label_key": "label", "input_key": "prompt", "dynamic_filtering": True,
                 "generate_max_len": 16, "max_len": 64, "prompt_max_len": 48, "critic_pretrain": None,
                 "n_samples_per_prompt": 4, "train_max_tokens_per_gpu": 16192})
    assert _get(cfg, "remote_rm_url").endswith("math_reward_func.py")


def test_reward_function_command_starts_the_critic_from_the_actor(tiny_kit, tmp_path):
    """openrlhf/cli/train_ppo_ray.py: with --reward.remote_url and gae, the critic starts from the actor."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "reward_func.py").write_text(REWARD_FUNC)
    _, _, cfg = _ours(REWARD_FN_0110, "0.11.0", tiny_kit, tmp_path, str(src))
    assert _get(cfg, "remote_rm_url") == str(tmp_path / "train_ppo_ray" / "reward_func.py")
    _check(cfg, {"advantage_estimator": "gae", "colocate_actor_ref": True, "adam_offload": True})
    # roles.load_critic: the critic starts from --critic_pretrain or else the actor's --pretrain
    assert (_get(cfg, "critic_pretrain") or _get(cfg, "pretrain")) == tiny_kit


@pytest.mark.parametrize("text,version", [(SERVE_0101, "0.10.1"), (SERVE_0110, "0.11.0")])
def test_serve_rm_command_parses_with_openrlhf_meaning(text, version, tiny_kit, tmp_path):
    """openrlhf/cli/serve_rm.py: the flat (0.10.1) and dotted (0.11) spellings of serve_remote_rm.sh."""
    from rlhf.serve_rm import main as serve

    module, argv = _one(text, version)
    ours, _ = ex.convert(module, argv, tiny_kit, str(tmp_path), str(tmp_path))
    ctx = serve.make_context("serve_rm", list(ours))
    p = ctx.params
    assert (p["reward_pretrain"], p["normalize_reward"], p["max_len"], p["batch_size"], p["param_dtype"]) == (
        os.path.join(tiny_kit, "reward"), True, 64, 16, "bf16"), p


def test_refused_commands_say_which_flag(tiny_kit, tmp_path):
    """A flag OpenRLHF's parser does not know is caught before ours runs (the README's stale --prompt_max_len in
    0.11's dotted train_ppo_ray); ours refuses a value it does not support by name (--optim muon)."""
    assert ex.openrlhf_refuses("0.11.2", "train_ppo_ray", ["--prompt_max_len", "1024"]) == ["prompt_max_len"]
    with pytest.raises(click.UsageError, match="--optim muon is not supported"):
        parse("sft", ["--optim", "muon"])


def test_ppo_with_critic_command_runs_one_step(tiny_kit, tmp_path):
    """The PPO command above (actor, critic from the reward model, reference, all colocated, dynamic batch,
    packing) runs one step under torchrun on the tiny kit."""
    module, ours, _ = _ours(PPO_0110, "0.11.0", tiny_kit, tmp_path)
    status, msg, _ = ex.run_train(module, ours, str(tmp_path / module), timeout=300)
    assert status == "runs", msg


def test_flags_md_gives_every_openrlhf_flag_a_verdict():
    """docs/FLAGS.md: every flag of OpenRLHF's parsers (0.10.1, 0.11.0, 0.11.2; rlhf/tools/openrlhf_flags.json) has
    a row saying same / differs: how / refused: why (for each trainer where it differs)."""
    import re

    from rlhf.tools.flags_md import PATH
    from rlhf.tools.openrlhf_flags import load

    with open(PATH) as fh:
        doc = fh.read()
    section = doc[doc.index("## Every OpenRLHF flag"):]
    rows = dict(re.findall(r"^\| `--([^`]+)` \| [^|]+ \| (.+) \|$", section, re.M))
    flags = {f for modules in load().values() for m in modules.values() for f in m}
    assert len(flags) > 300 and not flags - set(rows), sorted(flags - set(rows))[:10]
    for f in flags:
        verdicts = re.split(r"; (?:sft|rm|dpo|ppo|serve_rm): ", "; " + rows[f])[1:] or [rows[f]]
        for v in [rows[f]] if not rows[f].startswith(("sft:", "rm:", "dpo:", "ppo:", "serve_rm:")) else verdicts:
            assert v.startswith(("same", "differs: ", "refused: ")), (f, v)
