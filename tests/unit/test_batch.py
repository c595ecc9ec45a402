"""The step record (rlhf.batch): select / cat / pad / gather read the fields' declared metadata, so every
field survives every op (the bugs this replaced: a select that dropped the streamed rewards, a merge that kept 6
of 11 fields) and a new field needs no code in the ops."""
from __future__ import annotations

import threading
from dataclasses import fields

import pytest
import torch

from rlhf.batch import IMAGES, META, NAMED, ROW, SEQ, TOKEN, Batch, cat, row_fields, spec
from rlhf.distributed.batch_gather import gather_batch

PAD = 7


def rows_batch(P: int, R: int, prompt_lens, resp_lens, seed: int = 0, every: bool = True) -> Batch:
    """Left-padded prompts of ``prompt_lens``, right-padded responses of ``resp_lens``; with ``every`` each
    per-row field is set (random values, zeros on padding)."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    att = torch.zeros(B, P + R, dtype=torch.long)
    am = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        att[i, P - p:P + r] = 1
        am[i, :r] = 1
    seq = torch.where(att.bool(), torch.randint(10, 90, (B, P + R), generator=g), torch.full((B, P + R), PAD))
    tok = lambda: torch.randn(B, R, generator=g) * am  # noqa: E731
    b = Batch(sequences=seq, attention_mask=att, action_mask=am, rollout_logprobs=tok(), prompt_len=P,
              truncated=torch.rand(B, generator=g) > 0.5, step=3, n_samples=2, kl_coef=0.1)
    if every:
        b.versions = torch.where(am.bool(), torch.randint(0, 5, (B, R), generator=g), torch.full((B, R), -1))
        b.group_index = torch.arange(B) // 2
        b.rewards, b.scores = torch.randn(B, generator=g), torch.randn(B, generator=g)
        b.valid = torch.rand(B, generator=g) > 0.3
        b.extra_logs = {"acc": torch.rand(B, generator=g), "len": torch.rand(B, generator=g)}
        b.ref_logprobs, b.old_logprobs, b.values, b.advantages, b.returns = tok(), tok(), tok(), tok(), tok()
        # (B, P + R, L * k): 3 layers x top-2 of 5 experts, -1 on padding (a column that is itself (L * k,))
        b.routed_experts = torch.where(att.bool().unsqueeze(-1), torch.randint(0, 5, (B, P + R, 6), generator=g), -1)
        b.teacher_logprobs = tok()
        # --opd_topk: (B, R, 3) the teacher's top-3 log-probs and ids, 0 on padding (a column that is (k,))
        b.teacher_topk_logprobs = torch.randn(B, R, 3, generator=g) * am.unsqueeze(-1)
        b.teacher_topk_ids = torch.randint(1, 90, (B, R, 3), generator=g) * am.unsqueeze(-1)
    return b


def unpadded(b: Batch, i: int, name: str):
    """Row ``i`` of field ``name`` without its padding: what must survive any re-padding."""
    m, v, P = spec(name, type(b)), getattr(b, name), b.prompt_len
    if m["kind"] == SEQ:
        keep = b.attention_mask[i].bool()
        return v[i][keep].reshape(-1).tolist()  # routed_experts: each column (L * k,) in turn
    if m["kind"] == TOKEN:
        n = int(b.attention_mask[i, P:].sum())
        return v[i, :n].reshape(-1).tolist()  # teacher_topk_*: each column (k,) in turn
    if m["kind"] == NAMED:
        return {k: float(t[i]) for k, t in v.items()}
    return v[i].item()


PER_ROW = [f.name for f in fields(Batch) if f.metadata["kind"] not in (META, IMAGES)]  # IMAGES: test_batch_images.py


def test_every_field_declares_its_metadata():
    for f in fields(Batch):
        m = f.metadata
        assert m["kind"] in (ROW, TOKEN, SEQ, NAMED, IMAGES, META) and m["writer"] and m["doc"], f.name
        if m["kind"] not in (META, IMAGES):
            assert m["block"] in ("int", "float") and "pad" in m and m["dtype"] is not None, f.name
    assert row_fields("rollout") == ["sequences", "attention_mask", "action_mask", "rollout_logprobs", "truncated"]
    assert row_fields("rollout", "async") == row_fields("rollout")[:4] + ["versions", "truncated", "group_index"]
    assert row_fields("reward") == ["rewards", "scores", "valid", "extra_logs"]


def test_select_keeps_every_field_and_the_step_meta():
    b = rows_batch(4, 5, [4, 2, 3, 1], [5, 0, 2, 4])
    b.metrics["x"] = 1.0
    rows = torch.tensor([3, 1])
    s = b.select(rows)
    for name in PER_ROW:
        v = getattr(b, name)
        want = {k: t[rows] for k, t in v.items()} if name == "extra_logs" else v[rows]
        got = getattr(s, name)
        assert (got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)) \
            if name == "extra_logs" else torch.equal(got, want), name
    assert (s.step, s.n_samples, s.kl_coef, s.prompt_len) == (3, 2, 0.1, 4)
    assert s.metrics == {} and b.metrics == {"x": 1.0}, "a view starts its own metrics"
    assert b.select(slice(1, 3)).sequences.shape == (2, 9)


def test_cat_repads_awkward_widths_and_keeps_every_field():
    parts = [rows_batch(3, 2, [3, 1], [2, 1], seed=1), rows_batch(5, 4, [2, 5, 1], [0, 4, 1], seed=2),
             rows_batch(1, 1, [1], [1], seed=3)]
    parts[2].extra_logs["only_here"] = torch.ones(1)
    c = cat(parts, PAD)
    assert c.prompt_len == 5 and c.num_actions == 4 and c.sequences.shape == (6, 9)
    assert sorted(c.extra_logs) == ["acc", "len"], "names every part has"
    j = 0
    for p in parts:
        for i in range(p.size()):
            for name in PER_ROW:
                want = unpadded(p, i, name)
                if name == "extra_logs":
                    want = {k: want[k] for k in ("acc", "len")}
                assert unpadded(c, j, name) == want, (name, j)
            j += 1
    # padding: prompts on the left with the pad id / 0, responses on the right with each field's pad value
    assert c.sequences[0, :2].tolist() == [PAD, PAD] and c.attention_mask[0, :2].tolist() == [0, 0]
    assert c.versions[0, 2:].tolist() == [-1, -1] and c.rollout_logprobs[0, 2:].tolist() == [0.0, 0.0]
    assert c.truncated.dtype == torch.bool and c.valid.dtype == torch.bool


def test_cat_refuses_a_field_set_in_some_parts_only():
    with pytest.raises(ValueError, match="field 'versions' is set in 1 of 2 batches"):
        cat([rows_batch(2, 2, [2], [1]), rows_batch(2, 2, [1], [2], every=False)], PAD)


def test_padded_round_trip():
    b = rows_batch(2, 3, [2, 1], [3, 1])
    w = b.padded(6, 5, PAD)
    assert w.sequences.shape == (2, 11) and w.prompt_len == 6 and w.versions.shape == (2, 5)
    for i in range(2):
        for name in PER_ROW:
            assert unpadded(w, i, name) == unpadded(b, i, name), name


class FakeWorld:
    """``n`` ranks as threads; comm's all_reduce / all_gather_object meet at a barrier and combine every rank's
    value, as torch.distributed would.  Each rank's collective sequence is recorded."""

    def __init__(self, n: int):
        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=20), [None] * n
        self.local, self.calls = threading.local(), [[] for _ in range(n)]

    def _exchange(self, x):
        r = self.local.rank
        self.slots[r] = x
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def all_reduce(self, t, op="sum", group=None):
        self.calls[self.local.rank].append(("all_reduce", op, tuple(t.shape)))
        every = self._exchange(t.clone())
        t.copy_(torch.stack(every).amax(0) if op == "max" else torch.stack(every).sum(0))
        return t

    def all_gather_object(self, obj, group=None):
        self.calls[self.local.rank].append(("all_gather_object",))
        return self._exchange(obj)

    def run(self, fn):
        out, errors = [None] * self.n, []

        def main(r):
            self.local.rank = r
            try:
                out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


@pytest.fixture
def world(monkeypatch):
    from rlhf.distributed import comm

    def make(n):
        w = FakeWorld(n)
        monkeypatch.setattr(comm, "all_reduce", w.all_reduce)
        monkeypatch.setattr(comm, "all_gather_object", w.all_gather_object)
        return w

    return make


@pytest.mark.parametrize("names", [row_fields("rollout"), row_fields("rollout", "async") + row_fields("reward"),
                                   [n for n in PER_ROW if n != "routed_experts" and spec(n)["only"] != "topk"]])
# their depth: the next test, tests/unit/test_opd_topk.py
def test_gather_over_ranks_with_awkward_shards(world, names):
    """4 ranks: two own rows (of different widths), one owns none, one holds nothing (local None): every rank
    gets every row back, exactly, with one widths max, [one names gather,] one int and one float gather."""
    full = cat([rows_batch(3, 2, [3, 1], [2, 0], seed=1), rows_batch(1, 4, [1, 1, 1], [4, 1, 3], seed=2)], PAD)
    full.extra_logs["stray"] = torch.zeros(5)  # one owner has it: not every owner, so not gathered
    shards = {0: slice(0, 2), 1: slice(2, 5), 2: slice(5, 5)}

    def local(r):
        if r == 3:
            return None
        b = (rows_batch(3, 2, [3, 1], [2, 0], seed=1), rows_batch(1, 4, [1, 1, 1], [4, 1, 3], seed=2),
             rows_batch(1, 1, [1], [1], seed=9).select(slice(0, 0)))[r]
        if r == 1:
            b.extra_logs["stray"] = torch.zeros(3)
        return b

    w = world(4)
    got = w.run(lambda r: gather_batch(local(r), shards.get(r), 5, names, PAD))
    for g in got:
        assert g.prompt_len == 3 and g.num_actions == 4
        for name in names:
            for i in range(5):
                want = unpadded(full, i, name)
                if name == "extra_logs":
                    want = {k: want[k] for k in ("acc", "len")}
                assert unpadded(g, i, name) == pytest.approx(want), (name, i)
            if name not in ("extra_logs",):
                assert getattr(g, name).dtype == spec(name)["dtype"], name
        assert torch.equal(g.sequences, full.sequences)
    named = "extra_logs" in names
    want_calls = [("all_reduce", "max", (2,))] + ([("all_gather_object",)] if named else [])
    assert all(c[:len(want_calls)] == want_calls and len(c) == len(want_calls) + 2 for c in w.calls), w.calls
    assert all(c == w.calls[0] for c in w.calls), "the same collectives on every rank"


def test_gather_carries_routed_experts_of_any_depth(world):
    """routed_experts (B, P + R, L * k) from 3 ranks of awkward widths, one owning no rows and one holding
    nothing: its depth L * k rides in the widths max (3 values), every row comes back exactly, -1 on padding."""
    parts = [rows_batch(3, 2, [3, 1], [2, 0], seed=1), rows_batch(1, 4, [1, 1, 1], [4, 1, 3], seed=2)]
    full = cat(parts, PAD)
    names = row_fields("rollout", "routing")
    assert "routed_experts" in names and "routed_experts" not in row_fields("rollout")
    w = world(3)
    got = w.run(lambda r: gather_batch(parts[r] if r < 2 else None, (slice(0, 2), slice(2, 5), None)[r], 5, names,
                                       PAD))
    for g in got:
        assert g.routed_experts.shape == (5, 7, 6) and g.routed_experts.dtype == torch.long
        assert torch.equal(g.routed_experts, full.routed_experts), "routing rows changed in the gather"
        assert bool((g.routed_experts[~g.attention_mask.bool()] == -1).all()), "padding must read -1 (no route)"
    assert w.calls[0][0] == ("all_reduce", "max", (3,)), w.calls[0]


def test_gather_of_row_fields_only_needs_no_widths(world):
    """The reward function's rows (rewards, scores, valid, logs): no widths max, the names, ints, floats."""
    w = world(2)
    r = torch.tensor([1.0, float("nan"), 3.0])

    def local(k):
        rows = slice(0, 2) if k == 0 else slice(2, 3)
        return Batch(rewards=r[rows], scores=r[rows] * 2, valid=torch.isfinite(r[rows]),
                     extra_logs={"a": r[rows] + 1}), rows

    got = w.run(lambda k: gather_batch(*local(k), 3, row_fields("reward"), PAD))
    for g in got:
        assert torch.allclose(g.rewards, r, equal_nan=True) and g.valid.tolist() == [True, False, True]
        assert g.extra_logs["a"].tolist()[0] == 2.0 and g.prompt_len is None
    assert w.calls[0] == [("all_gather_object",), ("all_reduce", "sum", (3, 1)), ("all_reduce", "sum", (3, 3))]


def test_a_new_field_needs_no_code_in_the_ops(world):
    """A field declared on a subclass travels through select, cat, padded and gather untouched by the ops."""
    from dataclasses import dataclass

    from rlhf import batch as batch_mod

    @dataclass
    class Wider(Batch):
        prm_token_scores: torch.Tensor = batch_mod.tensor_field(TOKEN, "float", torch.float32, 0.0, "teacher",
                                                                "(B, R) a teacher's log-probs")

    def wider(b):
        return Wider(**{f.name: getattr(b, f.name) for f in fields(Batch)}, prm_token_scores=b.rollout_logprobs - 1)

    a, b = wider(rows_batch(2, 3, [2, 1], [3, 1], seed=1)), wider(rows_batch(4, 1, [4], [1], seed=2))
    assert torch.equal(a.select(torch.tensor([1])).prm_token_scores, a.prm_token_scores[[1]])
    c = cat([a, b], PAD)
    assert type(c) is Wider and c.prm_token_scores.shape == (3, 3)
    for i, (src, j) in enumerate(((a, 0), (a, 1), (b, 0))):
        assert unpadded(c, i, "prm_token_scores") == unpadded(src, j, "prm_token_scores")
    names = ["sequences", "attention_mask", "prm_token_scores"]
    w = world(2)
    got = w.run(lambda r: gather_batch((a, b)[r], (slice(0, 2), slice(2, 3))[r], 3, names, PAD, cls=Wider))
    assert all(torch.equal(g.prm_token_scores, c.prm_token_scores) for g in got)


def test_gather_carries_the_teacher_topk_fields(world):
    """--opd_topk's (B, R, k) fields from 3 ranks of awkward widths (one owning no rows, one holding nothing):
    k rides in the widths max, the ids come back as long and exact, the log-probs exact, 0 on padding."""
    parts = [rows_batch(3, 2, [3, 1], [2, 0], seed=1), rows_batch(1, 4, [1, 1, 1], [4, 1, 3], seed=2)]
    full = cat(parts, PAD)
    names = ["sequences", "attention_mask", "action_mask", "teacher_topk_logprobs", "teacher_topk_ids"]
    w = world(3)
    got = w.run(lambda r: gather_batch(parts[r] if r < 2 else None, (slice(0, 2), slice(2, 5), None)[r], 5, names,
                                       PAD))
    for g in got:
        assert g.teacher_topk_ids.shape == (5, 4, 3) and g.teacher_topk_ids.dtype == torch.long
        assert torch.equal(g.teacher_topk_ids, full.teacher_topk_ids), "top-k ids changed in the gather"
        assert torch.equal(g.teacher_topk_logprobs, full.teacher_topk_logprobs), "top-k log-probs changed"
        assert float(g.teacher_topk_logprobs[~g.action_mask.bool()].abs().sum()) == 0.0, "padding must read 0"
    assert w.calls[0][0] == ("all_reduce", "max", (4,)), w.calls[0]
