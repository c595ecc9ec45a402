"""vLLM's sleep protocol: the fake keeps vLLM's contract (tests/helpers/vllm_fake.py), the engine's ``EngineMemory`` wakes
tag by tag with PyTorch's cache emptied first and picks the sleep level, and the real RL stage sequence
(colocated, sleep on, eval, resume, dynamic filtering) runs against the fake in one process.

Also the engine's pure helpers: the CUDA device mask, the memory check, the engine arguments and dtype.
"""
import os
import shutil

import pytest
import torch
from helpers.e2e import flags_argv
from helpers.vllm_fake import FakeCudaError, FakeDevice, FakeLLM, fake_vllm

from rlhf.engines.rollout import SamplingParams

PROMPTS = [[5, 6, 7], [8, 9], [11, 12, 13, 14]]


# ---- the fake itself raises where vLLM fails -----------------------------------------------------------------------
def test_fake_raises_where_vllm_fails(tiny_kit):
    dev = FakeDevice()
    FakeLLM.device = dev
    llm = FakeLLM(tiny_kit, enable_sleep_mode=True)
    sp = dict(n=1, max_tokens=4)
    from helpers.vllm_fake import SamplingParams as SP

    llm.sleep(level=1)
    assert dev.mapped == set()
    llm.wake_up(tags=["weights"])
    with pytest.raises(FakeCudaError, match="already mapped"):  # wake_up(None) after a partial wake re-maps weights
        llm.wake_up(tags=None)
    with pytest.raises(FakeCudaError, match="not in sleeping tags"):  # vLLM would wake neither tag
        llm.wake_up(tags=["weights", "kv_cache"])
    with pytest.raises(FakeCudaError, match="sleep releases every allocation"):  # sleep while kv_cache is unmapped
        llm.sleep(level=1)
    dev.hold_cached(80)  # the actor's backward left its blocks in PyTorch's cache
    with pytest.raises(FakeCudaError, match="out of memory mapping kv_cache"):
        llm.wake_up(tags=["kv_cache"])
    dev.empty_cache()
    assert llm.wake_up(tags=["kv_cache"]) is True
    assert len(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP(**sp))) == 3
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(FakeCudaError, match="garbage weights"):  # level 2 dropped them; no sync yet
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SP(**sp))
    params = list(llm.hf.model.named_parameters())
    llm.collective_rpc("rlhf_load_weights", args=([(n, p.detach().clone()) for n, p in params[:-1]], "reload"))
    with pytest.raises(FakeCudaError, match="garbage weights"):  # one tensor still missing
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SP(**sp))
    llm.collective_rpc("rlhf_load_weights", args=([(n, p.detach().clone()) for n, p in params[-1:]], "reload"))
    assert len(llm.generate([{"prompt_token_ids": PROMPTS[0]}], SP(**sp))) == 1


# ---- the engine's memory state machine against the fake ------------------------------------------------------------
@pytest.fixture
def fake_engine(tiny_kit, monkeypatch):
    dev = fake_vllm(monkeypatch)
    from rlhf.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(tiny_kit, 1, mode="colocated", max_model_len=64, enable_sleep=True, sleep_level=2,
                     enforce_eager=True, dummy_weights=False, log=lambda *_: None)
    return eng, dev, FakeLLM.instances[-1]


def _sync(eng):
    """What WeightSync does for a colocated engine: every tensor in buckets, then the prefix-cache reset."""
    named = [(n, p.detach().clone()) for n, p in FakeLLM.instances[-1].hf.model.named_parameters()]
    eng.load_weights(named[: len(named) // 2])
    eng.load_weights(named[len(named) // 2:])
    eng.reset_prefix_cache()


def test_engine_wakes_each_tag_once_after_emptying_the_cache(fake_engine):
    eng, dev, llm = fake_engine
    assert eng.memory_state() == "full"
    eng.sleep()  # nothing said a sync follows: level 1 keeps the weights
    assert llm.calls[-1] == ("sleep", 1) and eng.memory_state() == "asleep"
    dev.hold_cached(80)
    eng.wake(["weights"])  # the weight-sync phase
    assert eng.memory_state() == "weights"
    _sync(eng)
    dev.hold_cached(80)
    eng.wake()  # the next rollout: maps what is missing, the KV cache, never wake_up(None)
    assert eng.memory_state() == "full"
    wakes = [c for c in llm.calls if c[0] == "wake_up"]
    assert wakes == [("wake_up", ("weights",)), ("wake_up", ("kv_cache",))], wakes
    assert dev.events[-6:] == ["cached:80", "empty_cache", "map:weights", "cached:80", "empty_cache",
                               "map:kv_cache"], dev.events
    eng.wake()  # already full: no call into vLLM
    assert [c for c in llm.calls if c[0] == "wake_up"] == wakes
    out = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=7))
    assert out.sequences.shape[0] == 6


def test_level_two_only_when_a_sync_follows(fake_engine):
    eng, dev, llm = fake_engine
    eng.sync_follows()  # the step's rollout is done
    eng.sleep()
    assert llm.calls[-1] == ("sleep", 2)
    eng.wake()
    with pytest.raises(RuntimeError, match="level-2 sleep discarded its weights"):  # our check, before vLLM's
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    eng.sleep()  # asleep again without a hint, but the weights are garbage until a sync: level 2 again (level 1
    assert llm.calls[-1] == ("sleep", 2)  # would copy them to pinned host memory and back, for nothing)
    eng.wake(["weights"])
    _sync(eng)
    eng.wake()
    assert eng.generate(PROMPTS, SamplingParams(max_new_tokens=3)).sequences.shape[0] == 3
    eng.sync_follows()
    eng.wake(["weights"])  # any wake clears the hint: a later sleep keeps the weights
    eng.sleep()
    assert llm.calls[-1] == ("sleep", 1)


def test_sleep_of_a_partial_engine_maps_its_kv_cache_first(fake_engine):
    eng, dev, llm = fake_engine
    eng.sleep()
    eng.wake(["weights"])
    eng.sleep()  # vLLM's allocator would unmap the unmapped KV cache again
    assert [c for c in llm.calls if c[0] in ("sleep", "wake_up")][-2:] == [("wake_up", ("kv_cache",)),
                                                                          ("sleep", 1)]


def test_one_reseed_per_generate_and_no_request_seeds(fake_engine):
    """Seeds: one sampler reset per call (vLLM samples seeded requests one by one), same seed -> same samples."""
    eng, dev, llm = fake_engine
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=11)
    a, b = eng.generate(PROMPTS, p), eng.generate(PROMPTS, p)
    assert torch.equal(a.sequences, b.sequences)
    assert set(llm.request_seeds) == {None}, "a per-request seed reached vLLM"
    assert [c for c in llm.calls if c[0] == "rpc"].count(("rpc", "rlhf_reseed")) == 2
    c = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=12))
    assert not torch.equal(a.sequences, c.sequences)


def test_scheduler_asks_the_engine_state(fake_engine):
    """The weight-sync phase leaves the engine at ``weights``; the next rollout phase completes it (one call)."""
    from rlhf.distributed import Ledger, PhaseScheduler

    eng, dev, llm = fake_engine

    class Actor:
        state = "full"

        def sleep(self):
            self.state = "asleep"

        def wake(self, tags=None):
            self.state = "full"

        def memory_state(self):
            return self.state

        def sync_follows(self):
            pass

    sched = PhaseScheduler(0, {"rollout": eng, "actor": Actor()}, ledger=Ledger(0), barrier=False)
    sched.put_all_to_sleep()
    with sched.phase("weight_sync", role="rollout", share="actor", tags=["weights"]):
        _sync(eng)
    assert sched.memory_state("rollout") == "weights"
    with sched.phase("rollout", role="rollout"):
        assert sched.memory_state("rollout") == "full"
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    sched.sync_follows("rollout")
    with sched.phase("actor", role="actor"):
        assert sched.memory_state("rollout") == "asleep"
    assert [c for c in llm.calls if c[0] in ("sleep", "wake_up")] == [
        ("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("sleep", 2)]


# ---- the RL stage sequence against the fake -----------------------------------------------------------------------
def _argv(kit, tmp, name, **over):
    d = os.path.join(kit, "data")
    args = {"pretrain": kit, "prompt_data": f"{d}/prompts_train.jsonl", "eval_dataset": f"{d}/prompts_eval.jsonl",
            "remote_rm_url": "builtin:arithmetic", "generate_max_len": 4, "rollout_batch_size": 4,
            "n_samples_per_prompt": 2, "train_batch_size": 8, "micro_train_batch_size": 4,
            "micro_rollout_batch_size": 8, "max_global_steps": 4, "eval_steps": 2, "save_steps": 2,
            "eval_temperature": 0.0, "eval_n_samples_per_prompt": 1,
            "colocate_all_models": True, "vllm_enable_sleep": True, "rollout_engine": "vllm",
            "ckpt_path": tmp / "ck", "save_path": tmp / name / "model", "log_dir": tmp / name / "logs", "seed": 3}
    args.update(over)
    return flags_argv(args)


def _run(argv):
    """One RLTrainer in this process (a 1-rank group), fit, close; returns (train rows, eval rows, fake LLM)."""
    from rlhf.config import parse
    from rlhf.rl.trainer import RLTrainer
    from rlhf.train_grpo import GRPO_DEFAULTS
    from rlhf.utils.logging import read_metrics

    cfg = parse("grpo", argv, GRPO_DEFAULTS)
    trainer = RLTrainer(cfg, "grpo")
    try:
        trainer.fit()
    finally:
        trainer.close()
    rows = read_metrics(os.path.join(cfg.logging.log_dir, "metrics.jsonl"))
    return ([r for r in rows if r["split"] == "train"], [r for r in rows if r["split"] == "eval"],
            FakeLLM.instances[-1])


def _fake_backward_cache(monkeypatch, dev):
    """Each actor update leaves 80 of the device's 100 units in PyTorch's cache (the fake OOMs a wake on it)."""
    from rlhf.roles.actor import Actor

    real = Actor.update

    def update(*a, **kw):
        out = real(*a, **kw)
        dev.hold_cached(80)
        return out

    monkeypatch.setattr(Actor, "update", update)


def _protocol(llm):
    return [c for c in llm.calls if c[0] in ("sleep", "wake_up")]


def test_rl_stages_sleep_eval_resume_against_the_fake(tiny_kit, tmp_path, monkeypatch):
    """4 steps (eval and checkpoint every 2), then a resume from step 2: every wake names one tag, each sleep's level
    follows what comes next, and the resumed steps equal the uninterrupted run's."""
    dev = fake_vllm(monkeypatch)
    _fake_backward_cache(monkeypatch, dev)
    full, ev, llm = _run(_argv(tiny_kit, tmp_path, "a"))
    assert [r["step"] for r in full] == [1, 2, 3, 4] and len(ev) == 2
    proto = _protocol(llm)
    assert all(c[1] is not None and len(c[1]) == 1 for c in proto if c[0] == "wake_up"), proto
    # init: level 2 (the engine starts on dummy weights, the first sync brings the actor's); each step: wake
    # weights + kv for the rollout, level 2 after it,
    # weights for the sync; eval after steps 2 and 4: kv only, then level 1 (the next rollout needs the weights)
    step = [("wake_up", ("kv_cache",)), ("sleep", 2), ("wake_up", ("weights",))]
    evals = [("wake_up", ("kv_cache",)), ("sleep", 1), ("wake_up", ("weights",))]
    want = ([("sleep", 2), ("wake_up", ("weights",))] + step + step + evals + step + step
            + [("wake_up", ("kv_cache",)), ("sleep", 1)])
    assert proto == want, proto
    assert "cached:80" in dev.events and set(llm.request_seeds) == {None}
    shutil.rmtree(tmp_path / "ck" / "global_step_4")  # as if the run had stopped after step 2's checkpoint
    resumed, _, llm2 = _run(_argv(tiny_kit, tmp_path, "b", load_checkpoint=True))
    assert [r["step"] for r in resumed] == [3, 4]
    assert _protocol(llm2)[:3] == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    for a, b in zip(full[2:], resumed):
        for k in ("reward", "policy_loss", "kl", "response_len"):
            assert a[k] == pytest.approx(b[k], abs=1e-6), (k, a[k], b[k])


def test_rl_refill_rounds_keep_weights_against_the_fake(tiny_kit, tmp_path, monkeypatch):
    """Dynamic filtering generates again after scoring, with no sync between.  A reward function holds no device
    memory, so the engine stays awake from round to round (no sleep, no wake between them), and the last round's
    sleep is level 2, as ``rollout_stage``'s: the step's weight sync follows it (issue 40 item 12; veRL sleeps vLLM
    at level 2 where its weights are synced before the next generate)."""
    dev = fake_vllm(monkeypatch)
    _fake_backward_cache(monkeypatch, dev)
    train, _, llm = _run(_argv(tiny_kit, tmp_path, "f", max_global_steps=2, save_steps=-1, eval_steps=-1,
                               dynamic_filtering=True, dynamic_filtering_reward_range=(0.01, 0.99),
                               dynamic_filtering_max_rounds=1))
    assert [r["step"] for r in train] == [1, 2]
    rounds = [r["dynamic_filter_rounds"] for r in train]
    assert rounds == [2, 2], f"the tiny model's groups should fail the range and refill once per step: {rounds}"
    proto = _protocol(llm)
    assert all(c[1] is not None and len(c[1]) == 1 for c in proto if c[0] == "wake_up"), proto
    # after the start-up (a sleep, the weights woken for the first sync): each step wakes the KV cache, runs two
    # rounds with nothing moved between them, sleeps at level 2 after the last and wakes the weights for the sync;
    # the final eval (no sync follows it): level 1
    step = [("wake_up", ("kv_cache",)), ("sleep", 2), ("wake_up", ("weights",))]
    want = [("wake_up", ("weights",))] + step + step + [("wake_up", ("kv_cache",)), ("sleep", 1)]
    assert proto[0][0] == "sleep" and proto[1:] == want, f"got {proto}"
    # 2 steps x 2 rounds + the final eval
    assert sum(1 for c in llm.calls if c[0] == "generate") == 5


# ---- pure helpers ---------------------------------------------------------------------------------------------------
def test_visible_devices_index_the_parent_mask():
    from rlhf.engines.vllm_launch import visible_devices

    assert visible_devices([0, 1], "4,5,6,7") == "4,5"
    assert visible_devices([2, 3], "4,5,6,7") == "6,7"
    assert visible_devices([1], None) == "1"
    with pytest.raises(RuntimeError, match="holds 2.*--vllm_tensor_parallel_size"):
        visible_devices([2], "4,5")


def test_free_memory_check_names_a_utilization_that_fits():
    from rlhf.engines.vllm_launch import check_free_memory

    g = 2**30
    check_free_memory(0.5, 60 * g, 100 * g)
    with pytest.raises(RuntimeError, match=r"--vllm_gpu_memory_utilization 0\.38 \(or less\)"):
        check_free_memory(0.5, 40 * g, 100 * g)


def test_engine_arguments_and_dtype():
    from rlhf.engines.vllm_launch import MAX_NUM_BATCHED_TOKENS, default_dtype, engine_kwargs

    common = dict(tp_size=1, max_model_len=1024, seed=5, dtype="bfloat16", enforce_eager=False, enable_sleep=True,
                  gpu_memory_utilization=0.4, kv_cache_memory_bytes=None)
    gpu = engine_kwargs("m", cuda=True, **common)
    assert gpu["max_num_batched_tokens"] == MAX_NUM_BATCHED_TOKENS == 4096 and "kv_cache_memory_bytes" not in gpu
    assert engine_kwargs("m", cuda=True, **{**common, "max_model_len": 8192})["max_num_batched_tokens"] == 8192
    cpu = engine_kwargs("m", cuda=False, **common)
    assert "max_num_batched_tokens" not in cpu and cpu["kv_cache_memory_bytes"] == 256 << 20
    assert cpu["worker_extension_cls"] == "rlhf.engines.vllm_engine.RolloutWorkerExtension"
    assert (default_dtype(True, False), default_dtype(False, False), default_dtype(False, True)) == \
        ("bfloat16", "float32", "bfloat16")
