"""Critic: LM backbone + scalar value head, values at the action positions."""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
from torch import nn

from rlhf.console import print0
from rlhf.distributed.sequence_parallel import sp_of
from rlhf.models.forward import position_ids_from_mask, sp_values


class CriticModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, gradient_checkpointing: bool = False, on_meta: bool = False,
                        flash_attn: bool = False, value_head_prefix: Optional[str] = None,
                        reward_stats: Tuple[float, float] = (0.0, 1.0)):
        """Trainable: fp32 weights (the optimizer's masters; --bf16 is the engine's compute dtype) and the
        attention implementation of --flash_attn, both explicit (load.weight_dtype).

        The value head: a critic saved here (``value_head.pt``) brings its own; a reward model (--critic_pretrain
        a *ForSequenceClassification dir) starts it from its score head, so at step 1 the critic's value at a
        sequence's last token is the reward model's score, normalised by ``reward_stats`` (the (mean, std) the
        reward role applies, folded into the head: weight / std, bias -mean / std).  OpenRLHF loads the critic with
        the reward model's class, so ``from_pretrained`` fills its ``value_head_prefix`` head from the checkpoint
        (openrlhf/models/model.py ``get_llm_for_sequence_regression``; openrlhf/trainer/ray/ppo_critic.py draws a
        fresh head only when the critic's path is the actor's, ``init_value_head``).  Anything else: a fresh head,
        said on rank 0."""
        from transformers import AutoModel

        from rlhf.models.load import attn_implementation, from_pretrained_or_meta, weight_dtype

        kw = dict(dtype=weight_dtype(False, trainable=True), attn_implementation=attn_implementation(flash_attn))
        if on_meta:
            backbone = from_pretrained_or_meta(AutoModel, path, True, **kw)
        else:  # a causal LM's lm_head is "unexpected" here by design: report only what would start random
            backbone, info = from_pretrained_or_meta(AutoModel, path, report=False, output_loading_info=True, **kw)
            missing = sorted(info.get("missing_keys") or [])
            if missing:
                print0(f"[critic] {path}: {len(missing)} backbone weights are not in the checkpoint and start at "
                       f"random: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
        if gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if on_meta:  # value head and backbone shards arrive from rank 0 (FSDP2Engine load_on_first)
            with torch.device("meta"):
                return cls(backbone, backbone.config.hidden_size)
        model = cls(backbone, backbone.config.hidden_size)
        head = os.path.join(path, "value_head.pt")
        if os.path.isfile(head):
            model.value_head.load_state_dict(torch.load(head, map_location="cpu"))
        elif is_reward_model(backbone.config):
            model.init_from_reward_head(reward_head_weight(path, value_head_prefix), reward_stats)
            print0(f"[critic] value head from the reward model's score head in {path} (normalised by mean "
                   f"{reward_stats[0]:g}, std {reward_stats[1]:g}): at step 1 the critic's value at a sequence's last "
                   f"token is the reward model's score")
        else:
            print0(f"[critic] value head starts at random (normal, std 1/(hidden+1), OpenRLHF's init_value_head): "
                   f"{path} is not a reward model (a reward model as --critic_pretrain starts it from its score head)")
        return model

    @torch.no_grad()
    def init_from_reward_head(self, weight: torch.Tensor, stats: Tuple[float, float] = (0.0, 1.0)) -> None:
        """value_head(h) = (w . h - mean) / std: the reward model's normalised score (its head has no bias)."""
        mean, std = float(stats[0]), float(stats[1])
        w = weight.reshape(self.value_head.weight.shape).to(torch.float32)
        self.value_head.weight.copy_(w / std)
        self.value_head.bias.fill_(-mean / std)

    def forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
        """V(s_t) for the states before each of the last num_actions tokens: (B, num_actions)."""
        if sp_of(self) is not None:  # --ring_attn_size: this rank's slice of the packed row (0 at response padding)
            return sp_values(self, sequences, attention_mask, num_actions)
        h = self.backbone(input_ids=sequences, attention_mask=attention_mask,
                          position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
        # a fresh tensor, not a view (squeeze): FSDP2 warns on every forward of a root module that returns a view
        return self.value_head(h[:, -num_actions - 1:-1])[..., 0].to(torch.float32, copy=True)

    def save_hf(self, state_dict: dict, tokenizer, path: str) -> None:
        """Write the backbone (HF safetensors) and ``value_head.pt`` beside ``path``, then put them in place
        (``checkpoint.install_export``: only an earlier export's files are replaced): the directory
        ``from_pretrained`` (and ``--critic_pretrain``) reads back.  ``state_dict``: the full weights."""
        from rlhf.checkpoint import begin_export, install_export

        tmp = begin_export(path)
        backbone = {k[len("backbone."):]: v for k, v in state_dict.items() if k.startswith("backbone.")}
        from rlhf.utils.quiet import quiet_save

        with quiet_save():
            self.backbone.save_pretrained(tmp, state_dict=backbone, safe_serialization=True)
        torch.save({k[len("value_head."):]: v for k, v in state_dict.items() if k.startswith("value_head.")},
                   os.path.join(tmp, "value_head.pt"))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        install_export(tmp, path)


def is_reward_model(config) -> bool:
    """A config saved by a sequence-classification reward model (HF *ForSequenceClassification, OpenRLHF's
    RewardModel / CriticModel): the architectures ``load.check_model_dir`` reads for --reward_pretrain."""
    from rlhf.models.load import REWARD_SUFFIXES

    return any(str(a).endswith(REWARD_SUFFIXES) for a in (getattr(config, "architectures", None) or []))


def reward_head_weight(path: str, value_head_prefix: Optional[str] = None) -> torch.Tensor:
    """The reward model's score head weight (1, hidden), by the name ``load_reward_model`` reads it
    (--value_head_prefix, config.json's value_head_prefix, else HF's 'score'): straight from the safetensors files
    (a hub name: those of its snapshot, which loading the backbone fetched), else (a .bin checkpoint) through
    ``load_reward_model`` on the CPU."""
    from rlhf.models.load import _head_key, load_reward_model, weight_index

    local = path
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        local = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
    files = weight_index(local)
    if files:
        from safetensors import safe_open

        key = _head_key(local, value_head_prefix)
        with safe_open(files[key], "pt") as f:
            return f.get_tensor(key)
    return load_reward_model(local, value_head_prefix=value_head_prefix)[0].score.weight.detach()
