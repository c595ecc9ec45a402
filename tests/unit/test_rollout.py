"""HF engine contract, packed vs padded log-probs, agent episodes' token masks."""
import torch
from helpers.engine_standin import StandInEngine

from rlhf.engines import Batch, HFEngine, SamplingParams, response_mask
from rlhf.models.forward import action_logprobs, packed_action_logprobs
from rlhf.models.load import load_causal_lm, load_tokenizer


def _engine(kit):
    m = load_causal_lm(kit)
    m.config.use_cache = True
    return HFEngine(m, load_tokenizer(kit), micro_batch_size=8)


def test_response_mask_stops_after_first_eos():
    m = response_mask(torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8]]), (2,))
    assert m.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_hf_engine_greedy_deterministic_n_samples_eos_and_logprobs(tiny_kit):
    eng = _engine(tiny_kit)
    tok = eng.tokenizer
    prompts = [tok("3+4=")["input_ids"], tok("12+7=")["input_ids"], tok("1+1=")["input_ids"]]
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=6)
    a, b = eng.generate(prompts, greedy), eng.generate(prompts, greedy)
    assert a.sequences.shape[0] == 6 and torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.sequences[0], a.sequences[1])  # greedy: both samples of a prompt agree
    # sampling: n rows per prompt, prompt-major, reproducible with a seed, stop at eos
    p = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=7)
    s1, s2 = eng.generate(prompts, p), eng.generate(prompts, p)
    assert torch.equal(s1.sequences, s2.sequences) and s1.sequences.shape[0] == 12
    P = s1.prompt_len
    for i in range(12):
        resp = s1.sequences[i, P:]
        n = int(s1.action_mask[i].sum())
        eos_pos = (resp == tok.eos_token_id).nonzero()
        if len(eos_pos):
            assert n == int(eos_pos[0]) + 1 and not s1.truncated[i]
            assert (resp[n:] == tok.pad_token_id).all()
        else:
            assert n == resp.numel() and s1.truncated[i]
    for i in range(4):  # rows 0-3 carry prompt 0
        real = s1.sequences[i, :P][s1.attention_mask[i, :P].bool()]
        assert real.tolist() == prompts[0]
    # rollout log-probs equal a teacher-forced forward of the same weights
    lp, _ = action_logprobs(eng.model, s1.sequences, s1.attention_mask, s1.num_actions, temperature=1.0)
    assert torch.allclose(lp * s1.action_mask, s1.rollout_logprobs, atol=1e-4)
    packed, pent = packed_action_logprobs(eng.model, s1.sequences, s1.attention_mask, s1.action_mask,
                                          with_entropy=True)
    assert torch.allclose(packed * s1.action_mask, s1.rollout_logprobs, atol=1e-4)
    _, ent = action_logprobs(eng.model, s1.sequences, s1.attention_mask, s1.num_actions, with_entropy=True)
    assert torch.allclose(pent * s1.action_mask, ent * s1.action_mask, atol=1e-4)


def test_temperature_logprobs_consistent(tiny_kit):
    eng = _engine(tiny_kit)
    prompts = [eng.tokenizer("5+5=")["input_ids"]]
    b = eng.generate(prompts, SamplingParams(n=3, temperature=0.7, max_new_tokens=5, seed=1))
    lp, _ = action_logprobs(eng.model, b.sequences, b.attention_mask, b.num_actions, temperature=0.7)
    assert torch.allclose(lp * b.action_mask, b.rollout_logprobs, atol=1e-4)


class ScriptedEngine(StandInEngine):
    """Returns scripted action tokens per call, shaped like a real engine's output."""

    def __init__(self, turns, eos):
        self.turns, self.calls, self.eos = turns, 0, eos

    def generate(self, prompt_ids, params):
        acts = self.turns[self.calls]
        self.calls += 1
        P = max(len(p) for p in prompt_ids)
        R = max(len(a) for a in acts)
        B = len(prompt_ids)
        seq = torch.zeros((B, P + R), dtype=torch.long)
        am = torch.zeros((B, R), dtype=torch.long)
        for i, (p, a) in enumerate(zip(prompt_ids, acts)):
            seq[i, P - len(p):P] = torch.tensor(p)
            seq[i, P:P + len(a)] = torch.tensor(a)
            am[i, :len(a)] = 1
        lp = -0.5 * am.float()
        return Batch(sequences=seq, attention_mask=(seq != 0).long(), action_mask=am, rollout_logprobs=lp,
                     prompt_len=P, truncated=torch.zeros(B, dtype=torch.bool))


def test_agent_episode_token_and_action_masks(tiny_kit):
    import os

    from rlhf.agents.base import AgentExecutorBase
    from rlhf.agents.load import load_agent

    tok = load_tokenizer(tiny_kit)
    inst, exe = load_agent(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agent_arithmetic.py"))
    assert exe is AgentExecutorBase
    eos = tok.eos_token_id
    wrong, right = tok("9", add_special_tokens=False)["input_ids"] + [eos], tok("7", add_special_tokens=False)["input_ids"] + [eos]
    prompt = tok("3+4=", add_special_tokens=False)["input_ids"]
    fb = tok(" wrong, again:", add_special_tokens=False)["input_ids"]
    # two episodes: first right at once, second wrong then right
    engine = ScriptedEngine([[right, wrong], [right]], eos)
    ex = exe(inst, max_steps=3, max_length=64, engine=engine, tokenizer=tok)
    batch = ex.run([prompt], ["3+4="], ["7"], SamplingParams(n=2, max_new_tokens=4))
    P = batch.prompt_len
    r0 = batch.sequences[0, P:][batch.attention_mask[0, P:].bool()].tolist()
    r1 = batch.sequences[1, P:][batch.attention_mask[1, P:].bool()].tolist()
    assert r0 == right
    assert r1 == wrong + fb + right
    n1 = len(r1)
    assert batch.action_mask[1, :n1].tolist() == [1] * len(wrong) + [0] * len(fb) + [1] * len(right)
    assert batch.action_mask[0, :len(right)].tolist() == [1] * len(right) and batch.action_mask[0, len(right):].sum() == 0
    assert torch.allclose(batch.rollout_logprobs[1, :n1], -0.5 * batch.action_mask[1, :n1].float())
    assert batch.rewards.tolist() == [1.0, 0.5] and batch.scores.tolist() == [1.0, 1.0]
    assert engine.calls == 2  # the finished episode does not generate again


def test_top_k_top_p_filter_matches_hf_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from rlhf.engines.sampling import top_k_top_p_filter

    torch.manual_seed(0)
    z = torch.randn(16, 50) * 3
    for k, p in [(5, 1.0), (0, 0.9), (10, 0.5), (0, 0.01), (50, 1.0)]:
        ref = z.clone()
        if k > 0:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1.0:
            ref = TopPLogitsWarper(p)(None, ref)
        assert torch.equal(torch.isinf(top_k_top_p_filter(z, k, p)), torch.isinf(ref)), (k, p)
    # hand case: probs .5 .3 .15 .05 with top_p .7 keeps the first two; top_k 1 keeps the argmax
    z = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.isfinite(top_k_top_p_filter(z, 0, 0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_k_top_p_filter(z, 1, 1.0)).tolist() == [[True, False, False, False]]


def test_inverse_cdf_sampler_frequencies_and_zero_mass():
    from rlhf.engines.sampling import sample_inverse_cdf

    p = torch.tensor([0.1, 0.0, 0.6, 0.3])
    g = torch.Generator().manual_seed(0)
    draws = sample_inverse_cdf(p.expand(100000, 4).contiguous(), g).squeeze(1)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[1] == 0  # a token with zero probability is never drawn
    assert torch.allclose(freq, p, atol=0.005)
    # unnormalised weights give the same distribution; the same generator seed gives the same draws
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(sample_inverse_cdf(p.expand(50, 4) * 7, g1), sample_inverse_cdf(p.expand(50, 4), g2))


def test_two_level_sampler_is_the_single_level_inverse_cdf_over_many_blocks():
    """V = 1300 (past SMALL_VOCAB, where one level is used): five full 256-token blocks and a short one,
    zero-mass tokens at block edges and whole zero blocks.  For the same uniforms the two-level draw is the index
    a plain cumsum + searchsorted gives, and the sampled log-prob is log_softmax(z / T)[token]."""
    from rlhf.engines import sampling
    from rlhf.engines.sampling import next_tokens, sample_inverse_cdf

    assert sampling.BLOCK == 256 and sampling.SMALL_VOCAB < 1300
    g = torch.Generator().manual_seed(0)
    B, V = 4000, 1300
    p = torch.rand(B, V, generator=g) ** 4
    p[:, 255] = 0  # last of block 0
    p[:, 256] = 0  # first of block 1
    p[:, 1024:] = 0  # the last full block and the short one hold nothing ...
    p[:7, 1299] = 1e4  # ... except in a few rows, where the vocabulary's last index holds ~99% of the mass
    two = sample_inverse_cdf(p, torch.Generator().manual_seed(5)).squeeze(1)
    u = torch.rand((B, 1), generator=torch.Generator().manual_seed(5))
    cdf = p.double().cumsum(-1)
    one = torch.searchsorted(cdf, u.double() * cdf[:, -1:], right=True).squeeze(1)
    agree = (two == one).float().mean().item()
    assert agree > 0.999, f"two-level and single-level inverse CDF agree on only {agree:.4f} of draws"
    assert bool((p.gather(1, two[:, None]) > 0).all()), "a zero-mass token was drawn"
    assert int((two[:7] == 1299).sum()) >= 5 and int((two[7:] >= 1024).sum()) == 0
    # next_tokens: the log-prob of the drawn token under the full temperature-scaled distribution
    z = torch.randn(64, V, generator=g) * 4
    for T in (1.0, 0.7):
        tok, lp = next_tokens(z, T, 0, 1.0, torch.Generator().manual_seed(1))
        want = torch.log_softmax(z / T, -1).gather(1, tok).squeeze(1)
        assert torch.allclose(lp, want, atol=1e-5), f"sampled log-probs differ from log_softmax at T={T}"


def test_decode_loop_greedy_equals_hf_generate_and_stops_rows_early(sft_model):
    """Mixed prompt lengths (left padding), n > 1, rows stopping at different steps and leaving the batch."""
    from rlhf.data.formatting import pad_batch
    from rlhf.engines.sampling import decode

    eng = _engine(sft_model)
    tok, m = eng.tokenizer, eng.model
    prompts = [tok(t)["input_ids"] for t in ("3+4=", "12+17=", "1+1=", "100+23=", "45+56=")]
    ids, att = pad_batch(prompts, tok.pad_token_id, side="left")
    assert not att.all()
    ref = m.generate(input_ids=ids, attention_mask=att, max_new_tokens=12, do_sample=False,
                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, ids.size(1):]
    resp, lp = decode(m, ids, att, 2, 12, (tok.eos_token_id,), tok.pad_token_id, temperature=0.0)
    steps = resp.size(1)
    assert steps == ref.size(1)
    assert torch.equal(resp[::2], ref) and torch.equal(resp[1::2], ref)
    am = response_mask(resp, (tok.eos_token_id,))
    lens = am.sum(1)
    assert len(set(lens.tolist())) > 1 and steps < 12  # rows left the batch at different steps; the loop ended early
    assert (lp[am == 0] == 0).all() and (resp[am == 0] == tok.pad_token_id).all()
    full, _ = action_logprobs(m, torch.cat([ids.repeat_interleave(2, 0), resp], 1),
                              torch.cat([att.repeat_interleave(2, 0), am], 1), steps)
    assert torch.allclose(full * am, lp, atol=1e-4)
    # sampling with top-k 1 is greedy whatever the seed
    r1, _ = decode(m, ids, att, 2, 12, (tok.eos_token_id,), tok.pad_token_id, temperature=1.0, top_k=1,
                      generator=torch.Generator().manual_seed(5))
    assert torch.equal(r1, resp)


def test_decode_loop_sliding_window_model_equals_hf_generate():
    """A sliding-window model (window 4 < sequence length): the cache is laid out like generate's."""
    from transformers import MistralConfig, MistralForCausalLM

    from rlhf.engines.sampling import decode

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4, pad_token_id=0, eos_token_id=1)
    m = MistralForCausalLM(cfg).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    att = (ids != 0).long()
    ref = m.generate(input_ids=ids, attention_mask=att, max_new_tokens=10, do_sample=False, pad_token_id=0,
                     eos_token_id=1)[:, 5:]
    out, _ = decode(m, ids, att, 1, 10, (1,), 0, temperature=0.0)
    assert out.size(1) == ref.size(1) and torch.equal(out, ref)
    assert (ref == 1).any(1).tolist() == [True, False]  # row 0 stopped early and left the batch
