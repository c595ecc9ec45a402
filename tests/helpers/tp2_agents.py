"""Issue 44 / 46 checks on a colocated TP=2 vLLM engine (tests/vllm_cpu/test_vllm.py ``_colocated_tp2``, one launch):
a run_agent file's 3-turn sessions through the in-job endpoint, a tool episode (--tools_path), and adapter LoRA
sync (--lora_sync adapter).  The agent side runs on the engine's first rank only; the other TP rank follows every
per-request step in ``serve()`` (``VLLMEngine.step_requests`` broadcasts each step's admitted / aborted requests),
as ``RolloutRole.run_agent`` arranges in a training run."""
import re

import torch

from rlhf.engines.rollout import SamplingParams
from rlhf.models.forward import action_logprobs

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
TOOLS = ('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: one\n        b: two\n    """\n'
         '    return a + b + 1000\n')


def on_first_rank(rank, eng, fn, *args):
    """``fn`` on rank 0 (the agent), rank 1 in ``serve`` until rank 0's ``end_requests``."""
    if rank != 0:
        eng.serve()
        return None
    try:
        return fn(*args)
    finally:
        eng.end_requests()


def endpoint_episodes(eng, model, kit, tmp):
    """Two prompts x 2 samples, each a 3-turn session of the real ``openai`` client against the endpoint on this
    rank; returns the largest |trainer - recorded| log-prob over the stitched samples (T = 0.7)."""
    from helpers.endpoint_agents import THREE_TURNS, Recording, check_stitched
    from rlhf.agents.load import load_agent
    from rlhf.models.load import load_tokenizer

    tok = load_tokenizer(kit)
    with open(f"{tmp}/agent.py", "w") as f:
        f.write(THREE_TURNS)
    inst, exe = load_agent(f"{tmp}/agent.py")
    rec = Recording(eng)
    prompts = ["3+4=", "12+9="]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    batch = exe(inst, 3, 64, rec, tok).run(ids, prompts, ["7", "21"],
                                           SamplingParams(n=2, max_new_tokens=5, temperature=0.7, seed=1))
    assert batch.rewards.tolist() == [1.0, 1.0, 2.0, 2.0], batch.rewards
    calls = exe.openrlhf_cls.run_agent.__globals__["CALLS"]
    assert len(calls) == 12, f"4 sessions x 3 calls expected, the client made {len(calls)}"
    check_stitched(batch, rec.rows, calls)
    lp, _ = action_logprobs(model, batch.sequences, batch.attention_mask, batch.num_actions, temperature=0.7)
    return float(((lp * batch.action_mask) - batch.rollout_logprobs).abs().max())


def force_tool_call(kit):
    """Patch ``vllm_requests.vllm_params`` (on EVERY TP rank: their engines must get identical requests) so that an
    episode's first turn is the tool call, by a vLLM grammar (the random model cannot write one)."""
    from transformers import AutoTokenizer
    from vllm.sampling_params import StructuredOutputsParams

    import rlhf.engines.vllm_requests as vr

    tok, real = AutoTokenizer.from_pretrained(kit), vr.vllm_params

    def forced(vllm_mod, r, eos):
        sp = real(vllm_mod, r, eos)
        if "<|tool|>" not in tok.decode(r.prompt_ids):
            sp.structured_outputs = StructuredOutputsParams(regex=re.escape(CALL))
        return sp

    vr.vllm_params = forced
    return lambda: setattr(vr, "vllm_params", real)


def tool_episode(eng, model, kit, tmp):
    """--tools_path: the tool executor with vLLM's hermes parser; the forced call runs (add -> 1005), its message is
    appended (mask 0) and the engine writes the next turn freely.  Returns the largest trainer-vs-vLLM log-prob gap
    on the free turns (forced tokens' log-probs are after vLLM's grammar mask: not the model's)."""
    from transformers import AutoTokenizer

    from rlhf.agents.tool_agent import ToolAgentExecutor, ToolLimits
    from rlhf.agents.tool_parsers import make_parser
    from rlhf.agents.tools import load_tools

    with open(f"{tmp}/tools.py", "w") as f:
        f.write(TOOLS)
    tools, tok = load_tools(f"{tmp}/tools.py"), AutoTokenizer.from_pretrained(kit)

    def reward(queries, prompts, labels):
        r = torch.tensor([float("1005" in q) for q in queries])
        return {"rewards": r, "scores": r}

    ex = ToolAgentExecutor(tools, make_parser("hermes", tok, tools.schemas), ToolLimits(3, 4, 10.0, 200, 200), eng,
                           tok, reward)
    text = tok.apply_chat_template([{"role": "user", "content": "add two and three"}], tokenize=False,
                                   add_generation_prompt=True)
    b = ex.run([tok(text, add_special_tokens=False)["input_ids"]], [text], [None],
               SamplingParams(n=2, temperature=0.0, max_new_tokens=90, stop_token_ids=(2,)))
    m = ex.take_metrics()
    assert m["tool/calls_per_episode"] == 1.0 and m["tool/error_rate"] == 0.0, m
    assert b.rewards.tolist() == [1.0, 1.0], "the tool's output (1005) is in each episode"
    lp, _ = action_logprobs(model, b.sequences, b.attention_mask, b.num_actions, temperature=1.0)
    gaps = []
    for i in range(2):
        n = int(b.attention_mask[i, b.prompt_len:].sum())
        mask = b.action_mask[i, :n].tolist()
        k1 = mask.index(0)
        k2 = k1 + mask[k1:].index(1)
        assert "1005" in tok.decode(b.sequences[i, b.prompt_len + k1:b.prompt_len + k2]), "no tool message"
        assert n - k2 >= 5, f"episode {i}: the free turn has {n - k2} tokens"
        gaps.append((lp[i, k2:n] - b.rollout_logprobs[i, k2:n]).abs().max().item())
    return max(gaps)


def lora_model(kit, base, seed):
    """A peft LoRA (r=4, alpha 8, every linear) over a copy of ``base``'s weights, lora_B random (seeded: every rank
    builds the same one)."""
    import peft
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(kit)
    m.load_state_dict(base.state_dict())
    lora = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    bump_adapter(lora, seed)
    return lora


def bump_adapter(lora, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def lora_gap(eng, lora, base, prompts, params):
    """Generate with the engine's current adapter; largest |trainer (peft forward) - vLLM| log-prob, and the same
    for the model without the adapter (``base``: large unless the adapter is ignored)."""
    out = eng.generate(prompts, params)
    gaps = []
    for m in (lora, base):
        lp, _ = action_logprobs(m, out.sequences, out.attention_mask, out.num_actions, temperature=params.temperature)
        gaps.append(float(((lp * out.action_mask) - out.rollout_logprobs).abs().max()))
    return gaps[0], gaps[1], out


def lora_step(eng, lora, prompt):
    """One greedy request through per-request steps (rank 0's scheduler path): it must carry the adapter too."""
    from rlhf.engines.requests import Request

    p = SamplingParams(temperature=0.0, max_new_tokens=6)
    res, done = None, []
    for step in range(20):
        res = eng.step_requests([Request("lora", prompt, p)] if step == 0 else [])
        done += res.finished
        if done:
            break
    c = done[0]
    seq = torch.tensor([list(prompt) + c.token_ids])
    lp, _ = action_logprobs(lora, seq, torch.ones_like(seq), len(c.token_ids), temperature=1.0)
    return float((lp[0] - torch.tensor(c.logprobs)).abs().max())
