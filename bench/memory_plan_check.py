"""Memory planner: predicted vs measured peak memory per stage (rlhf/planning), on CPU or on a GPU.

    python bench/memory_plan_check.py                         # CPU: bench kits tiny and medium, fp32, one process
    python bench/memory_plan_check.py --device cuda --shape qwen2.5-0.5b --bf16    # the GPU step of bench/gpu.sh
    torchrun --standalone --nproc_per_node 2 bench/memory_plan_check.py --fsdp2 [--bf16]   # the update on FSDP2

Each stage runs what the trainer runs for it, on one rank holding one model: the CPU layout (no device split, fp32
parameters, a plain module), on CPU or CUDA.  ``--bf16``: fp32 parameters with bf16 compute through autocast, whose
cache of bf16 weight copies stands for FSDP2's unsharded bf16 units (planned as --zero_stage 2, every unit gathered
until backward); the rollout row is left out there (the engine's own bf16 copy is not what autocast makes).

  rollout       the HF engine's generate (rlhf/engines/hf_engine.py) for --micro_rollout prompts
  ref           a no-grad action_logprobs forward (fused LM head) of --micro_rollout sequences
  actor_update  forward + backward of --micro_train sequences + the fused AdamW step (the engine's optimizer),
                without and with gradient checkpointing

Measured peak = the bytes of the tensors resident at the stage's start (parameters, optimizer state, the fused
head's kept-chunk arena) + the rise of the allocator's in-use bytes during the stage: on CUDA
``torch.cuda.max_memory_allocated``; on CPU glibc's ``mallinfo2`` (in-use arena + mmapped bytes) sampled after
every aten op (a TorchDispatchMode, so forward, backward and optimizer ops alike).  The second run of each stage is
measured (the first pays one-time allocations).  Predicted = the planner's stage (rlhf.planning.memory) for the
same flags, on one rank, with sleep on (only the stage's model resident) and no runtime reserve.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf.planning import Job, RoleModel, terms  # noqa: E402
from rlhf.planning.dims import ModelDims, write_config  # noqa: E402
from rlhf.planning.memory import group_stages  # noqa: E402

GiB = terms.GiB


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


class CpuPeak(TorchDispatchMode):
    """Peak of glibc's in-use bytes, sampled after every aten op while active."""

    def __init__(self):
        super().__init__()
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = _MallInfo2
        self.start = self.peak = self.used()

    def used(self) -> int:
        m = self.libc.mallinfo2()
        return m.uordblks + m.hblkhd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.used())
        return out

    @property
    def rise(self) -> int:
        return self.peak - self.start


class CudaPeak:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.rise = torch.cuda.max_memory_allocated() - self.start


def tensor_bytes(ts) -> int:
    seen, n = set(), 0
    for t in ts:
        if t is None or not torch.is_tensor(t):
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            n += s.nbytes()
    return n


def arena_bytes() -> int:
    from rlhf.models import lm_head

    buf = lm_head._ARENA.buf
    return buf.numel() * buf.element_size() if buf is not None else 0


def model_dir(args) -> str:
    if args.shape:
        path = os.path.join(tempfile.gettempdir(), f"rlhf_memcheck_{args.shape}")
        write_config(args.shape, path)
        return path
    from bench.kits import build_kit

    return build_kit(args.kit, os.path.join(tempfile.gettempdir(), f"rlhf_bench_kit_{args.kit}"))


def batch(b: int, prompt: int, resp: int, vocab: int, device):
    """Left-padded prompts (lengths prompt, prompt - 8, ...) and full-length responses, as a rollout batch."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 250), (b, prompt + resp), generator=g)
    att = torch.ones(b, prompt + resp, dtype=torch.long)
    for i in range(b):
        att[i, :min(prompt - 1, 8 * i)] = 0
    return ids.to(device), att.to(device)


def predicted(job: Job, d: ModelDims, on_cuda: bool) -> dict:
    """The planner's stages on one rank holding actor, ref and rollout with sleep on: each stage holds its own
    model only (what this bench measures); without the CUDA runtime reserve (the allocator's counters exclude the
    context and cuBLAS workspace)."""
    roles = {"actor": RoleModel(d, 1, True, True), "ref": RoleModel(d, 1, False, True),
             "rollout": RoleModel(d, 1, False, True)}
    stages, _ = group_stages(job, roles, 1, 0, on_cuda=on_cuda)
    return {s.name: sum(v for k, v in s.parts.items() if k != "runtime") for s in stages}


def run(args) -> list:
    from transformers import AutoModelForCausalLM

    from rlhf.models.forward import action_logprobs
    from rlhf.models.lm_head import rows_per_chunk

    device = torch.device(args.device)
    torch.manual_seed(0)
    path = model_dir(args)
    d = ModelDims.from_pretrained(path)
    if args.shape:
        from transformers import AutoConfig

        with torch.device(device):  # built on the device: a 0.5B random init on the host takes a while
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), attn_implementation="sdpa")
        model = model.float()  # fp32 parameters (the config's torch_dtype says bfloat16), as the trainers keep them
    else:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    model.to(device)
    P, R, bt, br = args.prompt, args.response, args.micro_train, args.micro_rollout
    chunk = rows_per_chunk(args.chunk, d.vocab, device)
    job = Job(kind="rl", bf16=args.bf16, prompt_max_len=P, generate_max_len=R, micro_train_batch_size=bt,
              micro_rollout_batch_size=br, logprob_chunk_size=chunk, rollout_engine="hf", vllm_enable_sleep=True,
              zero_stage=2 if args.bf16 else 3)
    peak_cls = CudaPeak if device.type == "cuda" else CpuPeak
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    rows = []

    def record(stage, resident, rise, pred):
        meas = resident + rise
        rows.append(dict(kit=(args.shape or args.kit) + (" bf16" if args.bf16 else ""), stage=stage,
                         predicted_mib=round(pred / 2**20, 1),
                         measured_mib=round(meas / 2**20, 1), ratio=round(pred / meas, 3), device=device.type,
                         tokens=f"{P}+{R}"))
        print(f"[memory] {rows[-1]}", flush=True)

    params = list(model.parameters()) + list(model.buffers())
    # rollout: the HF engine's generate
    from types import SimpleNamespace

    from rlhf.engines.hf_engine import HFEngine
    from rlhf.engines.rollout import SamplingParams

    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1)  # the engine reads these two ids only
    eng = HFEngine(model, tok, device, micro_batch_size=br)
    prompts = [list(range(5, 5 + P - 4 * (i % 4))) for i in range(br)]
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=R, stop_token_ids=(-1,), seed=0)
    pred = predicted(job, d, device.type == "cuda")
    if not args.bf16:
        for i in range(2):
            with torch.no_grad(), peak_cls() as pk:
                eng.generate(prompts, sp)
        record("rollout", tensor_bytes(params), pk.rise, pred["rollout"])
    model.requires_grad_(True)
    # ref: a no-grad forward with the fused head
    ids, att = batch(br, P, R, d.vocab, device)
    for i in range(2):
        with torch.no_grad(), amp, peak_cls() as pk:
            action_logprobs(model, ids, att, R, chunk_size=args.chunk)
    record("ref", tensor_bytes(params) + arena_bytes(), pk.rise, pred["ref"])
    # actor update, without and with gradient checkpointing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids, att = batch(bt, P, R, d.vocab, device)
    for ckpt in (False, True):
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for i in range(2):
            state = [v for s in opt.state.values() for v in s.values()]
            resident = tensor_bytes(params + state) + arena_bytes()
            with amp, peak_cls() as pk:
                lp, _ = action_logprobs(model, ids, att, R, chunk_size=args.chunk)
                lp.float().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        pj = Job(**{**job.__dict__, "gradient_checkpointing": ckpt})
        record("actor_update" + (" (ckpt)" if ckpt else ""), resident, pk.rise,
               predicted(pj, d, device.type == "cuda")["actor_update"])
        model.gradient_checkpointing_disable()
    return rows


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def run_fsdp2(args) -> list:
    """The update on FSDP2 (rlhf/engines/fsdp2.py FSDP2Engine) over the ranks of this torchrun (gloo on CPU):
    each rank's fp32 shards of params, gradients and AdamW state, the gathered units, activations, the head."""
    from transformers import AutoModelForCausalLM

    from rlhf.distributed import comm
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec
    from rlhf.models.forward import action_logprobs
    from rlhf.models.lm_head import rows_per_chunk

    rank, world, _, device = comm.init(600)
    path = model_dir(args)
    d = ModelDims.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    P, R, bt = args.prompt, args.response, args.micro_train
    spec = EngineSpec(lr=1e-6, train_batch_size=bt * world, micro_batch_size=bt, total_steps=10, bf16=args.bf16)
    eng = FSDP2Engine(model, spec, device=device)
    chunk = rows_per_chunk(args.chunk, d.vocab, device)
    job = Job(kind="rl", bf16=args.bf16, prompt_max_len=P, generate_max_len=R, micro_train_batch_size=bt,
              logprob_chunk_size=chunk, rollout_engine="hf", vllm_enable_sleep=True)
    roles = {"actor": RoleModel(d, world, True, True)}
    pred = {s.name: s.total for s in group_stages(job, roles, 1, 0, on_cuda=False)[0]}["actor_update"]
    ids, att = batch(bt, P, R, d.vocab, device)
    rows = []
    for i in range(2):
        state = [local(v) for st in eng.optimizer.state.values() for v in st.values()]
        resident = tensor_bytes([local(p) for p in eng.model.parameters()] + list(eng.model.buffers()) + state)
        resident += arena_bytes()
        with CpuPeak() as pk:
            lp, _ = action_logprobs(eng.model, ids, att, R, chunk_size=args.chunk)
            eng.backward(lp.float().mean(), 0)
            eng.step()
    meas = resident + pk.rise
    rows.append(dict(kit=f"{args.kit} fsdp2 x{world}" + (" bf16" if args.bf16 else ""),
                     stage=f"actor_update rank {rank}",
                     predicted_mib=round(pred / 2**20, 1), measured_mib=round(meas / 2**20, 1),
                     ratio=round(pred / meas, 3), device=device.type, tokens=f"{P}+{R}"))
    print(f"[memory] {rows[-1]}", flush=True)
    comm.barrier()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kit", default="medium", choices=("tiny", "medium"))
    ap.add_argument("--shape", default=None, help="a KNOWN config (e.g. qwen2.5-0.5b), built from config, no weights")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=384)
    ap.add_argument("--micro_train", type=int, default=4)
    ap.add_argument("--micro_rollout", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--out", default=None, help="append the rows as JSON lines here")
    ap.add_argument("--fsdp2", action="store_true",
                    help="the update on FSDP2 over this torchrun's ranks (torchrun --nproc_per_node 2 ... --fsdp2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = run_fsdp2(args) if args.fsdp2 else run(args)
    print(f"{'kit':<24}{'stage':<22}{'predicted MiB':>14}{'measured MiB':>14}{'ratio':>8}")
    for r in rows:
        print(f"{r['kit']:<24}{r['stage']:<22}{r['predicted_mib']:>14}{r['measured_mib']:>14}{r['ratio']:>8}")
    if args.out:
        with open(args.out, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
