"""Which weight loader an MoE policy gets in vLLM (rlhf.engines.vllm_worker.loader_for_moe): vLLM 0.32's fused
MoE keeps the experts in the checkpoint's layout only on its Triton backends (fused_moe/oracle/unquantized.py
``convert_to_unquantized_kernel_format``; the CPU experts prepack, experts/cpu_moe.py), and the direct loader writes
the checkpoint's layout straight into the parameters; only the in-place reload re-runs the conversion."""
import pytest

from rlhf.engines.vllm_worker import loader_for_moe


def test_auto_turns_direct_into_reload_where_an_moe_kernel_relays_its_weights():
    assert loader_for_moe("direct", "auto", [[], []]) == "direct"  # dense, or MoE on Triton (H100: checkpoint layout)
    assert loader_for_moe("direct", "auto", [["FLASHINFER_CUTLASS"], ["FLASHINFER_CUTLASS"]]) == "reload"
    assert loader_for_moe("reload", "auto", [["CPU"]]) == "reload"
    assert loader_for_moe("reload", "reload", [["CPU"]]) == "reload"


def test_an_explicit_direct_loader_is_refused_for_a_relaid_moe():
    with pytest.raises(ValueError, match=r"RLHF_VLLM_WEIGHT_LOADER=direct: vLLM's fused MoE \(AITER\).*"
                                         r"RLHF_VLLM_WEIGHT_LOADER=reload"):
        loader_for_moe("direct", "direct", [["AITER"], []])
