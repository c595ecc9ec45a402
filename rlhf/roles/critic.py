"""The critic: the value role, which owns its update and exports its backbone with the value head.

One ``update(batch, kl_coef, step)`` runs ``--max_epochs`` passes over the step's rows (``ppo_update``), each
micro-batch's loss the clipped value loss (rlhf.algorithms.value_loss; OpenRLHF ``CriticPPOTrainer``):

    value_loss = 1/2 * agg(max((V - R)^2, (clip(V, V_old - value_clip, V_old + value_clip) - R)^2))
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict

from rlhf.algorithms import value_loss
from rlhf.roles.update_batches import UpdatingRole, mean_logs, micro_batch, padding_counts, step_batches, step_totals, token_budget


class Critic(UpdatingRole):
    """The value model (rlhf.models.critic.CriticModel).  ``algo``: the config's algorithm section (value_clip);
    ``settings``: ``UpdateSettings``."""

    def update(self, batch, kl_coef: float, step: int) -> Dict[str, float]:
        """One RL step's optimizer steps on ``batch`` (sequences, attention_mask, action_mask, values, returns);
        ``kl_coef`` unused (the same call as ``Actor.update``); this rank's metrics, prefixed critic_ where the
        actor has the same name."""
        engine, world = self.engine, self.dp_size
        model = engine.model
        model.train()
        dev = engine.compute_device  # not the parameters' device: --adam_offload keeps FSDP2's shards on the host
        scale = engine.accum_steps * world
        logs, pad = defaultdict(list), [0.0, 0.0]
        dyn = token_budget(self.settings, batch)
        if dyn is not None:  # the critic's forward is padded (no packed path): budget rows x padded width
            dyn = dyn._replace(packed=False)
        for micro_rows in step_batches(self.settings, batch.sequences.size(0), self.dp_index, world,
                                       step * 1000 + 7, dyn):
            tot = step_totals([batch.action_mask[mr.rows] for mr in micro_rows if mr.real], self.group, self.mesh.replicas)
            total = 0.0
            for i, mr in enumerate(micro_rows):
                mb = micro_batch(batch, mr, dyn)
                for j, c in enumerate(padding_counts(mb, False, mr.real)):
                    pad[j] += c
                mask = mb.action_mask.to(dev).float()
                v = model(mb.sequences.to(dev), mb.attention_mask.to(dev), mb.action_mask.size(1))
                loss, met = value_loss(v, mb.values.to(dev), mb.returns.to(dev), mask, self.algo.value_clip, totals=tot)
                engine.backward(loss * scale * float(mr.real), i,
                                last=i == len(micro_rows) - 1 if dyn is not None else None)
                if not mr.real:
                    continue
                total += float(loss.detach())
                for k, val in met.items():
                    logs[k].append(val)
            logs["value_loss"].append(total * world)
            for k, val in engine.step().items():
                logs[f"critic_{k}"].append(val)
        out = mean_logs(logs)
        out["critic_padding_frac"] = 1.0 - pad[0] / pad[1] if pad[1] else 0.0
        return out

    def export(self, path: str, tokenizer) -> None:
        """The backbone (HF) and the value head, the directory --critic_pretrain reads back (OpenRLHF writes the
        critic to ``<save_path>_critic`` too): gathered over the members, written by the first."""
        if self.is_member:
            sd = self.engine.full_state_dict()
            if self.rank == self.members[0]:
                self.engine.model.save_hf(sd, tokenizer, path)


def load_critic(m, normalize_reward: bool, path: str, on_meta: bool = False):
    """The critic from --critic_pretrain (default ``path``, --pretrain).  A reward model there gives the value head
    its score head, normalised as the reward role normalises scores (``reward_model_stats``), so at step 1 the
    critic's value at a sequence's last token is the reward role's score (rlhf.models.critic).  ``m``: the model
    group; ``normalize_reward``: --normalize_reward."""
    from rlhf.models.critic import CriticModel
    from rlhf.models.load import saved_reward_stats
    from rlhf.rewards.reward_model import reward_model_stats

    src = m.critic_pretrain or path
    return CriticModel.from_pretrained(src, m.gradient_checkpointing, on_meta=on_meta, flash_attn=m.flash_attn,
                                       value_head_prefix=m.value_head_prefix,
                                       reward_stats=reward_model_stats(normalize_reward, saved_reward_stats(src)))
