"""The MoE gate of bench/gpu.sh (issue 45): on the device (CUDA when there is one, else CPU),

  kernels   transformers' eager / batched_mm / grouped_mm experts give the same loss and gradients (fp32: 1e-5;
            bf16: the spread is printed, the gate asks 5e-2) -- on CUDA grouped_mm is torch's grouped GEMM kernel
  replay    a bf16 HF rollout engine records its routing, an fp32 trainer replays it (R3): mismatch 0 on every
            token, the log-prob gap below the gap without replay; the hooks' ids live on the model's device

    python bench/moe_gpu.py [--device cuda|cpu]       prints "GATE moe: PASS|FAIL <figures>"
"""
from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import click
import torch


def tiny_moe(device, seed: int = 2, router_std: float = 0.03, expert_std: float = 1.0):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                         experts_implementation="eager")
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, router_std)
            if ".mlp.experts." in n:
                p.normal_(0, expert_std)
    return m.to(device)


def kernels(device, dtype) -> float:
    """The largest loss / gradient difference of batched_mm and grouped_mm from eager."""
    from rlhf.models import moe

    ids = torch.randint(0, 96, (3, 37), generator=torch.Generator().manual_seed(0)).to(device)
    got = {}
    for impl in ("eager", "batched_mm", "grouped_mm"):
        m = tiny_moe(device, router_std=0.5, expert_std=0.02).to(dtype)
        moe.set_experts(m, impl)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        got[impl] = (loss.detach().float(), {n: p.grad.float() for n, p in m.named_parameters()})
    worst = 0.0
    for impl in ("batched_mm", "grouped_mm"):
        worst = max(worst, float((got[impl][0] - got["eager"][0]).abs()),
                    *(float((g - got["eager"][1][n]).abs().max()) for n, g in got[impl][1].items()))
    return worst


def replay(device) -> dict:
    from rlhf.engines.hf_engine import HFEngine
    from rlhf.engines.rollout import SamplingParams
    from rlhf.models.forward import action_logprobs
    from rlhf.roles.routing import RouteLog

    trainer = tiny_moe(device)
    engine = HFEngine(copy.deepcopy(trainer).to(torch.bfloat16), SimpleNamespace(pad_token_id=0, eos_token_id=2),
                      device=torch.device(device))
    assert engine.record_routing()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (4, 2, 7, 5, 3, 6, 9, 1)]
    b = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=4))
    mask = b.action_mask.float().to(device)
    out = {}
    for mode in ("off", "R3"):
        log = RouteLog(mode, trainer, actor=True)
        att = b.attention_mask.to(device)
        with log.forward("old", b.routed_experts, att, False), torch.no_grad():
            lp = action_logprobs(trainer, b.sequences.to(device), att, b.num_actions)[0]
        m = log.take()
        out[mode] = (m["router/old_mismatch"], m["router/old_mismatch_own"],
                     float(((lp - b.rollout_logprobs.to(device)).abs() * mask).sum() / mask.sum()))
    return out


@click.command()
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True)
def main(device):
    fp32, bf16 = kernels(device, torch.float32), kernels(device, torch.bfloat16)
    r = replay(device)
    ok = fp32 < 1e-5 and bf16 < 5e-2 and r["R3"][0] == 0.0 and r["off"][0] > 0 and r["R3"][2] < r["off"][2]
    print(f"GATE moe: {'PASS' if ok else 'FAIL'} device={device} kernels_fp32_maxdiff={fp32:.2e} "
          f"kernels_bf16_maxdiff={bf16:.2e} mismatch_off={r['off'][0]:.4f} mismatch_r3={r['R3'][0]:.4f} "
          f"gap_off={r['off'][2]:.2e} gap_r3={r['R3'][2]:.2e}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
