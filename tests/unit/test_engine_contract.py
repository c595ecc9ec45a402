"""The rollout-engine contract (rlhf.engines.rollout.RolloutEngine), the engine registry (rlhf.engines.rollout_registry) and the
phase scheduler asking the roles for their memory state (rlhf.distributed.phases): in-process, no vLLM."""
import os
import re

import pytest
import torch
from helpers.engine_standin import StandInEngine

from rlhf.distributed import Ledger, PhaseScheduler
from rlhf.engines import rollout_registry as registry
from rlhf.engines.hf_engine import HFEngine
from rlhf.engines.rollout import RolloutEngine
from rlhf.engines.vllm_engine import VLLMEngine
from rlhf.engines.vllm_memory import EngineMemory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _members(cls) -> set:
    return {n for n in vars(cls) if not n.startswith("_")}


def test_no_capability_probes_on_engines():
    """Every capability the trainer uses is declared on RolloutEngine, so nothing in the library asks for one of
    them with getattr / hasattr (a probe hides a misspelt or missing capability as "not supported")."""
    names = "|".join(sorted(_members(RolloutEngine)))
    pat = re.compile(rf"\b(?:getattr|hasattr)\([^()]*,\s*[\"']({names})[\"']")
    bad = []
    for d, _, files in os.walk(os.path.join(ROOT, "rlhf")):
        for f in (f for f in files if f.endswith(".py")):
            with open(os.path.join(d, f)) as fh:
                bad += [f"{f}:{i}: {line.strip()}" for i, line in enumerate(fh, 1) if pat.search(line)]
    assert not bad, "capability probes on engines:\n" + "\n".join(bad)


def test_engines_implement_the_whole_contract():
    """No abstract member left on the shipped engines; an engine without ``memory_state`` fails when built."""
    assert not HFEngine.__abstractmethods__ and not VLLMEngine.__abstractmethods__
    assert {"generate", "load_weights", "reset_prefix_cache", "sleep", "wake", "memory_state"} == \
        set(RolloutEngine.__abstractmethods__)

    class NoMemory(RolloutEngine):
        def generate(self, prompt_ids, params):
            return None

        def load_weights(self, named_tensors):
            pass

        def reset_prefix_cache(self):
            pass

        def sleep(self):
            pass

        def wake(self, tags=None):
            pass

    with pytest.raises(TypeError, match="memory_state"):
        NoMemory()


def test_defaults_mean_not_supported():
    e = StandInEngine()
    assert (e.max_model_len, e.needs_weights, e.tied_weights_apart, e.direct_weights, e.weight_workers()) == \
        (None, False, False, False, 0)
    assert e.shared_weight_names() == set()
    assert e.serve() is None and e.end_requests() is None and e.sync_follows() is None
    with pytest.raises(NotImplementedError, match="direct_weights is False"):
        e.receive_weights([])


def test_hf_engine_memory_state_and_tied_names():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    eng = HFEngine(AutoModelForCausalLM.from_config(cfg), tokenizer=None)
    assert eng.shared_weight_names() == {"lm_head.weight"}
    assert eng.memory_state() == "full"
    eng.sleep()  # on CPU nothing moves; the state still says a wake comes first
    assert eng.memory_state() == "asleep"
    eng.wake()
    assert eng.memory_state() == "full"


def test_engine_memory_without_sleep_mode_follows_the_protocol_without_calling_vllm():
    mem = EngineMemory(None, level=2, enabled=False)  # llm None: any call into vLLM would raise
    mem.sleep()
    assert mem.state == "asleep"
    mem.wake(["weights"])
    assert mem.state == "weights"
    mem.check_generate()  # nothing was released: generating is fine whatever the state says
    mem.wake()
    assert mem.state == "full" and mem.calls == []


class _Role:
    def __init__(self):
        self.state, self.hints = "full", 0

    def sleep(self):
        self.state = "asleep"

    def wake(self, tags=None):
        self.state = "weights" if tags == ["weights"] else "full"

    def memory_state(self):
        return self.state

    def sync_follows(self):
        self.hints += 1


def test_scheduler_keeps_no_copy_of_what_is_awake():
    """A role woken behind the scheduler's back is seen as awake at the next phase and put to sleep (a copy of the
    awake set would have missed it and left two roles resident)."""
    roles = {"actor": _Role(), "rollout": _Role()}
    sched = PhaseScheduler(0, roles, ledger=Ledger(0), barrier=False)
    sched.put_all_to_sleep()
    assert sched.awake == []
    roles["rollout"].wake()  # e.g. a direct engine call outside any phase
    with sched.phase("actor_train", role="actor"):
        assert sched.awake == ["actor"]
    assert sched.ledger.max_awake() == 1
    with sched.phase("weight_sync", role="rollout", share="actor", tags=["weights"]):
        assert sched.memory_state("rollout") == "weights" and sched.awake == ["actor", "rollout"]
    sched.sync_follows("rollout")
    sched.sync_follows("reward")  # not on this rank: nothing to tell
    assert roles["rollout"].hints == 1
    roles["actor"].state = "half"
    with pytest.raises(ValueError, match="'half'"):
        sched.memory_state("actor")


def test_registry_builds_by_name_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(registry, "_ENGINES", dict(registry._ENGINES))
    monkeypatch.setattr(registry, "_AUTO", [])
    assert registry.engine_kinds() == ("hf", "vllm")
    with pytest.raises(ValueError, match="registered already"):
        registry.register_engine("hf", "x:y")
    with pytest.raises(ValueError, match=r"--rollout_engine 'sglang'.*auto, hf, vllm"):
        registry.build_engine("sglang", registry.EngineArgs("m", torch.device("cpu"), 16))
    registry.register_engine("standin", "test_engine_contract:_build_standin", auto="test_engine_contract:_never")
    args = registry.EngineArgs("m", torch.device("cpu"), 16, place=registry.EnginePlace(3, [2, 3]))
    eng = registry.build_engine("standin", args)
    assert isinstance(eng, StandInEngine) and eng.args is args and not args.place.first
    assert registry.auto_engine("m", cuda=False) == ("hf", "too small for a stand-in")


def _build_standin(args):
    eng = StandInEngine()
    eng.args = args
    return eng


def _never(model_path, cuda):
    return False, "too small for a stand-in"


def test_rollout_engine_choices_come_from_the_registry():
    """--rollout_engine's choices are "auto" plus the registered engines (a new engine is one file plus one
    register_engine line), and reading them imports no engine code: a config-only process loads no torch."""
    import dataclasses
    import subprocess
    import sys

    from rlhf.config.schema import RolloutConfig
    field = next(f for f in dataclasses.fields(RolloutConfig) if f.name == "rollout_engine")
    assert field.metadata["choices"] == ("auto",) + registry.engine_kinds() == ("auto", "hf", "vllm")
    code = "import sys, rlhf.config; print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
