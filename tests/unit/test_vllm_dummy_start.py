"""Colocated vLLM starts on dummy weights and takes the trainer's at the first sync (issue 40 item 7): no rank reads
the checkpoint a second time (a 70B model: 140 GB per rank at start-up).  veRL's colocated rollout does the same
(rollout ``load_format: dummy``, the actor's weights synced before the first generate); vLLM's DummyModelLoader
(vllm/model_executor/model_loader/dummy_loader.py) fills random values and reads no file.  Checked against the vLLM
fake (tests/helpers/vllm_fake.py), which starts on random weights under ``load_format="dummy"`` and refuses to generate
until every weight was loaded."""
import pytest
from helpers.vllm_fake import FakeLLM, fake_vllm
from test_sleep_protocol import PROMPTS, _argv, _run, _sync


def test_colocated_engine_builds_on_dummy_weights_and_waits_for_the_first_sync(tiny_kit, monkeypatch):
    fake_vllm(monkeypatch)
    from rlhf.engines.rollout import SamplingParams
    from rlhf.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(tiny_kit, 1, mode="colocated", max_model_len=64, enforce_eager=True, dummy_weights=True,
                     log=lambda *_: None)
    llm = FakeLLM.instances[-1]
    assert llm.kw.get("load_format") == "dummy" and eng.needs_weights
    with pytest.raises(RuntimeError, match="dummy weights it started on, before a weight sync"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    _sync(eng)
    assert not eng.needs_weights
    eng.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    sep = VLLMEngine(tiny_kit, 1, mode="separate", max_model_len=64, enforce_eager=True, log=lambda *_: None)
    assert "load_format" not in FakeLLM.instances[-1].kw and not sep.needs_weights  # own processes: read it


def test_trainer_syncs_before_the_first_generate(tiny_kit, tmp_path, monkeypatch):
    """GRPO, colocated vLLM (the fake) on one rank: the first thing the engine receives is the actor's weights,
    before any generate; the run trains (the fake would raise on a generate with its random start weights)."""
    fake_vllm(monkeypatch)
    train, _, llm = _run(_argv(tiny_kit, tmp_path, "d", max_global_steps=1, save_steps=-1, eval_steps=-1))
    assert [r["step"] for r in train] == [1]
    kinds = [c[0] if c[0] != "rpc" else c[1] for c in llm.calls]
    assert kinds.index("rlhf_load_weights") < kinds.index("generate"), kinds
    assert llm.kw.get("load_format") == "dummy"
    # every sleep before the first weights arrive discards (level 2): a level-1 sleep would copy the random start
    # weights to pinned host memory and back (vllm/entrypoints/llm.py sleep: level 1 offloads the weights to CPU)
    early = [c for c in llm.calls[:kinds.index("rlhf_load_weights")] if c[0] == "sleep"]
    assert early and all(c[1] == 2 for c in early), llm.calls[:kinds.index("rlhf_load_weights")]
