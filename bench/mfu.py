"""Model FLOP utilisation of the training step on this machine:  python bench/mfu.py [--device cpu|cuda]

peak: the best of a few large fp32 (CPU) / bf16 (CUDA) matmuls.
achieved: 6 * N_params * tokens (+ attention 12 * L * h * T^2 per sequence) per forward+backward+step
of the FSDP2 engine on a Qwen2-shaped model.  Writes bench/results/mfu_<device>.json.
"""
from __future__ import annotations

import json
import os
import sys
import time

import click
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS  # noqa: E402


def matmul_peak(device: str, n: int, dtype, reps: int = 5) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def train_flops_per_step(cfg, batch: int, seq: int) -> float:
    """6 N T + attention; N = the matmul parameters: the layers (grouped KV heads counted as they are) and the LM
    head (the embedding lookup does no matmul, tied or not)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", heads) * (h // heads)
    n_params = (cfg.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size)
                + cfg.vocab_size * h)
    attn = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq * seq * batch
    return 6 * n_params * batch * seq + attn


@click.command()
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu")
@click.option("--layers", default=4)
@click.option("--hidden", default=256)
@click.option("--batch", default=8)
@click.option("--seq", default=256)
@click.option("--steps", default=6)
@click.option("--shape", type=click.Choice(["custom", "qwen2.5-0.5b"]), default="custom",
              help="qwen2.5-0.5b: Qwen2.5-0.5B's config (bench/gpu_check.py QWEN_05B); custom: --layers/--hidden")
def main(device, layers, hidden, batch, seq, steps, shape):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29631"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    bf16 = device == "cuda"
    peak = matmul_peak(device, 8192 if device == "cuda" else 2048, torch.bfloat16 if bf16 else torch.float32)
    if shape == "qwen2.5-0.5b":
        from gpu_check import QWEN_05B

        cfg = Qwen2Config(**QWEN_05B)
        layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    else:
        cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                          num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                          max_position_embeddings=seq)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    eng = FSDP2Engine(model, EngineSpec(lr=1e-4, train_batch_size=batch, micro_batch_size=batch, total_steps=100,
                                        bf16=bf16), device=torch.device(device))
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    times = []
    for i in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = eng.model(input_ids=x, labels=x).loss
        eng.backward(loss, 0)
        eng.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = sorted(times[1:])[len(times[1:]) // 2]
    achieved = train_flops_per_step(cfg, batch, seq) / step
    res = {"device": device, "peak_flops": peak, "achieved_flops": achieved, "mfu": achieved / peak,
           "s_per_step": step, "threads": torch.get_num_threads(),
           "model": f"qwen2 {layers}L h{hidden}", "batch": batch, "seq": seq}
    print(f"peak {peak / 1e9:.1f} GFLOP/s ({'bf16' if bf16 else 'fp32'} matmul), train step {step:.3f}s = "
          f"{achieved / 1e9:.1f} GFLOP/s -> MFU {100 * achieved / peak:.1f}%")
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"mfu_{device}.json"), "w") as fh:
        json.dump(res, fh, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
