"""Placement plans (pure, no process groups) and their errors."""
import pytest

from rlhf.config import TopologyConfig
from rlhf.distributed.placement import TopologyError, make_placement
from rlhf.plan import main as plan_main


def topo(**kw):
    t = TopologyConfig()
    for k, v in kw.items():
        setattr(t, k, v)
    return t


def test_colocated_engines_tp():
    p = make_placement(topo(colocate_all_models=True, vllm_num_engines=4, vllm_tensor_parallel_size=2), 8)
    assert p.colocated and p.ranks["actor"] == list(range(8)) == p.ranks["rollout"] == p.ranks["ref"]
    assert p.engine_ranks == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert p.ranks["critic"] == [] and not p.separate_rollout


def test_colocated_mismatch_says_what_fits():
    with pytest.raises(TopologyError, match="use --vllm_num_engines 4"):
        make_placement(topo(colocate_all_models=True, vllm_num_engines=3), 4)
    with pytest.raises(TopologyError, match="must equal the world size 4"):
        make_placement(topo(colocate_all_models=True, actor_num_gpus_per_node=2), 4)


def test_separate_roles_layout():
    p = make_placement(topo(actor_num_gpus_per_node=2, ref_num_gpus_per_node=1, reward_num_gpus_per_node=1,
                       critic_num_gpus_per_node=2, vllm_num_engines=1, vllm_tensor_parallel_size=2), 8,
                  need_critic=True, need_reward_model=True)
    assert p.ranks["actor"] == [0, 1] and p.ranks["ref"] == [2] and p.ranks["critic"] == [3, 4]
    assert p.ranks["reward"] == [5] and p.ranks["rollout"] == [6, 7] and p.engine_ranks == [[6, 7]]
    assert p.separate_rollout and p.sync_ranks == [0, 6, 7]


def test_colocate_actor_ref_and_critic_reward():
    p = make_placement(topo(colocate_actor_ref=True, ref_num_gpus_per_node=2, critic_num_gpus_per_node=2,
                       colocate_critic_reward=True, reward_num_gpus_per_node=2), 4, need_critic=True,
                  need_reward_model=True)
    assert p.ranks["ref"] == p.ranks["actor"] == [0, 1]
    assert p.ranks["reward"] == p.ranks["critic"] == [2, 3]


def test_world_size_mismatch_and_node_boundaries():
    with pytest.raises(TopologyError, match=r"2 actor \+ 1 ref \+ 2 rollout = 5 ranks but the world size is 4"):
        make_placement(topo(actor_num_gpus_per_node=2, ref_num_gpus_per_node=1, vllm_num_engines=2), 4)
    with pytest.raises(TopologyError, match="node boundary"):
        make_placement(topo(vllm_tensor_parallel_size=4), 4, nnodes=2)
    with pytest.raises(TopologyError, match="straddles a node boundary"):
        make_placement(topo(actor_num_gpus_per_node=3, ref_num_gpus_per_node=1, vllm_num_engines=0), 4, nnodes=2)


def test_plan_cli_prints_table(capsys):
    with pytest.raises(SystemExit) as e:
        plan_main(["--world_size", "4", "--colocate_all_models", "--advantage_estimator", "group_norm",
                   "--n_samples_per_prompt", "4", "--train_batch_size", "32"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "colocated" in out and "engines: 4 x TP 1" in out


def test_micro_plan_same_count_on_every_rank():
    from rlhf.distributed import micro_plan

    for n, size, micro in ((33, 2, 16), (64, 3, 16), (5, 4, 2), (3, 4, 8), (100, 8, 7), (1, 3, 4)):
        parts = [micro_plan(n, r, size, micro) for r in range(size)]
        assert len({len(p) for p in parts}) == 1, (n, size, micro)
        rows = [i for p in parts for s in p if s is not None for i in range(s.start, s.stop)]
        assert rows == list(range(n))
        assert all(s is None or s.stop - s.start <= micro for p in parts for s in p)


def test_plan_cli_derives_world_size_from_role_flags(capsys):
    """The seed's role flags alone (no --world_size): the world is the job those flags need."""
    with pytest.raises(SystemExit) as e:
        plan_main(["--actor_num_nodes", "2", "--actor_num_gpus_per_node", "8", "--vllm_num_engines", "8",
                   "--vllm_tensor_parallel_size", "2", "--colocate_all_models", "--advantage_estimator", "group_norm",
                   "--n_samples_per_prompt", "8", "--train_batch_size", "64"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "world_size=16  ranks/node=8" in out and "engines: 8 x TP 2" in out and "  15     1  actor" in out
    with pytest.raises(SystemExit) as e:
        plan_main(["--actor_num_gpus_per_node", "4", "--ref_num_gpus_per_node", "2", "--vllm_num_engines", "2",
                   "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--train_batch_size", "16"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "world_size=8" in out and "ref: ranks 4-5" in out and "rollout: ranks 6-7" in out
    with pytest.raises(SystemExit) as e:  # the actor takes "the rest": the flags alone do not say how many
        plan_main(["--vllm_num_engines", "2"])
    assert e.value.code == 2


def test_deepspeed_roles_on_ranks_of_their_own_refused_before_process_groups():
    """ZeRO's set-up waits on the whole job: a DeepSpeed role on some ranks only would hang, so the placement is
    refused with the flags that fix it, before any process group exists."""
    from rlhf.rl.checks import InputError, check_backend_placement

    split = make_placement(topo(actor_num_gpus_per_node=2, ref_num_gpus_per_node=1, vllm_num_engines=1), 4)
    with pytest.raises(InputError, match="--colocate_all_models.*--backend fsdp2"):
        check_backend_placement("deepspeed", split)
    check_backend_placement("fsdp2", split)
    every = make_placement(topo(colocate_all_models=True), 4)
    check_backend_placement("deepspeed", every)


def test_plan_cli_memory_for_a_supervised_job(capsys, tmp_path):
    """--kind sft plans one group of --world_size ranks (no RL placement); 7B SFT at 16k tokens on 24 GiB devices
    overflows in train and names flags that fit; a wrong --kind stops with the choices."""
    from rlhf.planning.dims import write_config

    write_config("qwen2.5-7b", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        plan_main(["--memory", "--kind", "sft", "--world_size", "8", "--pretrain", str(tmp_path), "--bf16",
                   "--max_len", "16384", "--micro_train_batch_size", "1", "--train_batch_size", "8",
                   "--gpu_memory_gb", "24"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "ranks 0-7 (actor)" in out and "world_size=" not in out  # no RL placement table
    assert "OVERFLOW: train on ranks 0-7" in out and "fits with: --gradient_checkpointing" in out, out
    with pytest.raises(SystemExit, match="--kind must be one of ppo, grpo, sft, rm, dpo"):
        plan_main(["--memory", "--kind", "sftt"])
