"""SFT, reward-model and DPO tasks for the supervised loop."""
from __future__ import annotations

import json
import os

import torch

from rlhf.algorithms import logprobs_from_logits
from rlhf.algorithms.preference import REWARD_MODEL_LOSSES, dpo_loss, sft_token_loss
from rlhf.data.formatting import collate_packed, collate_supervised, format_prompt, format_response, pad_batch, pair_texts, tokenize_pair
from rlhf.data.images import collate_images, image_pair
from rlhf.data.sft_modes import mode_of, mode_sample
from rlhf.distributed.sequence_parallel import sp_of
from rlhf.models.forward import sp_token_logprobs
from rlhf.models.lm_head import KEEP_BYTES, fusable_head, head_logprobs, head_params, head_removed
from rlhf.models.load import RM_NORM_FILE, apply_lora, attn_implementation, from_pretrained_or_meta, load_causal_lm, weight_dtype
from rlhf.models.vision import sample_has_images, supervised_vision_kwargs
from rlhf.supervised.trainer import Task


def _prompt(d, tok, row):
    return format_prompt(row[d.input_key], tok, d.apply_chat_template, d.input_template)


def _response(d, tok, row, key: str) -> str:
    """The row's response under the flag ``key`` (output_key / chosen_key / rejected_key) of the data group ``d`` as
    text; message lists through the chat template (rlhf.data.formatting.format_response)."""
    return format_response(row[getattr(d, key)], row[d.input_key], tok, d.apply_chat_template, key)


def token_logprobs(model, batch, chunk: int, fused: bool = True, keep_bytes: int = KEEP_BYTES):
    """Per-token log p(x_{t+1} | x_<=t) aligned with loss_mask[:, 1:] (padded or packed batch).

    With a plain-Linear LM head only the loss_mask positions are computed, fused and chunked (no (B, T, V)
    logits; rlhf.models.lm_head) and the other positions are 0; otherwise every position from full logits.
    """
    if sp_of(model) is not None:  # --ring_attn_size: this rank's slice of the packed row, summed over the group
        return sp_token_logprobs(model, batch, chunk, keep_bytes)
    kw = {"input_ids": batch["input_ids"]}
    if "position_ids" in batch:
        kw["position_ids"] = batch["position_ids"]
    else:
        kw["attention_mask"] = batch["attention_mask"]
    kw.update(supervised_vision_kwargs(model, batch))  # a vision-language model's images and mrope positions
    head = fusable_head(model) if fused else None
    if head is not None:
        with head_removed(model, head):
            hs = model(**kw, use_cache=False).logits[:, :-1]
        keep = batch["loss_mask"][:, 1:].bool()
        lp, _ = head_logprobs(hs[keep], *head_params(head), batch["input_ids"][:, 1:][keep], 1.0, chunk,
                              keep_bytes=keep_bytes)
        return torch.zeros(keep.shape, dtype=lp.dtype, device=lp.device).masked_scatter(keep, lp)
    logits = model(**kw, use_cache=False).logits[:, :-1]
    return logprobs_from_logits(logits, batch["input_ids"][:, 1:], chunk)


def _collate(packing: bool, tok, samples):
    if packing:
        b = {**collate_packed(samples), **collate_images(samples)}
        # never predict a sample's first token from the previous sample's last one
        lm = b["loss_mask"].clone()
        lm[0, 1:][b["segment_ids"][0, 1:] != b["segment_ids"][0, :-1]] = 0
        b["loss_mask"] = lm
        return b
    return {**collate_supervised(samples, tok.pad_token_id), **collate_images(samples)}


def build_policy(m, path: str, on_meta: bool = False, freeze_visual: bool = False):
    """The trainable causal LM of SFT and DPO (LoRA, bf16, flash-attention, checkpointing from the model group;
    ``freeze_visual``: --freeze_visual_encoder)."""
    return load_causal_lm(path, m.bf16, m.flash_attn, m.gradient_checkpointing, m.lora_rank, m.lora_alpha,
                          m.target_modules, on_meta=on_meta, freeze_visual=freeze_visual, load_in_4bit=m.load_in_4bit)


class SFTTask(Task):
    name = "sft"
    required_keys = {"input_key": None, "output_key": None}

    def __init__(self, model_config, data, algorithm, tokenizer):
        super().__init__(model_config, data, algorithm, tokenizer)
        if mode_of(data, model_config.pretrain_mode):  # --multiturn / --pretrain_mode: all in --input_key (data.sft_modes)
            self.required_keys = {"input_key": None}

    def build_model(self, path, on_meta=False):
        return build_policy(self.model_config, path, on_meta, self.freeze_visual)

    def make_sample(self, row):
        """(input_ids, loss_mask): prompt -> response (loss on the response and eos), or under --multiturn every
        assistant turn, under --pretrain_mode every token (rlhf.data.sft_modes)."""
        mode = mode_of(self.data, self.model_config.pretrain_mode)
        if sample_has_images(self, row, mode):
            return image_pair(self.images, row, _response(self.data, self.tokenizer, row, "output_key"), self.tokenizer,
                              self.data)
        if mode:
            return mode_sample(row, self.tokenizer, self.data, mode)[:2]
        return tokenize_pair(self.tokenizer, _prompt(self.data, self.tokenizer, row),
                             _response(self.data, self.tokenizer, row, "output_key"), self.data.max_len)

    def collate(self, samples):
        return _collate(self.model_config.packing_samples, self.tokenizer, samples)

    def compute(self, model, b):
        lp = token_logprobs(model, b, self.model_config.logprob_chunk_size, keep_bytes=self.model_config.lm_head_keep_bytes)
        loss = sft_token_loss(lp, b["loss_mask"][:, 1:])
        return loss, {"loss": float(loss.detach())}


class RMTask(Task):
    name = "rm"
    required_keys = {"input_key": None, "chosen_key": None, "rejected_key": None}

    def build_model(self, path, on_meta=False):
        from transformers import AutoModelForSequenceClassification

        m = from_pretrained_or_meta(AutoModelForSequenceClassification, path, on_meta, {"num_labels": 1},
                                    dtype=weight_dtype(self.model_config.bf16, trainable=True,
                                                       lora=self.model_config.lora_rank > 0),  # frozen base: bf16
                                    attn_implementation=attn_implementation(self.model_config.flash_attn))
        m.config.pad_token_id = self.tokenizer.pad_token_id
        if self.model_config.gradient_checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.model_config.lora_rank > 0:  # OpenRLHF get_llm_for_sequence_regression(lora_rank=...); head trained too
            c = self.model_config
            m = apply_lora(m, c.lora_rank, c.lora_alpha, c.target_modules, task_type="SEQ_CLS")
        return m

    def __init__(self, model_config, data, algorithm, tokenizer):
        super().__init__(model_config, data, algorithm, tokenizer)
        if algorithm.margin_loss:  # per-pair margin from the data (OpenRLHF --margin_loss)
            self.required_keys = {**type(self).required_keys, "margin_key": None}

    def make_sample(self, row):
        d, tok = self.data, self.tokenizer
        p, chosen, rejected = pair_texts(row, tok, d, is_dpo=False)  # rows without a prompt column: OpenRLHF's
        c = tokenize_pair(tok, p, chosen, d.max_len)[0]
        r = tokenize_pair(tok, p, rejected, d.max_len)[0]
        if self.algorithm.margin_loss:
            return c, r, float(row[d.margin_key])
        return c, r

    def margins(self, samples):
        """Per-pair margins (--margin_loss: the data's --margin_key column), else the constant --margin."""
        if self.algorithm.margin_loss:
            return torch.tensor([float(s[2]) for s in samples])
        return self.algorithm.margin

    def collate(self, samples):
        """[chosen..., rejected...] padded (or packed into one row with each sequence's length in ``seq_lens``),
        and the pairs' margins as a (n,) tensor."""
        seqs = [s[0] for s in samples] + [s[1] for s in samples]
        n = len(samples)
        m = self.margins(samples)
        b = {"margin": m.float() if torch.is_tensor(m) else torch.full((n,), float(m))}
        if self.model_config.packing_samples:
            p = collate_packed([(s, [1] * len(s)) for s in seqs])
            b.update(input_ids=p["input_ids"], position_ids=p["position_ids"],
                     seq_lens=torch.tensor([len(s) for s in seqs]))
        else:
            b["input_ids"], b["attention_mask"] = pad_batch(seqs, self.tokenizer.pad_token_id)
        return b

    def scores(self, model, samples):
        """(chosen, rejected) scores of a list of pairs."""
        return self.batch_scores(model, self.batch(model, samples))

    @staticmethod
    def batch_scores(model, b):
        """(chosen, rejected) scores of a collated batch, read where PPO and serve_rm read them
        (rlhf.rewards.reward_model.score_positions: each sequence's last real token, OpenRLHF's ``eos_indices``),
        never by transformers' pad-id pooling, which lands before the eos when pad == eos."""
        from rlhf.rewards.reward_model import scores_at_positions

        if "seq_lens" in b:
            out = scores_at_positions(model, b["input_ids"], position_ids=b["position_ids"], seq_lens=b["seq_lens"])
        else:
            out = scores_at_positions(model, b["input_ids"], b["attention_mask"])
        n = out.size(0) // 2
        return out[:n], out[n:]

    def compute(self, model, b):
        a = self.algorithm
        c, r = self.batch_scores(model, b)
        loss = REWARD_MODEL_LOSSES.get_fn(a.rm_loss)(c, r, b["margin"]).mean()
        c, r = c.detach(), r.detach()  # metrics: float() of a graph tensor warns on every rank
        return loss, {"loss": float(loss.detach()), "acc": float((c > r).float().mean()),
                      "margin": float((c - r).mean()), "chosen_reward": float(c.mean()),
                      "rejected_reward": float(r.mean())}

    @torch.no_grad()
    def after_fit(self, trainer):
        """Save reward mean/std over the eval (or train) pairs so PPO can normalise scores."""
        from rlhf.distributed import comm, micro_plan

        samples = trainer.eval_samples or trainer.train_samples
        vals = []
        trainer.engine.model.eval()
        for part in micro_plan(len(samples), trainer.rank, trainer.world, trainer.cfg.optim.micro_train_batch_size):
            c, r = self.scores(trainer.engine.model, samples[part] if part is not None else samples[:1])
            if part is not None:  # the same number of forwards on every rank (FSDP collectives); dummies dropped
                vals += c.tolist() + r.tolist()
        t = torch.tensor([sum(vals), sum(v * v for v in vals), len(vals)], dtype=torch.float64)
        comm.all_reduce(t)
        mean = t[0] / t[2]
        std = (t[1] / t[2] - mean ** 2).clamp(min=1e-12).sqrt()
        if trainer.rank == 0:
            with open(os.path.join(trainer.cfg.checkpoint.save_path, RM_NORM_FILE), "w") as fh:
                json.dump({"mean": float(mean), "std": float(std)}, fh)


class DPOTask(Task):
    name = "dpo"
    required_keys = {"input_key": None, "chosen_key": None, "rejected_key": None}

    def build_model(self, path, on_meta=False):
        return build_policy(self.model_config, path, on_meta, self.freeze_visual)

    REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")

    def needs_reference(self, samples):
        """A reference forward unless every row carries precomputed reference log-probs (--ref_pretrain, default
        --pretrain: rlhf.roles.reference)."""
        return not all(s[2] is not None for s in samples)

    def make_sample(self, row):
        d, tok = self.data, self.tokenizer
        p, chosen, rejected = pair_texts(row, tok, d, is_dpo=True)  # rows without a prompt column: OpenRLHF's
        ref = tuple(float(row[k]) for k in self.REF_KEYS) if all(row.get(k) is not None for k in self.REF_KEYS) \
            else None
        if sample_has_images(self, row, None):
            return image_pair(self.images, row, chosen, tok, d), image_pair(self.images, row, rejected, tok, d), ref
        return tokenize_pair(tok, p, chosen, d.max_len), tokenize_pair(tok, p, rejected, d.max_len), ref

    def collate(self, samples):
        """One batch of [chosen..., rejected...] for the policy and the reference alike; ``ref``: the rows'
        precomputed (chosen, rejected) reference log-probs, (n, 2), when every row has them."""
        b = _collate(self.model_config.packing_samples, self.tokenizer, [s[0] for s in samples] + [s[1] for s in samples])
        b["n_pairs"] = len(samples)
        if all(s[2] is not None for s in samples):
            b["ref"] = torch.tensor([s[2] for s in samples], dtype=torch.float32)
        return b

    def batch_logps(self, model, b, n: int):
        """Summed response log-probs of a collated batch of n pairs: (chosen, rejected, chosen token counts)."""
        lp = token_logprobs(model, b, self.model_config.logprob_chunk_size, keep_bytes=self.model_config.lm_head_keep_bytes)
        mask = b["loss_mask"][:, 1:].float()
        if "segment_ids" in b:
            seg = b["segment_ids"][0, 1:]
            sums = torch.zeros(2 * n, dtype=lp.dtype, device=lp.device).index_add(0, seg, (lp * mask)[0])
            cnt = torch.zeros(2 * n, device=lp.device).index_add(0, seg, mask[0])
        else:
            sums, cnt = (lp * mask).sum(1), mask.sum(1)
        return sums[:n], sums[n:], cnt[:n]

    def compute(self, model, b):
        a = self.algorithm
        n = b["n_pairs"]
        pc, pr, nc = self.batch_logps(model, b, n)
        if self.ref is None:  # precomputed (rows' ref_chosen_logps / ref_rejected_logps)
            rc, rr = b["ref"][:, 0], b["ref"][:, 1]
        else:
            with torch.no_grad():
                rc, rr, _ = self.batch_logps(self.ref.model, b, n)
        losses, cr, rj = dpo_loss(a.loss_type, pc, pr, rc, rr, a.beta, a.label_smoothing)
        loss = losses.mean()
        if a.nll_loss_coef > 0:
            loss = loss + a.nll_loss_coef * (-(pc / nc.clamp(min=1))).mean()
        return loss, {"loss": float(loss.detach()), "reward_acc": float((cr > rj).float().mean()),
                      "reward_margin": float((cr - rj).mean()), "chosen_reward": float(cr.mean()),
                      "rejected_reward": float(rj.mean())}
