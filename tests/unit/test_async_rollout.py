"""The asynchronous rollout stream (rlhf.rl.stream) and its flags, on a scripted engine: rounds, partial
rollout (continued samples equal one-shot ones, token by token, with each token's weight version), oversampling,
streaming rewards with dynamic filtering, bounded staleness, and the age metrics; against hand computations."""
import pytest
import torch
from helpers.engine_standin import StandInEngine

from rlhf.config import TrainConfig
from rlhf.config.validate import ConfigError, default_staleness
from rlhf.engines.rollout import Batch, SamplingParams, batch_from_rows
from rlhf.rl.stream import RolloutStream, age_metrics, groups_to_batch, sample_ages

STOP = 2


class ScriptedEngine(StandInEngine):
    """rlhf.engines.rollout.RolloutEngine.generate's contract (prompts in, left-padded prompt | right-padded response,
    action mask on the generated tokens incl. the stop token, ``truncated`` when no stop token came within
    max_new_tokens, per-token log-probs), with a scripted policy: a context whose first id is L continues with
    token f(context) until it is L long, then emits STOP; the log-prob of a token is -0.01 x (its context length)
    - 0.001 x weight version.  So a continued sample must equal a one-shot one token by token, and the log-probs
    say which weights produced each token."""

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, prompt_ids, params: SamplingParams) -> Batch:
        assert params.n == 1
        self.calls.append((len(prompt_ids), params.max_new_tokens))
        resps, lps, trunc = [], [], []
        for p in prompt_ids:
            ctx, r, lp = list(p), [], []
            for _ in range(params.max_new_tokens):
                tok = STOP if len(ctx) >= ctx[0] else 10 + (sum(ctx) * 31 + len(ctx)) % 50
                r.append(tok)
                lp.append(-0.01 * len(ctx) - 0.001 * self.version)
                ctx.append(tok)
                if tok == STOP:
                    break
            resps.append(r)
            lps.append(lp)
            trunc.append(STOP not in r)
        return batch_from_rows(prompt_ids, resps, lps, trunc, 0)


def one_shot(prompt, max_new):
    return ScriptedEngine().generate([prompt], SamplingParams(n=1, max_new_tokens=max_new))


def stream(lengths, **kw):
    """A stream over prompts [L, 5, 6] for L in ``lengths`` (cycled); returns (stream, engine)."""
    eng = ScriptedEngine()
    state = {"i": 0}

    def draw():
        i = state["i"]
        state["i"] += 1
        return i, [lengths[i % len(lengths)], 5, 6]

    args = dict(n=2, capacity=2, quota=2, max_new_tokens=12, chunk=None, max_staleness=10)
    args.update(kw)
    return RolloutStream(eng, draw, **args), eng


PARAMS = SamplingParams(n=2, max_new_tokens=12, stop_token_ids=(STOP,))


def test_whole_rounds_finish_every_sample_in_one_call():
    s, eng = stream([6, 9], capacity=3)
    groups, stats = s.produce(version=0, train_at=1, params=PARAMS)
    assert [g.index for g in groups] == [0, 1] and [g.index for g in s.buffer] == [2]  # oversampled extra waits
    assert eng.calls == [(6, 12)] and stats.rounds == 1 and not s.flight
    for g in groups:
        ref = one_shot(g.prompt_ids, 12)
        k = int(ref.action_mask[0].sum())
        for smp in g.samples:
            assert smp.tokens == ref.sequences[0, ref.prompt_len:ref.prompt_len + k].tolist()
            assert smp.tokens[-1] == STOP and not smp.truncated and smp.versions == [0] * k
    # the next batch takes the buffered group first, then generates the rest
    groups2, stats2 = s.produce(version=1, train_at=2, params=PARAMS)
    assert [g.index for g in groups2] == [2, 3] and stats2.drawn_prompts == 3  # topped up to capacity
    assert [g.index for g in s.buffer] == [4, 5]


def test_partial_rollout_continues_token_by_token_across_weight_versions():
    """A long sample generated 3 tokens per round: what it ends with equals one call of the whole budget, and each
    token's version and log-prob are those of the weights that produced it."""
    s, eng = stream([5, 14, 5, 5, 5, 5], capacity=2, quota=1, chunk=3)
    groups, _ = s.produce(version=0, train_at=1, params=PARAMS)  # the short group completes in round 1
    assert [g.index for g in groups] == [0]
    long = s.flight[0]
    assert long.index == 1 and len(long.samples[0].tokens) == 3
    # each later step's batch is a new short group (one round); the long one gains 3 tokens per round meanwhile
    seen, rounds = [], []
    for v in (1, 2, 3, 4):
        eng.version = v  # the weight sync between the steps
        groups, stats = s.produce(version=v, train_at=v + 1, params=PARAMS)
        seen += [g.index for g in groups]
        rounds.append(stats.rounds)
    # the long group completes in the 4th round after its start, with group 4: it is taken first, 4 waits a step
    assert seen == [2, 3, 1, 4] and rounds == [1, 1, 1, 0]
    smp = long.samples[0]
    ref = one_shot([14, 5, 6], 12)
    k = int(ref.action_mask[0].sum())
    assert k == 12 and smp.tokens == ref.sequences[0, ref.prompt_len:ref.prompt_len + k].tolist()
    assert smp.tokens[-1] == STOP and not smp.truncated
    assert smp.versions == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    want_lp = [-0.01 * (3 + j) - 0.001 * v for j, v in enumerate(smp.versions)]
    assert smp.logprobs == pytest.approx(want_lp, abs=1e-6)


def test_budget_cut_equals_a_call_with_that_budget():
    """max_new 5 in chunks of 3: the second round asks for 3 tokens, the sample has 2 left: cut to 2 and
    truncated, exactly what a 5-token call gives."""
    s, eng = stream([40], capacity=1, quota=1, chunk=3, max_new_tokens=5)
    groups, _ = s.produce(version=0, train_at=0, params=PARAMS)
    smp = groups[0].samples[0]
    ref = one_shot([40, 5, 6], 5)
    assert smp.tokens == ref.sequences[0, ref.prompt_len:].tolist() and len(smp.tokens) == 5
    assert smp.truncated and bool(ref.truncated[0])
    assert [c[1] for c in eng.calls] == [3, 2]  # the largest remaining budget, capped by the chunk


def test_staleness_restarts_groups_in_flight_and_drops_buffered_ones():
    s, eng = stream([5, 30], capacity=3, quota=1, chunk=2, max_new_tokens=40, max_staleness=1)
    s.produce(version=0, train_at=1, params=PARAMS)
    started = {g.index: g.oldest() for g in s.flight}
    assert started and set(started.values()) == {0}
    buffered = [g.index for g in s.buffer]
    # trained at step 3, version-0 tokens would be 3 syncs old > 1: restarted (in flight) / dropped (buffered)
    eng.version = 2
    _, stats = s.produce(version=2, train_at=3, params=PARAMS)
    assert stats.restarted_groups == len(started) and stats.dropped_stale_groups == len(buffered)
    assert all(v >= 2 for g in s.flight for smp in g.samples for v in smp.versions)


def test_streaming_rewards_filter_groups_as_they_complete():
    """score() runs the round each group completes; keep() drops it and a new prompt takes its place; when the
    draws for one batch run out, the filtered spares fill it."""
    scored = []

    def score(groups):
        scored.append([g.index for g in groups])
        for g in groups:
            r = torch.full((len(g.samples),), float(g.index % 2))
            g.reward = Batch(rewards=r, scores=r, valid=torch.ones_like(r, dtype=torch.bool), extra_logs={})

    s, _ = stream([5, 6], capacity=2, quota=2, score=score, keep=lambda g: g.index % 2 == 1)
    groups, stats = s.produce(version=0, train_at=1, params=PARAMS)
    assert [g.index for g in groups] == [1, 3] and stats.filtered_groups == 2 and scored[0] == [0, 1]
    b = groups_to_batch(groups, 0)
    assert b.rewards.tolist() == [1.0] * 4 and b.group_index.tolist() == [1, 1, 3, 3]
    s2, _ = stream([5], capacity=1, quota=1, score=score, keep=lambda g: False, max_draws=3)
    groups, stats = s2.produce(version=0, train_at=1, params=PARAMS)
    assert [g.index for g in groups] == [0] and stats.drawn_prompts == 3 and len(s2.spares) == 2


def agent_episodes(calls):
    """An agent's ``episodes`` callback (rlhf.rl.async_queue.AsyncRollout._episodes' contract): every
    group's samples whole -- a 2-token model turn, 1 feedback token (mask 0), a (1 + j)-token second turn -- and
    the environment's reward: 1 for odd prompts, 0 for even ones."""
    def episodes(groups, params):
        calls.append(([g.index for g in groups], params.n))
        for g in groups:
            for j, s in enumerate(g.samples):
                s.tokens, s.mask = [11, 12, 99] + [13] * (1 + j), [1, 1, 0] + [1] * (1 + j)
                s.logprobs = [-0.1, -0.2, 0.0] + [-0.3] * (1 + j)
            r = torch.full((len(g.samples),), float(g.index % 2))
            g.reward = Batch(rewards=r, scores=r, valid=torch.ones_like(r, dtype=torch.bool), extra_logs={})
    return episodes


def test_agent_episodes_run_whole_oversampled_and_filtered():
    """--agent_func_path under --async_train: 3 groups in flight for batches of 2, groups filtered by their
    environment's scores as they complete; each round finishes every episode in one agent call, with the
    weights of that batch's step; environment tokens stay out of the action mask and the token count."""
    calls = []
    s, eng = stream([4], capacity=3, quota=2, episodes=agent_episodes(calls), keep=lambda g: g.index % 2 == 1)
    groups, st = s.produce(0, 2, PARAMS)
    # round 1 draws 0, 1, 2 and keeps 1; round 2 draws 3, 4, 5 and keeps 3, 5: the batch is [1, 3], 5 waits
    assert calls == [([0, 1, 2], 2), ([3, 4, 5], 2)] and eng.calls == [], (calls, eng.calls)
    assert [g.index for g in groups] == [1, 3] and [g.index for g in s.buffer] == [5] and not s.flight
    assert (st.rounds, st.drawn_prompts, st.filtered_groups) == (2, 6, 3), st
    assert st.generated_tokens == 6 * (3 + 4), st  # model tokens only: 2 + 1 and 2 + 2 per group's two samples
    b = groups_to_batch(groups, 0)
    assert b.action_mask.tolist() == [[1, 1, 0, 1, 0], [1, 1, 0, 1, 1]] * 2, b.action_mask
    assert b.versions.tolist() == [[0, 0, 0, 0, -1], [0, 0, 0, 0, 0]] * 2, b.versions
    assert b.rewards.tolist() == [1.0] * 4 and b.truncated.tolist() == [False] * 4
    # the next batch, with the weights of step 1: the buffered group 5 (generated at version 0) and a new one
    groups, st = s.produce(1, 3, PARAMS)
    b = groups_to_batch(groups, 0)
    assert [g.index for g in groups] == [5, 7] and sample_ages(b.versions, b.action_mask, 3).tolist() == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="no chunk"):
        stream([4], chunk=2, episodes=agent_episodes([]))


def test_groups_to_batch_versions_and_ages():
    s, eng = stream([5, 9], capacity=2, quota=2, chunk=2)
    s.produce(version=0, train_at=1, params=PARAMS)  # group 0 done, group 1 still in flight
    eng.version = 1
    groups, _ = s.produce(version=1, train_at=2, params=PARAMS)
    b = groups_to_batch(groups, 0)
    assert (b.versions[b.action_mask == 0] == -1).all() and (b.versions[b.action_mask == 1] >= 0).all()
    # hand case: 3 rows, ages at step 5
    v = torch.tensor([[3, 3, 4, -1], [4, 4, 4, 4], [-1, -1, -1, -1]])
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert sample_ages(v, am, 5).tolist() == [2, 1, 0]
    m = age_metrics(v, am, 5)
    assert m["async/age_max"] == 2 and m["async/age_mean"] == pytest.approx(1.0)
    assert m["async/token_age_mean"] == pytest.approx((2 + 2 + 1 + 1 * 4) / 7)
    assert m["async/partial_frac"] == pytest.approx(1 / 3)


def _rl(**kw):
    cfg = TrainConfig()
    for k, v in kw.items():
        setattr(cfg.rollout, k, v)
    return cfg


def test_default_staleness_is_the_pipelines_own_bound():
    r = _rl(async_queue_size=2, rollout_batch_size=8, vllm_generate_batch_size=8).rollout
    assert default_staleness(r, 64) == 2
    r.vllm_generate_batch_size = 20  # extras wait up to ceil(20 / 8) - 1 = 2 more steps
    assert default_staleness(r, 64) == 4
    r.partial_rollout, r.partial_rollout_chunk = True, 16  # a 64-token response spans 64 / 16 - 1 = 3 more syncs
    assert default_staleness(r, 64) == 7


@pytest.mark.parametrize("argv,flag", [
    (["--partial_rollout"], "--partial_rollout"),
    (["--async_queue_size", "2"], "--async_queue_size"),
    (["--async_train", "--async_queue_size", "0"], "--async_queue_size"),
    (["--async_train", "--async_queue_size", "2", "--max_staleness", "1"], "--max_staleness"),
    (["--async_train", "--vllm_generate_batch_size", "2", "--rollout_batch_size", "4"], "--vllm_generate_batch_size"),
    (["--async_train", "--partial_rollout_chunk", "4"], "--partial_rollout_chunk"),
])
def test_async_flags_refused_with_the_flag_named(argv, flag):
    import click

    from rlhf.config.cli import parse

    with pytest.raises((click.UsageError, ConfigError), match=flag):
        parse("grpo", ["--n_samples_per_prompt", "2", *argv])


def test_partial_rollout_with_an_agent_is_accepted_and_said(capsys):
    """OpenRLHF's train_reinforce_baseline_ray_agent_async.sh passes --train.partial_rollout_enable with an agent
    (openrlhf/trainer/ppo_trainer_async.py accepts it): here the agent's episodes run whole in one step's weights,
    so the flag is turned off with a notice instead of refusing the command."""
    from rlhf.config.cli import parse

    cfg = parse("grpo", ["--n_samples_per_prompt", "2", "--async_train", "--train.agent_func_path", "agent.py",
                         "--train.partial_rollout_enable", "--partial_rollout_chunk", "8"])
    assert (cfg.rollout.partial_rollout, cfg.rollout.partial_rollout_chunk) == (False, None), \
        "with an agent --partial_rollout must end up off (episodes run whole)"
    assert "--partial_rollout with --agent_func_path" in capsys.readouterr().err, "the change must be said"


def test_async_turns_is_correction_on_unless_told_off():
    from rlhf.config.cli import parse

    base = ["--n_samples_per_prompt", "2", "--async_train"]
    cfg = parse("grpo", base)
    assert cfg.algorithm.enable_is_correction and cfg.algorithm.is_correction_type == "tis"
    assert cfg.rollout.max_staleness == 1 and cfg.rollout.vllm_generate_batch_size == cfg.rollout.rollout_batch_size
    assert not parse("grpo", base + ["--is_correction_level", "off"]).algorithm.enable_is_correction
    assert not parse("grpo", ["--n_samples_per_prompt", "2"]).algorithm.enable_is_correction
    # OpenRLHF's hierarchical names reach the same flags
    cfg = parse("grpo", base + ["--train.async_queue_size", "2", "--train.partial_rollout_enable",
                                "--rollout.vllm_generate_batch_size", "16"])
    assert (cfg.rollout.async_queue_size, cfg.rollout.partial_rollout, cfg.rollout.vllm_generate_batch_size) == \
        (2, True, 16)


class ContextEngine(ScriptedEngine):
    """vLLM's limits: a prompt of max_model_len tokens is refused (vllm/v1/engine/input_processor.py
    _validate_prompt_len), a generation stops at max_model_len with finish_reason "length" (check_stop)."""
    max_model_len = 9

    def generate(self, prompt_ids, params):
        assert all(len(p) < self.max_model_len for p in prompt_ids), [len(p) for p in prompt_ids]
        out = super().generate(prompt_ids, params)
        rows = [(p, out.sequences[i, out.prompt_len:out.prompt_len + int(out.action_mask[i].sum())].tolist(),
                 out.rollout_logprobs[i, :int(out.action_mask[i].sum())].tolist(), bool(out.truncated[i]))
                for i, p in enumerate(prompt_ids)]
        cut = [(p, r[:self.max_model_len - len(p)], lp[:self.max_model_len - len(p)],
                t or len(r) > self.max_model_len - len(p)) for p, r, lp, t in rows]
        return batch_from_rows([c[0] for c in cut], [c[1] for c in cut], [c[2] for c in cut], [c[3] for c in cut], 0)


def test_partial_rollout_stops_at_the_engines_context():
    """Continuation prompts (prompt + tokens so far) never reach the engine's max_model_len: a sample that fills
    the context is done, truncated, with max_model_len - prompt tokens."""
    s, _ = stream([20], chunk=2, max_new_tokens=12)  # prompt [20, 5, 6] wants 17 tokens: the context (9) cuts it
    s.engine = ContextEngine()
    s.max_len = ContextEngine.max_model_len
    groups, _ = s.produce(0, 0, PARAMS)
    for g in groups:
        for x in g.samples:
            assert x.done and x.truncated and len(x.tokens) == 9 - 3, (len(x.tokens), x.truncated)
