"""Token-budget micro-batches (--use_dynamic_batch) and --adam_offload: the partitioning functions against hand
computations, the parse-time errors, the DeepSpeed config, and the supervised loop's weighting (one process).
The 2-rank checks (PPO actor/critic loss and gradient equal fixed-size micro-batches, FSDP2 CPUOffloadPolicy)
run in tests/multiprocess/test_distributed.py's FSDP2 launch (tests/helpers/batching_checks.py)."""
import click
import pytest
import torch
from helpers.tasks import make_task

from rlhf.algorithms.seqlen_balancing import (
    Item,
    karmarkar_karp,
    min_micro_batches,
    padded_cost,
    padded_micro_batches,
    plan_step,
    token_micro_batches,
)
from rlhf.config.cli import parse


def test_karmarkar_karp_by_hand():
    # [5, 3, 7, 2, 6] into 2: the differencing method pairs 7|6, then 5|3 ... -> {7, 5} = 12 and {6, 3, 2} = 11
    parts = karmarkar_karp([5, 3, 7, 2, 6], 2)
    assert sorted(sorted(sum([5, 3, 7, 2, 6][i] for i in p) for p in parts)) == [11, 12], parts
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]
    # equal size: 8 items into 4 pairs of sum 9 (1+8, 2+7, 3+6, 4+5)
    eq = karmarkar_karp([1, 2, 3, 4, 5, 6, 7, 8], 4, equal_size=True)
    assert sorted(len(p) for p in eq) == [2, 2, 2, 2] and {sum(i + 1 for i in p) for p in eq} == {9}, eq
    # fewer items than sets: the extra sets are empty
    assert sorted(map(len, karmarkar_karp([4, 4], 3))) == [0, 1, 1]


def test_min_micro_batches_first_fit_decreasing():
    # OpenRLHF's docstring example: [5, 3, 7, 2, 6] under 10 -> 3 bins ([7, 3], [6, 2], [5])
    assert min_micro_batches([5, 3, 7, 2, 6], 10) == 3
    assert min_micro_batches([], 10) == 0
    # over the budget: a bin of its own, as OpenRLHF's first fit (issue 41 item 12), not an error
    assert min_micro_batches([3, 11], 10) == 2 and min_micro_batches([3, 11, 12, 4], 10) == 3


def test_token_micro_batches_stay_within_budget():
    lengths = [9, 9, 2, 2, 2, 2, 1, 1]  # 28 tokens: 3 bins of 10 by first fit
    parts = token_micro_batches(lengths, 10, min_micro_batches(lengths, 10))
    assert all(sum(lengths[i] for i in p) <= 10 for p in parts), parts
    assert sorted(i for p in parts for i in p) == list(range(8))


def test_padded_micro_batches_by_hand():
    # widths (left + right) 10, 9, 3, 3, 2, 2 under 20 padded slots: [10, 9] costs 2 x 10 = 20; then
    # [3, 3, 2, 2] costs 4 x 3 = 12; a fixed micro-batch of 2 rows in the given order would cost 20 + 6 + 4 = 30
    items = [Item(0, 3), Item(1, 9), Item(0, 2), Item(0, 9), Item(0, 3), Item(0, 2)]
    runs = padded_micro_batches(items, 20, 0)
    assert runs == [[1, 3], [0, 2, 4, 5]], runs
    assert [padded_cost([items[i] for i in r]) for r in runs] == [20, 12]
    # asked for 3: the costliest run of 2+ items is halved
    assert len(padded_micro_batches(items, 20, 3)) == 3
    # a pair (RM / DPO) takes two rows padded to its longer sequence
    assert padded_cost([Item(0, 5, rows=2, tokens=8), Item(0, 3, rows=2, tokens=6)]) == 4 * 5


@pytest.mark.parametrize("packed", [False, True])
def test_plan_step_same_count_on_every_rank(packed):
    g = torch.Generator().manual_seed(0)
    lens = (torch.randint(1, 60, (32,), generator=g) ** 2 // 60 + 1).tolist()  # skewed
    items = [Item(2, n) for n in lens]
    world, budget = 4, 64
    ranks, micro = plan_step(items, world, budget, packed)
    assert sorted(i for r in ranks for i in r) == list(range(32)), "every row on exactly one rank"
    assert len({len(m) for m in micro}) == 1, f"micro-batch counts differ between ranks: {[len(m) for m in micro]}"
    for r, ms in zip(ranks, micro):
        assert sorted(i for m in ms if m is not None for i in m) == sorted(r)
        for m in ms:
            if m is not None:
                cost = (sum(items[i].tokens for i in m) if packed else padded_cost([items[i] for i in m]))
                assert cost <= budget, f"a micro-batch of {cost} tokens under a budget of {budget}"
    sums = [sum(items[i].tokens for i in r) for r in ranks]
    assert max(sums) - min(sums) <= max(it.tokens for it in items), f"ranks' token sums unbalanced: {sums}"


def test_flags_and_parse_time_errors(capsys):
    cfg = parse("ppo", ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096",
                        "--rollout.max_tokens_per_gpu", "8192", "--ds.adam_offload"])
    assert cfg.optim.use_dynamic_batch and cfg.optim.train_max_tokens_per_gpu == 4096
    assert cfg.rollout.rollout_max_tokens_per_gpu == 8192 and cfg.topology.adam_offload
    flat = parse("ppo", ["--use_dynamic_batch", "--max_tokens_per_gpu", "3000"])  # OpenRLHF's first name
    assert flat.optim.train_max_tokens_per_gpu == 3000
    assert parse("sft", []).optim.train_max_tokens_per_gpu == 16192, "OpenRLHF's default"
    # a budget below the longest sequence is accepted (issue 41 item 12: OpenRLHF's
    # train_reinforce_baseline_hybrid_engine.sh, 74240-token sequences under --train.max_tokens_per_gpu 16192)
    big = parse("ppo", ["--use_dynamic_batch", "--train_max_tokens_per_gpu", "600", "--ring_attn_size", "2",
                        "--packing_samples"])
    assert big.optim.train_max_tokens_per_gpu == 600
    with pytest.raises(click.UsageError, match=r"--train_max_tokens_per_gpu must be >= 1 token, got 0"):
        parse("sft", ["--use_dynamic_batch", "--train_max_tokens_per_gpu", "0"])
    with pytest.raises(click.UsageError, match=r"--adam_offload .*ZeRO stages 1-3 only: use --zero_stage 1"):
        parse("sft", ["--adam_offload", "--backend", "deepspeed", "--zero_stage", "0"])
    assert parse("sft", ["--adam_offload", "--backend", "deepspeed", "--zero_stage", "1"]).topology.adam_offload


def test_deepspeed_config_offloads_optimizer():
    from rlhf.engines.deepspeed_engine import deepspeed_config
    from rlhf.engines.train import EngineSpec

    spec = EngineSpec(lr=1e-5, train_batch_size=8, micro_batch_size=2, total_steps=4, zero_stage=2, adam_offload=True)
    cfg = deepspeed_config(spec, dp=2)
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "zero_force_ds_cpu_optimizer" not in cfg, "DeepSpeedCPUAdam (the accelerator path) needs no override"
    cpu = deepspeed_config(spec, dp=2, ds_cpu_adam=False)
    assert cpu["zero_force_ds_cpu_optimizer"] is False, "a torch AdamW under ZeRO offload needs the check off"
    assert "offload_optimizer" not in deepspeed_config(EngineSpec(lr=1e-5, train_batch_size=8, micro_batch_size=2,
                                                                  total_steps=4, zero_stage=2), dp=2)["zero_optimization"]
    frozen = EngineSpec(lr=0.0, train_batch_size=4, micro_batch_size=2, total_steps=1, adam_offload=True,
                        trainable=False)
    assert "offload_optimizer" not in deepspeed_config(frozen, dp=2)["zero_optimization"], "a frozen model has no Adam"


class _Engine:
    """The TrainEngine contract the loop relies on: backward divides the loss by accum_steps."""

    def __init__(self, model, accum_steps):
        self.model, self.accum_steps = model, accum_steps

    def backward(self, loss, micro_step, last=None):
        (loss / self.accum_steps).backward()


def _trainer(tiny_kit, task_name, dynamic, budget=64):
    import json

    from rlhf.config.schema import TrainConfig
    from rlhf.models.load import load_causal_lm, load_tokenizer
    from rlhf.supervised.tasks import DPOTask, SFTTask
    from rlhf.supervised.trainer import SupervisedTrainer

    cfg = TrainConfig()
    cfg.optim.train_batch_size, cfg.optim.micro_train_batch_size = 8, 2
    cfg.optim.use_dynamic_batch, cfg.optim.train_max_tokens_per_gpu = dynamic, budget
    tok = load_tokenizer(tiny_kit, padding_side="right")
    task = make_task(SFTTask if task_name == "sft" else DPOTask, cfg, tok)
    kind = "sft" if task_name == "sft" else "pref"
    with open(f"{tiny_kit}/data/{kind}_train.jsonl") as fh:
        rows = [json.loads(line) for line, _ in zip(fh, range(8))]
    tr = SupervisedTrainer.__new__(SupervisedTrainer)
    tr.cfg, tr.task = cfg, task
    tr.train_samples = [task.make_sample(r) for r in rows]
    tr.steps_per_epoch, tr.rank, tr.world, tr.dp_rank, tr.dp_world = 1, 0, 1, 0, 1
    torch.manual_seed(0)
    model = load_causal_lm(tiny_kit)
    if task_name == "dpo":
        task.ref = None
        tr.train_samples = [(c, r, (-5.0, -6.0)) for c, r, _ in tr.train_samples]  # precomputed reference
    tr.engine = _Engine(model, accum_steps=4)
    return tr


def _step(tr):
    tr.engine.model.zero_grad(set_to_none=True)
    logs = tr.accumulate(tr.batches_for(0))
    return logs, [p.grad.clone() for p in tr.engine.model.parameters() if p.grad is not None]


def test_supervised_token_budgets_weigh_the_step(tiny_kit):
    # DPO: the step's loss is the mean over pairs either way, so budgets change nothing (to float rounding)
    fixed = _trainer(tiny_kit, "dpo", dynamic=False)
    dyn = _trainer(tiny_kit, "dpo", dynamic=True, budget=56)
    (lf, gf), (ld, gd) = _step(fixed), _step(dyn)
    assert len(dyn.batches_for(0)) != len(fixed.batches_for(0)), "the budget should change the micro-batches"
    assert abs(sum(lf["loss"]) / len(lf["loss"]) - ld["loss"][0]) < 1e-5, (lf["loss"], ld["loss"])
    gap = max((a - b).abs().max().item() for a, b in zip(gf, gd))
    assert gap < 1e-5, f"DPO gradients differ by {gap} between token budgets and fixed micro-batches"
    # SFT: token budgets give the step's token mean (OpenRLHF main's SFT normalisation), by hand from one forward
    sft = _trainer(tiny_kit, "sft", dynamic=True, budget=40)
    ls, gs = _step(sft)
    model, samples = sft.engine.model, sft.train_samples
    model.zero_grad(set_to_none=True)
    b = sft.task.batch(model, samples)
    from rlhf.supervised.tasks import token_logprobs

    m = b["loss_mask"][:, 1:].float()
    want = -(token_logprobs(model, b, 1024) * m).sum() / m.sum()
    want.backward()
    assert abs(ls["loss"][0] - float(want)) < 1e-5, (ls["loss"], float(want))
    gap = max((a - p.grad).abs().max().item() for a, p in zip(gs, [p for p in model.parameters() if p.grad is not None]))
    assert gap < 1e-5, f"SFT gradient under token budgets differs from the step's token mean by {gap}"


@pytest.mark.parametrize("packed", [False, True])
def test_inference_plan_reorders_and_restores(packed):
    """The inference forwards' plan: each DP rank's rows and micro-batches are contiguous slices of the reordered
    batch, a forward run through the role's gather puts every row's output back in the batch's order, and packed
    micro-batches stay within the budget."""
    from helpers.batching_checks import skewed_experience

    from rlhf.batch import Batch
    from rlhf.rl.components import InferencePlan

    e = skewed_experience()
    batch = Batch(sequences=e.sequences, attention_mask=e.attention_mask, action_mask=e.action_mask,
                  rollout_logprobs=e.rollout_logprobs, prompt_len=6)
    plan = InferencePlan(batch, 2, 18, packed)
    assert sorted(plan.perm.tolist()) == list(range(8)) and torch.equal(plan.perm[plan.inverse], torch.arange(8))
    out = torch.zeros(8, dtype=torch.long)
    counts = set()
    for i in range(2):
        rows, parts = plan.rows(i), plan.plan(i)
        counts.add(len(parts))
        real = [p for p in parts if p is not None]
        assert sum(p.stop - p.start for p in real) == rows.stop - rows.start
        for p in real:
            assert rows.start <= p.start < p.stop <= rows.stop
            out[p] = plan.perm[p]  # the "forward" of a row is its index in the batch
            tokens = int(batch.attention_mask[plan.perm[p]].sum())
            assert not packed or tokens <= 18, f"a packed micro-batch of {tokens} tokens under 18"
    assert len(counts) == 1, "every DP rank runs the same number of forwards"
    assert torch.equal(out[plan.inverse], torch.arange(8)), "outputs are not restored to the batch's order"


@pytest.mark.parametrize("packed", [False, True])
def test_over_budget_sequence_gets_a_micro_batch_of_its_own(packed):
    """Issue 41 item 12: OpenRLHF (openrlhf/utils/seqlen_balancing.py ``get_minimum_num_micro_batch_size``) puts a
    sequence longer than the token budget in a bin of its own; so does the plan here, on every rank, and counts
    such micro-batches (metric over_budget_micro_batches) instead of refusing."""
    import warnings

    from rlhf.algorithms.seqlen_balancing import OVER_BUDGET

    items = [Item(2, n) for n in (100, 8, 8, 6, 70, 4, 4, 2)]   # two rows over a budget of 32 tokens
    OVER_BUDGET.take()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks, micro = plan_step(items, 2, 32, packed)
    assert sorted(i for r in ranks for i in r) == list(range(8))
    assert len({len(m) for m in micro}) == 1, f"micro-batch counts differ between ranks: {micro}"
    for ms in micro:
        for m in ms:
            if m is None:
                continue
            cost = sum(items[i].tokens for i in m) if packed else padded_cost([items[i] for i in m])
            assert cost <= 32 or len(m) == 1, f"an over-budget sequence shares a micro-batch: {m} ({cost} tokens)"
    alone = sorted(m[0] for ms in micro for m in ms if m is not None and len(m) == 1 and items[m[0]].tokens > 32)
    assert alone == [0, 4], f"rows 0 and 4 (102 and 72 tokens) should each run alone, got {micro}"
    assert OVER_BUDGET.take() == 2, "the two over-budget micro-batches are counted"
    assert OVER_BUDGET.take() == 0, "take() resets the count"
