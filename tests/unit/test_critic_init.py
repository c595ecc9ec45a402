"""The critic starts from the reward model's head when --critic_pretrain is a reward model.

OpenRLHF builds the critic with the reward model's class (openrlhf/models/model.py ``get_llm_for_sequence_regression``,
model_type "critic": a ``value_head_prefix`` head, ``score`` by default, that ``from_pretrained`` fills from the
checkpoint), and draws a fresh head only when the critic's path is the actor's (openrlhf/trainer/ray/ppo_critic.py
``init_value_head=...actor.model_name_or_path == ...critic.model_name_or_path``); with --normalize_reward both the
reward model and the critic rescale by the mean / std saved with the model.  So at step 1 the critic's value at a
sequence's last token is the reward model's (normalised) score: the recipes that pass a reward model as
--critic_pretrain (PPO 8B / 70B) start with a critic that already ranks responses, not a random one.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch


def _rows():
    """Left-padded prompts and right-padded responses of different lengths (the rollout layout)."""
    from helpers.batching_checks import skewed_experience

    exp = skewed_experience()
    return exp.sequences, exp.attention_mask, exp.action_mask.size(1)


def last_token_values(critic, seq, att, R):
    """The critic's value at each sequence's last real token, through its own forward: one more column (padding)
    makes the forward return the value of the state after the last response token too."""
    from rlhf.rewards.reward_model import score_positions

    seq1 = torch.nn.functional.pad(seq, (0, 1))
    att1 = torch.nn.functional.pad(att, (0, 1))
    with torch.no_grad():
        v = critic(seq1, att1, R + 1)  # v[:, j]: the state at position (P + R + 1) - (R + 1) - 1 + j = P - 1 + j
    P = seq.size(1) - R
    return v[torch.arange(seq.size(0)), score_positions(att) - (P - 1)]


@pytest.fixture
def rm_dir(tiny_kit, tmp_path):
    """The tiny kit's reward model with the statistics train_rm saves beside it (reward_norm.json)."""
    d = tmp_path / "rm"
    shutil.copytree(os.path.join(tiny_kit, "reward"), d)
    with open(d / "reward_norm.json", "w") as fh:
        json.dump({"mean": 0.25, "std": 3.0}, fh)
    return str(d)


@pytest.mark.parametrize("normalize", [False, True])
def test_critic_from_a_reward_model_values_its_last_token_as_the_reward_role_scores(tiny_kit, rm_dir, normalize):
    from rlhf.config import parse
    from rlhf.models.load import load_reward_model
    from rlhf.rewards.reward_model import reward_model_stats, score_sequences
    from rlhf.roles.critic import load_critic
    from rlhf.train_ppo import PPO_DEFAULTS

    argv = ["--pretrain", tiny_kit, "--reward_pretrain", rm_dir, "--critic_pretrain", rm_dir]
    cfg = parse("ppo", argv + (["--normalize_reward"] if normalize else []), PPO_DEFAULTS)
    rm, saved = load_reward_model(rm_dir)
    stats = reward_model_stats(cfg.algorithm.normalize_reward, saved)  # what the reward role divides by (Roles.reward_stats)
    assert stats == ((0.25, 3.0) if normalize else (0.0, 1.0))
    seq, att, R = _rows()
    want = score_sequences(rm, seq, att, stats)
    critic = load_critic(cfg.model, cfg.algorithm.normalize_reward, tiny_kit)
    got = last_token_values(critic, seq, att, R)
    assert want.abs().max() > 1e-3, "the reward model's scores are all ~0: the comparison would prove nothing"
    gap = (got - want).abs().max().item()
    assert gap < 1e-5, f"critic values at the last token {got.tolist()} != reward model scores {want.tolist()}"


def test_critic_from_a_causal_lm_starts_a_fresh_head_and_says_so(tiny_kit, capsys):
    """--critic_pretrain a causal LM (or the default, --pretrain): a fresh head (OpenRLHF's init_value_head: normal,
    std 1/(hidden+1), no bias), said on rank 0; a critic saved by this library brings its own value_head.pt."""
    from rlhf.models.critic import CriticModel

    torch.manual_seed(0)
    critic = CriticModel.from_pretrained(tiny_kit)
    assert "value head starts at random" in capsys.readouterr().out
    h = critic.value_head.weight.numel()
    assert float(critic.value_head.bias.abs().max()) == 0.0
    assert 0.2 / (h + 1) < float(critic.value_head.weight.std()) < 5.0 / (h + 1)


@pytest.mark.parametrize("hub", [False, True])
def test_critic_head_from_an_openrlhf_reward_model(tiny_kit, tmp_path, monkeypatch, hub):
    """An OpenRLHF reward model (its head saved as ``value_head``, config.json's value_head_prefix says so), as a
    local folder or a hub name in the hub cache: the critic takes that head, as the reward model's loader does."""
    import huggingface_hub
    from safetensors.torch import load_file, save_file

    from rlhf.models.critic import reward_head_weight

    d = tmp_path / "models--org--rm" / "snapshots" / "abc" if hub else tmp_path / "rm"
    shutil.copytree(os.path.join(tiny_kit, "reward"), d)
    sd = load_file(str(d / "model.safetensors"))
    sd["value_head.weight"] = sd.pop("score.weight") * 2
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "value_head_prefix": "value_head"}))
    if hub:
        (tmp_path / "models--org--rm" / "refs").mkdir()
        (tmp_path / "models--org--rm" / "refs" / "main").write_text("abc")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    w = reward_head_weight("org/rm" if hub else str(d))
    assert torch.equal(w, sd["value_head.weight"])
