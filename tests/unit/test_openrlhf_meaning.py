"""Issue 41 items 1, 4, 9, 13 and issue 42 item 6: OpenRLHF's meaning for --normalize_reward, RL --max_len,
flat --max_new_tokens, --async_train with --colocate_all_models, token budgets without --use_dynamic_batch,
--gpu_memory_gb nan.  In-process, no process group."""
import json

import pytest
import torch

from rlhf.config import parse


def _err(kind, argv):
    import click

    with pytest.raises(click.UsageError) as e:
        parse(kind, argv)
    return str(e.value)


# ---- item 4: --max_len in RL is the prompt + response budget ----------------------------------------------------

def test_max_len_with_max_new_tokens_cuts_prompts_to_the_rest(capsys):
    """OpenRLHF openrlhf/utils/agent.py (Single/MultiTurnAgentExecutor.execute): prompts keep their last
    max_len - max_new_tokens tokens; its agent scripts give --data.max_len 74240 --rollout.max_new_tokens 64000:
    agent prompts keep 10240 tokens (here they were cut at --prompt_max_len 1024)."""
    for argv in (["--data.max_len", "74240", "--rollout.max_new_tokens", "64000"],
                 ["--max_len", "74240", "--max_new_tokens", "64000"]):           # 0.11 dotted, 0.10.1 flat
        d = parse("ppo", argv).data
        assert (d.prompt_max_len, d.generate_max_len, d.max_len) == (10240, 64000, 74240), argv
    assert "prompts keep their last 10240 tokens" in capsys.readouterr().err
    assert "leaves no prompt token" in _err("ppo", ["--max_len", "100", "--generate_max_len", "100"])
    assert "exceeds --max_len 300" in _err("ppo", ["--max_len", "300", "--generate_max_len", "200",
                                                   "--prompt_max_len", "150"])


def test_max_len_alone_gives_each_response_what_its_prompt_leaves(tiny_kit):
    """OpenRLHF (max_new_tokens unset): vLLM max_tokens = max_len - prompt tokens per sample
    (SingleTurnAgentExecutor: ``max(1, max_length - len(prompt_token_ids))``), prompts cut to max_len - 1.
    Here: the rollout engine's max_model_len is --max_len; the HF engine stops each row there."""
    from rlhf.engines import HFEngine, SamplingParams
    from rlhf.models.load import load_causal_lm, load_tokenizer
    from rlhf.roles.build import rl_max_len

    cfg = parse("ppo", ["--max_len", "12"])
    d = cfg.data
    assert (d.prompt_max_len, d.max_len, rl_max_len(cfg.data)) == (11, 12, 12), (d.prompt_max_len, d.max_len)
    assert d.generate_max_len >= 12, "the response bound must not bind before max_len - prompt"
    default = parse("ppo", [])
    assert rl_max_len(default.data) == 2048 and (default.data.prompt_max_len, default.data.generate_max_len) == (1024, 1024)

    m = load_causal_lm(tiny_kit)
    m.config.use_cache = True
    tok = load_tokenizer(tiny_kit)
    eng = HFEngine(m, tok, micro_batch_size=8, max_model_len=rl_max_len(cfg.data))
    prompts = [[5] * 3, [6] * 8, [7] * 11]   # 3, 8 and 11 prompt tokens: room 9, 4 and 1
    out = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=d.generate_max_len, seed=3,
                                               stop_token_ids=()))
    stop = eng.tokenizer.eos_token_id
    capped = 0
    for i in range(6):
        n_prompt = int(out.attention_mask[i, :out.prompt_len].sum())
        n_resp = int(out.action_mask[i].sum())
        room = 12 - n_prompt
        assert n_prompt + n_resp <= 12, f"row {i}: {n_prompt} + {n_resp} tokens exceed --max_len 12"
        resp = out.sequences[i, out.prompt_len:out.prompt_len + n_resp].tolist()
        if stop not in resp:
            assert n_resp == room and bool(out.truncated[i]), f"row {i}: cut at {n_resp}, room {room}"
            capped += 1
        assert float(out.rollout_logprobs[i, n_resp:].abs().sum()) == 0.0
    assert capped >= 2, "the budget should have cut some rows (the tiny model rarely stops)"
    assert [int(out.action_mask[i].sum()) for i in (4, 5)] == [1, 1], "an 11-token prompt leaves 1 token of 12"


def test_memory_plan_sequence_is_the_rl_budget():
    from rlhf.planning import job_from_flags

    def job_from_config(c, kind):
        return job_from_flags(kind, c.model, c.data, c.topology, c.rollout, c.optim)

    assert job_from_config(parse("ppo", ["--max_len", "4096"]), "ppo").seq == 4096
    assert job_from_config(parse("ppo", ["--max_len", "4096", "--generate_max_len", "1000"]), "ppo").seq == 4096
    assert job_from_config(parse("ppo", []), "ppo").seq == 2048


# ---- item 9: flat --max_new_tokens --------------------------------------------------------------------------------

def test_flat_max_new_tokens_is_generate_max_len():
    """OpenRLHF 0.10.1 openrlhf/cli/train_ppo_ray.py ``--max_new_tokens`` (0.11: ``--rollout.max_new_tokens``)."""
    assert parse("ppo", ["--max_new_tokens", "77"]).data.generate_max_len == 77
    assert parse("ppo", ["--rollout.max_new_tokens", "77"]).data.generate_max_len == 77
    assert "--max_new_tokens 77 means --generate_max_len 77" in _err(
        "ppo", ["--max_new_tokens", "77", "--generate_max_len", "50"])


# ---- item 1: --normalize_reward is OpenRLHF's (the reward model's saved mean / std) --------------------------------

def test_normalize_reward_rescales_the_reward_model_only(tiny_kit, tmp_path):
    """OpenRLHF openrlhf/models/model.py RewardModel.forward: ``if self.normalize_reward: reward = (reward -
    self.mean) / self.std`` with mean / std from config.json (written by its train_rm, config.normalize_reward
    being the flag's); reward functions are untouched.  The running mean / std is --running_reward_norm."""
    import shutil

    from rlhf.models.load import load_reward_model
    from rlhf.rewards.reward_model import reward_model_stats, score_sequences
    from rlhf.rl.advantage_stage import running_reward_norm

    shutil.copytree(f"{tiny_kit}/reward", tmp_path / "rm")
    (tmp_path / "rm" / "reward_norm.json").unlink(missing_ok=True)
    conf_path = tmp_path / "rm" / "config.json"
    conf = json.loads(conf_path.read_text())
    conf.update(normalize_reward=False, mean=0.5, std=2.0)   # OpenRLHF's train_rm layout
    conf_path.write_text(json.dumps(conf))
    model, saved = load_reward_model(str(tmp_path / "rm"))
    assert saved == (0.5, 2.0), "config.json's mean / std are read whatever config.json's normalize_reward says"

    on, off = parse("ppo", ["--normalize_reward"]), parse("ppo", [])
    assert reward_model_stats(on.algorithm.normalize_reward, saved) == (0.5, 2.0) \
        and reward_model_stats(off.algorithm.normalize_reward, saved) == (0.0, 1.0)
    assert running_reward_norm(on.algorithm) is None, "--normalize_reward must not normalise reward functions' rewards"
    assert running_reward_norm(parse("ppo", ["--running_reward_norm"]).algorithm) is not None
    seq = torch.tensor([[5, 6, 7, 8]])
    att = torch.ones_like(seq)
    raw = score_sequences(model, seq, att, reward_model_stats(off.algorithm.normalize_reward, saved))
    norm = score_sequences(model, seq, att, reward_model_stats(on.algorithm.normalize_reward, saved))
    assert torch.allclose(norm, (raw - 0.5) / 2.0, atol=1e-5), (raw, norm)


def test_normalize_reward_with_a_reward_function_says_it_does_nothing(capsys):
    cfg = parse("ppo", ["--normalize_reward", "--remote_rm_url", "builtin:arithmetic"])
    assert cfg.algorithm.normalize_reward and not cfg.algorithm.running_reward_norm
    assert "does nothing (reward functions and agents are not rescaled)" in capsys.readouterr().err
    assert parse("ppo", ["--reward.normalize_enable"]).algorithm.normalize_reward


def test_stage_leaves_function_rewards_alone_with_normalize_reward():
    """The advantage stage with --normalize_reward and no running norm: shaped reward = reward (OpenRLHF does not
    touch reward-function rewards); with --running_reward_norm they are standardised."""
    from rlhf.batch import Batch
    from rlhf.rl.advantage_stage import advantage_stage, running_reward_norm

    r = torch.tensor([1.0, 3.0])
    x = Batch(rewards=r, scores=r.clone(), valid=torch.ones(2, dtype=torch.bool), action_mask=torch.ones(2, 1, dtype=torch.long),
              truncated=torch.zeros(2, dtype=torch.bool), rollout_logprobs=torch.zeros(2, 1))
    args = ["--advantage_estimator", "reinforce", "--rollout_batch_size", "2", "--train_batch_size", "2",
            "--micro_train_batch_size", "1"]
    cfg = parse("ppo", args + ["--normalize_reward"])
    out = advantage_stage(cfg.algorithm, x, 0.0, cfg.data.generate_max_len, cfg.rollout.n_samples_per_prompt,
                          running_reward_norm(cfg.algorithm))
    assert out.metrics["shaped_reward"] == pytest.approx(2.0), "reward-function rewards must stay as they are"
    cfg = parse("ppo", args + ["--running_reward_norm"])
    out = advantage_stage(cfg.algorithm, x, 0.0, cfg.data.generate_max_len, cfg.rollout.n_samples_per_prompt,
                          running_reward_norm(cfg.algorithm))
    assert out.metrics["shaped_reward"] == pytest.approx(0.0, abs=1e-6)


# ---- item 13: --async_train --colocate_all_models -----------------------------------------------------------------

def test_async_with_colocate_all_colocates_the_training_models(capsys):
    """OpenRLHF openrlhf/cli/train_ppo_ray.py: "[Warning] Using --colocate_all_models in async RLHF only colocates
    DeepSpeed models." and vLLM engines get no placement group under async: actor, ref, critic and reward model
    share the actor's GPUs, the engines run on GPUs of their own."""
    from rlhf.distributed.placement import make_placement, required_world_size

    cfg = parse("ppo", ["--train.async_enable", "--train.colocate_all", "--vllm.num_engines", "1",
                        "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "2"])
    t = cfg.topology
    assert not t.colocate_all_models and t.ref_num_gpus_per_node == 0
    assert "colocates only the training models" in capsys.readouterr().err
    assert required_world_size(t, need_ref=True, need_critic=True, need_reward_model=True) == 3
    plan = make_placement(t, 3, need_ref=True, need_critic=True, need_reward_model=True)
    assert plan.ranks["actor"] == plan.ranks["ref"] == plan.ranks["critic"] == plan.ranks["reward"] == [0, 1]
    assert plan.ranks["rollout"] == [2] and plan.separate_rollout
    assert "--vllm_num_engines 1" in _err("ppo", ["--async_train", "--colocate_all_models"])


# ---- issue 42 item 6 ---------------------------------------------------------------------------------------------

def test_token_budget_without_dynamic_batch_says_so(capsys):
    parse("ppo", ["--train_max_tokens_per_gpu", "4096"])
    err = capsys.readouterr().err
    assert "--train_max_tokens_per_gpu has no effect without --use_dynamic_batch" in err
    parse("ppo", ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096"])
    assert "no effect" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-4"])
def test_gpu_memory_gb_must_be_a_finite_size(value):
    assert "--gpu_memory_gb must be a finite number of GiB > 0" in _err("sft", ["--gpu_memory_gb", value])


# ---- item 2 (other PPO defaults): the critic starts from the reward model ----------------------------------------

def test_gae_critic_defaults_to_the_reward_model(capsys):
    """OpenRLHF openrlhf/cli/train_ppo_ray.py: ``elif args.critic.model_name_or_path is None: ...
    args.critic.model_name_or_path = args.reward.model_name_or_path.split(",")[0]`` (gae with a reward model)."""
    cfg = parse("ppo", ["--reward.model_name_or_path", "/models/rm"])
    assert cfg.model.critic_pretrain == "/models/rm"
    assert "the critic starts from the reward model /models/rm" in capsys.readouterr().err
    assert parse("ppo", ["--reward_pretrain", "/models/rm", "--critic_pretrain", "/c"]).model.critic_pretrain == "/c"
    assert parse("ppo", ["--remote_rm_url", "builtin:arithmetic"]).model.critic_pretrain is None   # --pretrain
    from rlhf.train_grpo import GRPO_DEFAULTS

    grpo = parse("grpo", ["--reward_pretrain", "/models/rm"], GRPO_DEFAULTS)
    assert grpo.model.critic_pretrain is None, "no critic without gae"


# ---- OpenRLHF 0.11.0 examples/scripts/train_reinforce_baseline_{hybrid_engine,ray_agent_async}.sh -----------------

REINFORCE_BASELINE_0110 = """
--actor.model_name_or_path M --ckpt.load_enable --ckpt.output_dir S --ckpt.path S/ckpt --ckpt.save_hf --ckpt.max_num 3
--ckpt.save_steps 10 --train.agent_func_path agent_func.py --data.prompt_dataset D --data.input_key prompt
--data.label_key label --data.max_len 74240 --rollout.max_new_tokens 64000 --data.apply_chat_template
--ds.packing_samples --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 --train.batch_size 1024
--algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0.0 1.0 --train.dynamic_batch_enable
--train.max_tokens_per_gpu 16192 --rollout.max_tokens_per_gpu 32768 --train.micro_batch_size 1
--rollout.micro_batch_size 8 --data.max_samples 128000 --train.max_epochs 1 --train.num_episodes 1
--ref.num_nodes 1 --ref.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4 --vllm.num_engines 2
--vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.7 --train.colocate_all --ds.enable_sleep
--vllm.sync_backend nccl --vllm.enforce_eager --ds.zero_stage 3 --actor.gradient_checkpointing_enable
--ds.ring_attn_size 2 --ds.ring_attn_head_stride 2 --ds.param_dtype bf16
--algo.advantage.estimator reinforce_baseline --actor.adam.lr 5e-7 --actor.entropy_coef 0.0 --algo.kl.init_coef 1e-5
--algo.kl.use_loss --algo.kl.estimator k2 --algo.advantage.is_correction_enable
--algo.advantage.is_correction_type icepop --logger.logging_steps 1 --eval.steps -1
"""


def test_reinforce_baseline_scripts_parse_with_openrlhf_meaning():
    """Items 4, 12, 13 together: the hybrid-engine script (74240-token budget, 64000 new tokens, 16192-token
    micro-batches x ring 2) was refused for its token budget; it parses with prompts cut at 10240.  The async
    variant (--train.async_enable; its --train.partial_rollout_enable with an agent is another item) colocates the
    training models on 4 ranks and puts the 2 x TP 2 engines on 4 ranks of their own (8 GPUs, as OpenRLHF)."""
    from rlhf.distributed.placement import required_world_size

    argv = REINFORCE_BASELINE_0110.split()
    cfg = parse("ppo", argv)
    d, o = cfg.data, cfg.optim
    assert (d.prompt_max_len, d.generate_max_len, o.train_max_tokens_per_gpu) == (10240, 64000, 16192)
    assert cfg.topology.colocate_all_models
    acfg = parse("ppo", argv + ["--train.async_enable"])
    t = acfg.topology
    assert not t.colocate_all_models and t.ref_num_gpus_per_node == 0
    assert required_world_size(t, need_ref=True) == 8
