"""HF rollout engine vs vLLM, same prompts and sampling, on this machine: generated tokens per second.

    python bench/rollout_engines.py --size task    # the built-in task on a vLLM-shaped tiny kit (hidden 128)
    python bench/rollout_engines.py --size large   # a larger random Llama (hidden 1024, 8 layers, head_dim 64)

Each engine generates once to warm up, then ``--reps`` timed rounds; prints one RESULT json line.
vLLM runs in-process (colocated mode, 1-rank gloo world), fp32 on CPU, bf16 on CUDA.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import click
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = {"task": dict(hidden=128, heads=4, kv_heads=2, layers=2),
         "medium": dict(hidden=512, heads=8, kv_heads=2, layers=4),
         "large": dict(hidden=1024, heads=16, kv_heads=4, layers=8)}


def kit(size: str) -> str:
    from rlhf.models.tiny_kit import make_tiny

    path = os.path.join(tempfile.gettempdir(), f"rlhf-engines-{size}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny(path, **SIZES[size])
    return path


def task_prompts(path: str, n: int):
    from rlhf.models.load import load_tokenizer

    tok = load_tokenizer(path)
    rows = [json.loads(x) for x in open(os.path.join(path, "data", "prompts_eval.jsonl"))]
    ids = [tok.apply_chat_template([{"role": "user", "content": r["input"]}], add_generation_prompt=True,
                                   tokenize=True) for r in rows]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    return [ids[i % len(ids)] for i in range(n)], tok


def timed(engine, prompts, params, reps):
    engine.generate(prompts[:4], params)  # warm-up
    toks, secs = 0, 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        b = engine.generate(prompts, params)
        secs += time.perf_counter() - t0
        toks += int(b.action_mask.sum())
    return toks / secs, toks / reps


@click.command()
@click.option("--size", type=click.Choice(sorted(SIZES)), default="task")
@click.option("--prompts", default=64, show_default=True)
@click.option("--n", default=4, show_default=True, help="samples per prompt")
@click.option("--max_new", default=64, show_default=True)
@click.option("--reps", default=2, show_default=True)
@click.option("--engines", default="hf,vllm", show_default=True)
def main(size, prompts, n, max_new, reps, engines):
    import torch.distributed as dist

    from rlhf.engines.rollout import SamplingParams

    path = kit(size)
    ps, tok = task_prompts(path, prompts)
    # no stop token the random models would emit early: every row generates max_new tokens on both engines
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, stop_token_ids=(tok.pad_token_id,), seed=0)
    res = {"size": size, "params_m": None, "prompts": prompts, "n": n, "max_new": max_new,
           "threads": torch.get_num_threads()}
    for name in engines.split(","):
        if name == "hf":
            from rlhf.engines.hf_engine import HFEngine
            from rlhf.models.load import load_causal_lm

            m = load_causal_lm(path)
            m.config.use_cache = True
            res["params_m"] = round(sum(p.numel() for p in m.parameters()) / 1e6, 1)
            res["hf_tokens_per_s"], res["hf_tokens"] = timed(HFEngine(m, tok, micro_batch_size=prompts * n), ps,
                                                             params, reps)
        elif name == "vllm":
            from rlhf.engines.vllm_engine import VLLMEngine

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29677"), RANK="0",
                              WORLD_SIZE="1", LOCAL_RANK="0")
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            t0 = time.perf_counter()
            eng = VLLMEngine(path, 1, mode="colocated", max_model_len=512, dtype="float32", enforce_eager=True,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            res["vllm_start_s"] = round(time.perf_counter() - t0, 1)
            res["vllm_tokens_per_s"], res["vllm_tokens"] = timed(eng, ps, params, reps)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
