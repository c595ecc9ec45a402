"""In-process (1 rank) checks: every estimator runs a step; packing equals padding for SFT/DPO losses."""
import os

import pytest
import torch
from helpers.net import free_port
from helpers.tasks import make_task


def _one_step(kit, tmp_path, estimator, extra=()):
    from rlhf.config import parse
    from rlhf.rl.trainer import run_rl

    os.environ.update(MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    d = os.path.join(kit, "data")
    cfg = parse("ppo", ["--pretrain", kit, "--prompt_data", f"{d}/prompts_train.jsonl", "--remote_rm_url",
                        "builtin:arithmetic", "--advantage_estimator", estimator, "--n_samples_per_prompt", "2",
                        "--rollout_batch_size", "4", "--train_batch_size", "8", "--generate_max_len", "4",
                        "--max_global_steps", "1", "--eval_steps", "0", "--log_dir", str(tmp_path / estimator),
                        "--save_path", str(tmp_path / f"m_{estimator}"), "--no_progress_bar", *extra])
    return run_rl(cfg, "ppo")


@pytest.mark.parametrize("estimator", ["gae", "reinforce", "reinforce_baseline", "group_norm", "dr_grpo", "rloo"])
def test_every_estimator_runs_one_step(tiny_kit, tmp_path, estimator):
    from rlhf.utils.logging import read_metrics

    extra = ("--overlong_buffer_len", "2", "--running_reward_norm", "--reward_clip_range", "-1", "1")
    if estimator == "dr_grpo":
        extra += ("--loss_agg_mode", "seq-mean-token-sum-norm", "--policy_loss_type", "gspo")
    if estimator == "reinforce":  # LoRA actor, 2 steps, 2 epochs: the engine must hold the merged weights
        extra += ("--lora_rank", "4", "--lora_alpha", "8", "--max_global_steps", "2", "--max_epochs", "2",
                  "--actor_learning_rate", "1e-2")
    if estimator == "group_norm":  # (dynamic filtering: tests/helpers/sweep.py, with a reward whose groups can pass)
        extra += ("--packing_samples",)
    if estimator == "rloo":
        extra += ("--dual_clip", "3", "--entropy_loss_coef", "0.01", "--enable_is_correction")
    _one_step(tiny_kit, tmp_path, estimator, extra)
    rows = [r for r in read_metrics(str(tmp_path / estimator / "metrics.jsonl")) if r["split"] == "train"]
    m = rows[0]
    assert m["step"] == 1
    bad = [k for k, v in m.items() if isinstance(v, float) and v != v]
    assert not bad, f"{estimator}: NaN metrics {bad}"
    assert ("value_loss" in m) == (estimator == "gae"), f"{estimator}: a critic trains only with gae"
    assert m["grad_norm"] > 0, f"{estimator}: the actor got no gradient"
    assert -1.0 - 1e-6 <= m["shaped_reward"] <= 1.0 + 1e-6 or estimator == "gae", \
        f"{estimator}: --reward_clip_range -1 1 not applied: shaped_reward {m['shaped_reward']}"
    if estimator == "gae":
        assert m["value_loss"] > 0 and m["critic_grad_norm"] > 0, "gae: the critic did not train"
    if estimator == "reinforce":
        assert rows[1]["approx_kl"] > 1e-4, "LoRA: the second epoch saw no policy change"
        assert rows[1]["rollout_logprob_gap"] < 1e-4, "LoRA: the engine did not get the merged adapter weights"
    if estimator == "rloo":
        assert "dual_clip_frac" in m and m["entropy"] > 0, "rloo: dual clip / entropy bonus not reported"
        assert m["rollout_logprob_gap"] < 1e-4, "IS correction: rollout and trainer log-probs differ on-policy"
        assert m["is_filter_ratio"] == 0.0, "on-policy, no token lies outside the tis band [0.5, 5]"


def test_packed_and_padded_losses_agree(tiny_kit):
    from rlhf.config import parse
    from rlhf.models.load import load_causal_lm, load_tokenizer
    from rlhf.supervised.tasks import DPOTask, SFTTask

    tok = load_tokenizer(tiny_kit, padding_side="right")
    model = load_causal_lm(tiny_kit)
    rows = [{"input": "1+2=", "output": "3", "chosen": "3", "rejected": "4"},
            {"input": "12+9=", "output": "21", "chosen": "21", "rejected": "2"}]
    for packing in (False, True):
        cfg = parse("sft", ["--no_progress_bar"] + (["--packing_samples"] if packing else []))
        sft = make_task(SFTTask, cfg, tok)
        loss, _ = sft.loss(model, [sft.make_sample(r) for r in rows])
        dpo = make_task(DPOTask, cfg, tok)
        pairs = [dpo.make_sample(r) for r in rows]
        pc, pr, _ = dpo.batch_logps(model, dpo.collate(pairs), len(pairs))
        if not packing:
            ref = (loss.item(), pc, pr)
    assert abs(loss.item() - ref[0]) < 1e-5
    assert torch.allclose(pc, ref[1], atol=1e-4) and torch.allclose(pr, ref[2], atol=1e-4)


@pytest.mark.parametrize("flags,check", [
    (["--lora_rank", "4", "--lora_alpha", "8"], "adapter_config.json"),
    (["--bf16", "--gradient_checkpointing"], "model.safetensors"),
])
def test_sft_lora_bf16_gradient_checkpointing(tiny_kit, tmp_path, flags, check):
    from rlhf.config import parse
    from rlhf.supervised.tasks import SFTTask
    from rlhf.supervised.trainer import run_supervised
    from rlhf.utils.logging import read_metrics

    os.environ.update(MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    d = os.path.join(tiny_kit, "data")
    cfg = parse("sft", ["--pretrain", tiny_kit, "--dataset", f"{d}/sft_train.jsonl", "--max_global_steps", "6",
                        "--train_batch_size", "16", "--micro_train_batch_size", "8", "--learning_rate", "3e-3",
                        "--log_dir", str(tmp_path / "l"), "--save_path", str(tmp_path / "m"), "--no_progress_bar",
                        *flags])
    run_supervised(cfg, SFTTask, "sft")
    rows = [r for r in read_metrics(str(tmp_path / "l" / "metrics.jsonl")) if r["split"] == "train"]
    assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"]
    assert os.path.isfile(tmp_path / "m" / check)


def test_rm_packed_scores_equal_padded_and_dpo_precomputed_reference(tiny_kit):
    from transformers import AutoModelForSequenceClassification

    from rlhf.config import parse
    from rlhf.models.load import load_causal_lm, load_tokenizer
    from rlhf.supervised.tasks import DPOTask, RMTask

    tok = load_tokenizer(tiny_kit, padding_side="right")
    rm = AutoModelForSequenceClassification.from_pretrained(os.path.join(tiny_kit, "reward"), num_labels=1)
    rm.config.pad_token_id = tok.pad_token_id
    rows = [{"input": "1+2=", "chosen": "3", "rejected": "4"}, {"input": "12+9=", "chosen": "21", "rejected": "2"}]
    out = []
    for packing in (False, True):
        task = make_task(RMTask, parse("rm", ["--packing_samples"] if packing else []), tok)
        with torch.no_grad():
            out.append(task.scores(rm, [task.make_sample(r) for r in rows]))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-4) and torch.allclose(out[0][1], out[1][1], atol=1e-4)
    # DPO with rows that carry the reference log-probs: the loss uses them (margins vs a policy == reference)
    model = load_causal_lm(tiny_kit)
    task = make_task(DPOTask, parse("dpo", []), tok)
    task.ref = None
    plain = [task.make_sample(r) for r in rows]
    pc, pr, _ = task.batch_logps(model, task.collate(plain), len(plain))
    pre = [task.make_sample(dict(r, ref_chosen_logps=float(c), ref_rejected_logps=float(j)))
           for r, c, j in zip(rows, pc.detach(), pr.detach())]
    loss, met = task.loss(model, pre)
    assert abs(loss.item() - 0.6931) < 1e-3 and met["reward_margin"] == pytest.approx(0.0, abs=1e-5)


def test_decode_queries_strips_prompt_padding_and_masked_response_tokens(tiny_kit):
    from rlhf.engines import Batch
    from rlhf.models.load import load_tokenizer
    from rlhf.rl.components import decode_queries

    tok = load_tokenizer(tiny_kit)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    p1, p2 = tok("3+4=")["input_ids"], tok("12+7=")["input_ids"]
    r1, r2 = tok("7", add_special_tokens=False)["input_ids"], tok("19", add_special_tokens=False)["input_ids"]
    P, R = max(len(p1), len(p2)), max(len(r1), len(r2)) + 1
    rows = []
    for p, r in ((p1, r1), (p2, r2)):
        rows.append(([pad] * (P - len(p)) + p + r + [eos] + [pad] * (R - len(r) - 1),
                     [0] * (P - len(p)) + [1] * len(p), [1] * (len(r) + 1) + [0] * (R - len(r) - 1)))
    seq = torch.tensor([r[0] for r in rows])
    pm = torch.tensor([r[1] for r in rows])
    am = torch.tensor([r[2] for r in rows])
    batch = Batch(sequences=seq, attention_mask=torch.cat([pm, am], 1), action_mask=am,
                  rollout_logprobs=torch.zeros(am.shape), prompt_len=P)
    queries, prompts = decode_queries(tok, batch, slice(0, 2))
    assert prompts == [tok.decode(p1), tok.decode(p2)]
    assert queries == [tok.decode(p1) + tok.decode(r1, skip_special_tokens=True),
                       tok.decode(p2) + tok.decode(r2, skip_special_tokens=True)]
    assert decode_queries(tok, batch, slice(1, 2))[1] == [tok.decode(p2)]


class _ModelOnMeta(torch.nn.Module):
    """A model that lives on the meta device (standing in for a GPU) and checks its inputs: every tensor it is
    given must be on its device, as CUDA weights require.  Its outputs (logits, scores) are meta tensors of the
    right shapes, built from its parameters, so every loss term downstream must be on its device too (meta and
    CPU tensors do not mix: the op raises)."""

    def __init__(self, vocab: int, reward: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(vocab if not reward else 1, device="meta"))
        self.score = torch.nn.Identity()
        self.reward = reward
        self.config = None
        self.seen = []

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=False, **_):
        for t in (input_ids, attention_mask, position_ids):
            if t is not None:
                self.seen.append(t.device.type)
                assert t.device == self.w.device, f"an input on {t.device} reached a model on {self.w.device}"
        z = input_ids.unsqueeze(-1).float() * 0 + self.w
        z = self.score(z)
        return type("Out", (), {"logits": z if not self.reward or position_ids is not None else z[:, -1]})()


@pytest.mark.parametrize("packing", [False, True])
def test_supervised_batches_reach_the_models_device(tiny_kit, packing):
    """SFT, RM and DPO (with a reference model and with precomputed reference log-probs): the collated batch
    (ids, masks, margins, reference log-probs) starts on the CPU and the model lives elsewhere (the meta device
    stands in for a GPU: a forward with CPU inputs on meta weights raises, as CUDA weights with CPU inputs do).
    Task.loss moves the batch, so every forward and every loss term sees the model's device."""
    from unittest import mock

    from rlhf.config import parse
    from rlhf.models.load import load_tokenizer
    from rlhf.supervised.tasks import DPOTask, RMTask, SFTTask

    tok = load_tokenizer(tiny_kit, padding_side="right")
    lm, ref, rm = _ModelOnMeta(len(tok)), _ModelOnMeta(len(tok)), _ModelOnMeta(len(tok), reward=True)
    rows = [{"input": "1+2=", "output": "3", "chosen": "3", "rejected": "4", "margin": 1.0,
             "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0},
            {"input": "12+9=", "output": "21", "chosen": "21", "rejected": "2", "margin": 0.5,
             "ref_chosen_logps": -3.0, "ref_rejected_logps": -1.5}]
    flags = ["--packing_samples"] if packing else []
    float_of = torch.Tensor.__float__
    seen = []

    def meta_float(t):  # metrics of a meta loss: no values exist, the shapes and devices are what is checked
        seen.append(t.device.type)
        return 0.0 if t.is_meta else float_of(t)

    with mock.patch.object(torch.Tensor, "__float__", meta_float):
        sft = make_task(SFTTask, parse("sft", flags), tok)
        rmt = make_task(RMTask, parse("rm", flags + ["--margin_loss", "--margin_key", "margin"]), tok)
        dpo = make_task(DPOTask, parse("dpo", flags), tok)
        dpo.ref = mock.Mock(model=ref)
        pre = make_task(DPOTask, parse("dpo", flags), tok)
        pre.ref = None
        for task, model in ((sft, lm), (rmt, rm), (dpo, lm), (pre, lm)):
            b = task.collate([task.make_sample(r) for r in rows])
            assert all(v.device.type == "cpu" for v in b.values() if torch.is_tensor(v))
            moved = task.batch(model, [task.make_sample(r) for r in rows])
            assert {v.device.type for v in moved.values() if torch.is_tensor(v)} == {"meta"}, task.name
            loss, met = task.loss(model, [task.make_sample(r) for r in rows])
            assert loss.is_meta and loss.dim() == 0, (task.name, loss)
    assert seen and set(seen) == {"meta"}, seen
    assert lm.seen and ref.seen and rm.seen and set(lm.seen + ref.seen + rm.seen) == {"meta"}


def test_supervised_learning_rate_defaults_are_openrlhfs():
    """A command that leaves --learning_rate out trains at OpenRLHF's rate (openrlhf/cli/train_sft.py 5e-6,
    train_rm.py 9e-6, train_dpo.py 1e-5), not the tiny demo's 1e-3 / 1e-4; the demo's YAML sets its own."""
    import yaml

    from rlhf.config import parse
    from rlhf.train_dpo import DEFAULTS as DPO
    from rlhf.train_rm import DEFAULTS as RM
    from rlhf.train_sft import DEFAULTS as SFT

    for kind, defaults, want in (("sft", SFT, 5e-6), ("rm", RM, 9e-6), ("dpo", DPO, 1e-5)):
        got = parse(kind, [], defaults).optim.learning_rate
        assert got == want, f"{kind}: default learning rate {got}, OpenRLHF's is {want}"
    with open("configs/sft_tiny.yaml") as fh:
        assert yaml.safe_load(fh)["optim"]["learning_rate"] == 3e-3, "the demo's SFT must set its own rate"


def test_rm_training_and_ppo_score_the_same_position_when_pad_is_eos(tiny_kit):
    """pad == eos (many chat checkpoints): RM training (padded and packed), PPO's reward role and serve_rm
    (score_sequences) read the score at one position, each sequence's last real token (OpenRLHF's
    ``eos_indices``), so the same sequences get the same scores; transformers' pad-id pooling would read the
    token before the eos (it did in training: scores uncorrelated with PPO's)."""
    from transformers import AutoModelForSequenceClassification

    from rlhf.config import parse
    from rlhf.data.formatting import pad_batch
    from rlhf.models.load import load_tokenizer
    from rlhf.rewards.reward_model import score_positions, score_sequences
    from rlhf.supervised.tasks import RMTask

    tok = load_tokenizer(tiny_kit, padding_side="right")
    tok.pad_token = tok.eos_token
    assert tok.pad_token_id == tok.eos_token_id
    rm = AutoModelForSequenceClassification.from_pretrained(os.path.join(tiny_kit, "reward"), num_labels=1).eval()
    rm.config.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    with torch.no_grad():  # a score head that tells positions apart
        rm.score.weight.normal_(0, 1.0)
    rows = [{"input": "1+2=", "chosen": "3", "rejected": "4"}, {"input": "12+9=", "chosen": "21", "rejected": "211"}]
    train = []
    for packing in (False, True):
        task = make_task(RMTask, parse("rm", ["--packing_samples"] if packing else []), tok)
        samples = [task.make_sample(r) for r in rows]
        with torch.no_grad():
            train.append(torch.cat(task.scores(rm, samples)))
    seqs = [s[0] for s in samples] + [s[1] for s in samples]
    assert all(s[-1] == tok.eos_token_id for s in seqs)
    ids, att = pad_batch(seqs, tok.pad_token_id, side="left")  # as PPO's rollouts and serve_rm's batches are
    ppo = score_sequences(rm, ids, att)
    assert torch.allclose(train[0], ppo, atol=1e-4), f"RM training scored {train[0]}, PPO / serve_rm {ppo}"
    assert torch.allclose(train[1], ppo, atol=1e-4), f"packed RM training scored {train[1]}, PPO / serve_rm {ppo}"
    with torch.no_grad():  # the pad-id pooling reads another position here: the test tells the two apart
        hf = rm(*pad_batch(seqs, tok.pad_token_id)).logits.squeeze(-1)
    assert not torch.allclose(hf, ppo, atol=1e-2), "pad-id pooling coincided with the eos position"
    assert score_positions(att).tolist() == [att.size(1) - 1] * len(seqs)
    assert score_positions(pad_batch(seqs, 0)[1]).tolist() == [len(s) - 1 for s in seqs]
    assert score_positions(seq_lens=[3, 2, 4]).tolist() == [2, 4, 8]
