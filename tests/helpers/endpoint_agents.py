"""A three-turn ``run_agent`` file and the checks that its episodes, through the in-job endpoint
(rlhf.agents.endpoint), are stitched token-exactly: shared by tests/unit/test_agent_endpoint.py (HF engine) and
tests/vllm_cpu/test_vllm.py (vLLM)."""
import pytest

THREE_TURNS = '''
CALLS = []


async def run_agent(client, prompt, label, **kw):
    """Three model turns, a tool's answer after each of the first two (the label's digits, so rows differ)."""
    msgs = [{"role": "system", "content": "add"}, {"role": "user", "content": prompt}]
    for turn in range(3):
        r = await client.chat.completions.create(model=kw["model"], messages=msgs, logprobs=True,
                                                 max_tokens=3 + turn)
        c = r.choices[0]
        CALLS.append((kw["session_id"], r.model_extra["prompt_token_ids"], c.model_extra["token_ids"],
                      [x.logprob for x in c.logprobs.content]))
        msgs.append({"role": "assistant", "content": c.message.content})
        if turn < 2:
            msgs.append({"role": "tool", "content": f"{label}{turn}"})
    return {"reward": float(len(label)), "scores": 0.5, "extra_logs": {"turns": 3}}
'''


class Recording:
    """An engine (this project's contract: generate(prompt ids, SamplingParams) -> Batch, and the per-request
    step_requests(admit, abort) -> StepResult of rlhf/engines/requests.py) whose generated rows are recorded:
    (prompt ids, completion ids) -> their log-probs."""

    def __init__(self, engine):
        self.engine, self.rows, self.prompts = engine, {}, {}

    @property
    def max_model_len(self):
        return self.engine.max_model_len

    def step_requests(self, admit, abort=()):
        self.prompts.update({r.request_id: list(r.prompt_ids) for r in admit})
        out = self.engine.step_requests(admit, abort)
        for c in out.finished:
            self.rows[tuple(self.prompts.pop(c.request_id)), tuple(c.token_ids)] = list(c.logprobs)
        return out

    def generate(self, prompt_ids, params):
        out = self.engine.generate(prompt_ids, params)
        for i, p in enumerate(prompt_ids):
            m = out.action_mask[i].bool()
            comp = out.sequences[i, out.prompt_len:][m].tolist()
            self.rows[tuple(p), tuple(comp)] = out.rollout_logprobs[i][m].tolist()
        return out


def action_spans(mask):
    """[start, end) of each run of ones."""
    out, start = [], None
    for j, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            out.append((start, j))
            start = None
    return out


def check_stitched(batch, rows, calls, turns: int = 3):
    """Every call the client saw is an engine row (its token ids and log-probs); every stitched sample is, turn by
    turn, an engine row: the engine saw exactly the sample's prefix and produced exactly its action tokens."""
    for sid, prompt, comp, lps in calls:
        key = (tuple(prompt), tuple(comp))
        assert key in rows, f"session {sid}: the client's token ids are not what the engine produced"
        assert lps == pytest.approx(rows[key], abs=1e-6)
    firsts = {tuple(p) for sid, p, _, _ in calls if p == next(q for s, q, _, _ in calls if s == sid)}
    P = batch.prompt_len
    for i in range(batch.sequences.size(0)):
        att = batch.attention_mask[i].bool()
        seq = batch.sequences[i][att].tolist()
        n_prompt = int(att[:P].sum())
        spans = action_spans(batch.action_mask[i].tolist()[:len(seq) - n_prompt])
        assert len(spans) == turns, (i, spans)
        assert tuple(seq[:n_prompt]) in firsts, f"row {i}: the sample's prompt is no session's first prompt"
        for t, (s, e) in enumerate(spans):
            s, e = s + n_prompt, e + n_prompt
            lps = rows.get((tuple(seq[:s]), tuple(seq[s:e])))
            assert lps is not None, f"row {i} turn {t}: the stitched prefix + action is no engine call"
            assert batch.rollout_logprobs[i, s - n_prompt:e - n_prompt].tolist() == pytest.approx(lps, abs=1e-6)
