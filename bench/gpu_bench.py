"""One prepared GPU run (a lent H200): rollout tokens/s vs the bare engine, weight-sync GB/s,
memory before/after sleep, train MFU.  Each section reports on its own; a missing package is
reported, not fatal (vLLM is not on the device image and too large to carry: the rollout section then
measures the HF engine and says so; its vLLM path is unverified on a GPU).

    bash bench/gpu.sh        # under 8 minutes; writes $OUT/gpu_bench.json (or bench/results/)
    python bench/gpu_bench.py --smoke   # the same sections on the CPU with the tiny kit (tests run this)
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RES = {}
SMOKE = "--smoke" in sys.argv  # CPU, tiny model, small sizes: catches a broken script before a GPU is lent
DEV = torch.device("cpu" if SMOKE else "cuda")


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def allocated() -> int:
    return torch.cuda.memory_allocated() if DEV.type == "cuda" else 0


def section(name):
    def deco(fn):
        def run(*a):
            t0 = time.time()
            try:
                RES[name] = fn(*a)
            except Exception as e:  # report and go on
                RES[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            RES[name]["wall_s"] = round(time.time() - t0, 1)
            print(name, json.dumps(RES[name])[:600], flush=True)
        return run
    return deco


def qwen05_dir() -> str:
    """A Qwen2-0.5B-shaped model (random init, bf16) with the tiny tokenizer, built locally (--smoke: the tiny kit)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf.models.tiny_kit import build_tokenizer, make_tiny

    if SMOKE:
        path = os.path.join(tempfile.gettempdir(), "rlhf-gpu-bench-smoke-kit")
        return path if os.path.isfile(os.path.join(path, "config.json")) else make_tiny(path, arch="qwen2")
    path = os.path.join(tempfile.gettempdir(), "qwen05-shaped")
    if not os.path.isfile(os.path.join(path, "config.json")):
        tok = build_tokenizer()
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          bos_token_id=tok.bos_token_id, torch_dtype="bfloat16")
        AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
        tok.save_pretrained(path)
    return path


PROMPTS, NEW = (8, 8) if SMOKE else (256, 256)


def vllm_kit_dir() -> str:
    """--smoke with vLLM installed: a tiny kit vLLM's CPU attention runs (head_dim 32)."""
    from rlhf.models.tiny_kit import VLLM_KIT, make_tiny

    path = os.path.join(tempfile.gettempdir(), "rlhf-gpu-bench-smoke-vllm-kit")
    return path if os.path.isfile(os.path.join(path, "config.json")) else make_tiny(path, arch="qwen2", **VLLM_KIT)


def free_gpu() -> int:
    return torch.cuda.mem_get_info()[0] if DEV.type == "cuda" else 0


def vllm_rollout(vllm, path, prompts, params) -> dict:
    """Our vLLM engine vs bare vLLM (tokens/s), then the memory sequence the trainer runs each step, measured:
    rollout -> sleep (level 2: a sync follows) -> wake ``weights`` -> weight sync (GB/s) -> wake ``kv_cache`` ->
    greedy equal to the synced model's -> sleep (level 1: a generate follows, e.g. after eval) -> wake -> the same
    greedy output.  Each wake maps one tag once (``EngineMemory``).  Not yet run on a GPU (none with vLLM was lent):
    unverified there; ``--smoke`` runs it on CPU, where sleep mode does not exist (the sleeps are no-ops)."""
    from transformers import AutoModelForCausalLM

    from rlhf.distributed.weight_sync import WeightSync
    from rlhf.engines.rollout import SamplingParams
    from rlhf.engines.vllm_engine import VLLMEngine

    if SMOKE:
        path = vllm_kit_dir()
    dtype = torch.float32 if SMOKE else torch.bfloat16
    eng = VLLMEngine(path, 1, mode="colocated", max_model_len=1024, dtype=str(dtype).split(".")[1],
                     gpu_memory_utilization=0.5, enable_sleep=True, sleep_level=2, enforce_eager=SMOKE)
    llm = eng.llm
    sp = vllm.SamplingParams(max_tokens=NEW, temperature=1.0, ignore_eos=True)  # no per-request seed: vLLM's fast path
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], sp, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    bare_t = time.perf_counter() - t0
    bare_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
    eng.generate(prompts[:8], params)  # its first call with log-probs pays a one-off warm-up (3 s on CPU)
    t0 = time.perf_counter()
    b = eng.generate(prompts, params)
    ours_t = time.perf_counter() - t0
    res = {"engine": f"vllm {vllm.__version__}", "bare_tokens_per_s": bare_tok / bare_t,
           "ours_tokens_per_s": int(b.action_mask.sum()) / ours_t, "sleep_mode": eng.enable_sleep}
    # a changed model, synced into the engine the way a training step does it
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEV)
    with torch.no_grad():
        for p_ in model.parameters():
            p_.mul_(1.01)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8, stop_token_ids=(0,))
    free0 = free_gpu()
    eng.sync_follows()
    eng.sleep()
    res["sleep_level2_frees_gb"] = (free_gpu() - free0) / 2**30
    eng.wake(["weights"])
    ws = WeightSync(None, eng, bucket_mb=512, dtype=dtype)
    sync()
    t0 = time.perf_counter()
    nbytes = ws.sync_colocated(model)
    sync()
    sync_t = time.perf_counter() - t0
    eng.wake()
    g = eng.generate(prompts[:4], greedy)
    ids = g.sequences[:, :g.prompt_len].to(DEV)
    want = model.generate(input_ids=ids, attention_mask=g.attention_mask[:, :g.prompt_len].to(DEV),
                          max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    res.update({"weight_sync_gb": nbytes / 2**30, "weight_sync_gb_per_s": nbytes / sync_t / 2**30,
                "greedy_agrees_with_synced_model": float((want[:, g.prompt_len:].cpu()
                                                          == g.sequences[:, g.prompt_len:]).float().mean())})
    free1 = free_gpu()
    eng.sleep()  # no sync follows: level 1 keeps the weights in host memory
    res["sleep_level1_frees_gb"] = (free_gpu() - free1) / 2**30
    eng.wake()
    again = eng.generate(prompts[:4], greedy)
    res["greedy_same_after_level1_wake"] = bool(torch.equal(again.sequences, g.sequences))
    res["sleep_calls"] = [list(c) for c in eng.memory.calls]
    return res


@section("rollout")
def rollout(path):
    """vLLM (when installed): ``vllm_rollout``.  Without vLLM: the HF engine vs generate()."""
    prompts = [[5 + (i % 50), 7, 9, 11] * 8 for i in range(PROMPTS)]
    from rlhf.engines.rollout import SamplingParams

    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=NEW, stop_token_ids=(0,), seed=0)
    try:
        import vllm  # noqa: F401
    except ImportError:
        vllm = None
    if vllm is not None:
        return vllm_rollout(vllm, path, prompts, params)
    from transformers import AutoModelForCausalLM

    from rlhf.data.formatting import pad_batch
    from rlhf.engines.hf_engine import HFEngine
    from rlhf.models.load import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV)
    tok = load_tokenizer(path)
    prompts = [[t % len(tok) for t in p] for p in prompts]
    ids, att = pad_batch(prompts, tok.pad_token_id, side="left")
    ids, att = ids.to(DEV), att.to(DEV)
    model.generate(input_ids=ids[:8], attention_mask=att[:8], max_new_tokens=8, do_sample=True,
                   pad_token_id=tok.pad_token_id)
    sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=NEW, do_sample=True, min_new_tokens=NEW,
                         pad_token_id=tok.pad_token_id)
    sync()
    bare = (out.shape[1] - ids.shape[1]) * PROMPTS / (time.perf_counter() - t0)
    eng = HFEngine(model, tok, DEV, micro_batch_size=PROMPTS)
    sync()
    t0 = time.perf_counter()
    b = eng.generate(prompts, params)
    sync()
    ours = int(b.action_mask.sum()) / (time.perf_counter() - t0)
    return {"engine": "hf (vllm not installed on this machine)", "bare_tokens_per_s": bare,
            "ours_tokens_per_s": ours}


@section("weight_sync_and_sleep")
def sync_and_sleep(path):
    from transformers import AutoModelForCausalLM

    from rlhf.config.schema import TopologyConfig
    from rlhf.distributed import build_groups, make_placement
    from rlhf.distributed.weight_sync import WeightSync, full_tensor
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    dev = DEV
    actor = FSDP2Engine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                        EngineSpec(lr=1e-5, train_batch_size=1, micro_batch_size=1, total_steps=10,
                                   bf16=not SMOKE), device=dev)
    x = torch.randint(0, 200, (1, 64), device=dev)
    actor.backward(actor.model(input_ids=x, labels=x).loss, 0)
    actor.step()  # optimizer state exists now
    sync()
    before = allocated()
    actor.sleep()
    after = allocated()
    actor.wake()
    woke = allocated()

    from rlhf.engines.rollout import RolloutEngine

    class Sink(RolloutEngine):
        """Receives the sync only (the rollout engine's weight contract, no generation)."""

        def __init__(self):
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV)
            self.params = dict(self.model.named_parameters())

        def load_weights(self, named):
            for n, t in named:
                self.params[n].data.copy_(t)

        def reset_prefix_cache(self):
            pass

        def generate(self, prompt_ids, params):
            raise NotImplementedError("the sink only receives weights")

        def sleep(self):
            pass

        def wake(self, tags=None):
            pass

        def memory_state(self):
            return "full"

    plan = make_placement(TopologyConfig(colocate_all_models=True), 1)
    sink = Sink()
    ws = WeightSync(build_groups(plan, 0), sink, bucket_mb=512, dtype=torch.bfloat16, device=dev)
    ws.sync(actor.model)
    sync()
    t0 = time.perf_counter()
    nbytes = ws.sync(actor.model)
    sync()
    dt = time.perf_counter() - t0
    ref = {n: full_tensor(p) for n, p in actor.model.named_parameters()}
    worst = max(float((p.float() - ref[n].to(p.device, torch.bfloat16).float()).abs().max())
                for n, p in sink.model.state_dict().items() if n in ref)
    return {"engine_max_abs_diff_vs_actor_bf16": worst, "train_state_gb_before_sleep": before / 2**30,
            "after_sleep_gb": after / 2**30, "after_wake_gb": woke / 2**30, "sync_gb": nbytes / 2**30, "sync_gb_per_s": nbytes / dt / 2**30}


@section("mfu")
def mfu(_):
    import subprocess

    sizes = ["--layers", "2", "--hidden", "64", "--batch", "2", "--seq", "32", "--steps", "3"] if SMOKE else \
        ["--layers", "24", "--hidden", "896", "--batch", "8", "--seq", "1024", "--steps", "8"]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "mfu.py"), "--device", DEV.type, *sizes],
                         capture_output=True, text=True, timeout=240, env=dict(os.environ, MASTER_PORT="29655"))
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-1500:])
    with open(os.path.join(ROOT, "bench", "results", f"mfu_{DEV.type}.json")) as fh:
        return {**json.load(fh), "log": out.stdout[-300:]}


def main():
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29641", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if DEV.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if DEV.type == "cuda" else "gloo")
    path = qwen05_dir()
    rollout(path)
    sync_and_sleep(path)
    dist.destroy_process_group()
    mfu(path)
    out = os.environ.get("OUT") or os.path.join(ROOT, "bench", "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_bench_smoke.json" if SMOKE else "gpu_bench.json"), "w") as fh:
        json.dump(RES, fh, indent=2)
    failed = [k for k, v in RES.items() if "error" in v]
    if SMOKE and failed:
        sys.exit(f"smoke run: sections failed: {failed}")


if __name__ == "__main__":
    main()
