"""GRPO with a Qwen3-MoE actor (the tiny kit's ``qwen3_moe``: 4 experts, top-2) through the CLI on the HF engine
(issue 45): fp32 rollout and trainer agree to < 1e-4; --router_replay R3 (1 process) and R2 (2 ranks: the routing
rides in the old-log-prob forward's row gather) route every token as recorded while the router's own choice drifts
after the first optimizer step; the router's load metrics and aux loss are logged."""
from __future__ import annotations

import pytest
from helpers.e2e import rl_args, torchrun


@pytest.fixture(scope="module")
def moe_model(tiny_kit, tmp_path_factory):
    """The tiny kit's tokenizer with a Qwen3-MoE policy (tiny_kit.build_config ``qwen3_moe``, as ``--arch
    qwen3_moe`` builds it) beside it: the kit's data, no second tokenizer training."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.models.tiny_kit import build_config

    out = str(tmp_path_factory.mktemp("moe") / "policy")
    tok = AutoTokenizer.from_pretrained(tiny_kit)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config("qwen3_moe", len(tok), 2, 64, tok)).save_pretrained(out)
    tok.save_pretrained(out)
    return tiny_kit, out


def _run(moe_model, tmp_path, nproc, **over):
    # 16 rows, 2 optimizer steps per rollout (an old_logprobs stage); lr 1e-2 moves near-tie routers in one step
    kit, policy = moe_model
    args = rl_args(kit, policy, rollout_batch_size=4, n_samples_per_prompt=4, train_batch_size=8,
                   micro_train_batch_size=4, micro_rollout_batch_size=16, max_samples=8, rollout_engine="hf",
                   actor_learning_rate=1e-2, eval_dataset=None, save_path=tmp_path / "out", seed=3, **over)
    train, _, out = torchrun("rlhf.train_grpo", nproc, args, tmp_path, str(tmp_path / "logs"))
    assert len(train) == 2, out[-2000:]
    if over.get("ep_size", 1) > 1:  # the engines split the experts (rlhf.engines.fsdp2)
        for role in ("actor", "ref"):
            assert f"[fsdp2] {role}: --ep_size {over['ep_size']}: 2 experts per rank" in out, (role, out[-3000:])
    return train


def _routing_checks(train, kinds):
    for r in train:
        assert r["rollout_logprob_gap"] < 1e-4, r  # fp32 engine and trainer, same routing
        for k in kinds:
            assert r[f"router/{k}_mismatch"] == 0.0, (k, r)  # replayed: every token as recorded
        assert 1.0 <= r["router/load_max"] <= 2.0 and "router/load_max_l1" in r, r  # max/mean of 4 experts, top-2
    assert max(r["router/update_mismatch_own"] for r in train) > 0, "the router's own choice never drifted"


def test_grpo_moe_r3_through_the_cli(moe_model, tmp_path):
    train = _run(moe_model, tmp_path, 0, router_replay="R3", packing_samples=True, aux_loss_coef=0.01,
                 init_kl_coef=0.01, use_kl_loss=True, experts_implementation="grouped_mm")
    _routing_checks(train, ("ref", "old", "update"))
    assert all(r["aux_loss"] > 0.5 for r in train), "the MoE load-balancing loss was not read"
    # step 2's reference is the step-0 policy, the rollout the updated one: without replay it would route apart
    assert train[1]["router/ref_mismatch_own"] > 0 and train[1]["router/ref_mismatch"] == 0.0


def test_grpo_moe_r2_two_ranks(moe_model, tmp_path):
    """Also --ep_size 2 (one launch for both, the suite's time): the actor's and reference's 4 experts split 2 per
    rank, tokens dispatched by all-to-all; the rollout (the HF engine's whole copy, synced from the expert shards)
    and the trainer agree to < 1e-4 at step 2, after an update moved every expert; R2 replays through EP."""
    train = _run(moe_model, tmp_path, 2, router_replay="R2", ep_size=2)
    _routing_checks(train, ("update",))
    assert train[1]["kl"] > 100 * train[1]["rollout_logprob_gap"], "step 2's policy did not move off the reference"

