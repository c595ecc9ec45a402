"""The GPU check's in-process gates (bench/gpu.sh runs them): each prints one verdict line and exits non-zero on
failure.

    python bench/gpu_gates.py imports                       # what every gate imports (the 5-second check)
    python bench/gpu_gates.py load_peak --kit DIR           # FSDP2 load: the source rank's peak vs shards + 1 tensor
    python bench/gpu_gates.py comm_init                     # comm.init under cuda:nccl,cpu:gloo (device_id), new_group,
                                                            #   object collectives
    python bench/gpu_gates.py weight_receiver               # tests/multiprocess/test_weight_transfer.py's path onto device buffers
    python bench/gpu_gates.py head_gap [--vocab 151936]     # the fused head's log-prob gap at bf16 vs fp32
    python bench/gpu_gates.py master_update --kit DIR       # fraction of weights one lr 1e-6 step moves (fp32 masters)
    python bench/gpu_gates.py summary --work DIR --out DIR  # summary.json / summary.txt / failures.txt from the verdicts

A verdict line reads ``GATE <name>: PASS|FAIL|SKIP <figures>``; the summary collects them (bench/gpu.sh writes a
FAIL line itself for a gate that died without one).  Only argparse and the standard library at import: the
driver runs where the CLI's optional packages (datasets, vLLM, DeepSpeed, wandb, submitit, uvicorn) are missing.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))          # the helpers package
sys.path.insert(0, os.path.join(ROOT, "tests", "multiprocess"))  # test_weight_transfer

BLOCKED = ("datasets", "vllm", "deepspeed", "wandb", "submitit", "uvicorn")  # absent from the GPU machine's image


def verdict(name: str, ok, figures: str) -> int:
    """Print the gate's one line; ``ok`` True (PASS), False (FAIL) or None (SKIP: nothing to measure here)."""
    word = "SKIP" if ok is None else "PASS" if ok else "FAIL"
    print(f"GATE {name}: {word} {figures}", flush=True)
    return 1 if ok is False else 0


def _device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


# ---- imports ----------------------------------------------------------------------------------------------------
def gate_imports() -> int:
    """Every module the gates and trainers import, with the absent packages named (none may be imported)."""
    t0 = time.perf_counter()
    import importlib

    mods = ["torch", "transformers", "rlhf.config", "rlhf.rl.trainer", "rlhf.supervised.trainer",
            "rlhf.engines.fsdp2", "rlhf.distributed.sequence_parallel", "rlhf.planning.memory",
            "rlhf.engines.vllm_worker", "rlhf.distributed.transport", "rlhf.models.lm_head", "peft"]
    for m in mods:
        importlib.import_module(m)
    loaded = sorted(m for m in BLOCKED if m in sys.modules and sys.modules[m] is not None)
    s = time.perf_counter() - t0
    return verdict("imports", not loaded, f"{len(mods)} modules in {s:.1f}s" +
                   (f"; optional packages imported anyway: {', '.join(loaded)}" if loaded else ""))


# ---- FSDP2 load on the source rank -----------------------------------------------------------------------------
def gate_load_peak(kit: str) -> int:
    """rlhf/engines/fsdp2.py at one rank under --bf16 (sharded): the device peak while loading from the source
    rank's host copy, against the fp32 shards (here the whole model) plus one full tensor (the largest).  Before
    the fix the live Parameters' moved ``.data`` kept a second full copy: 2x."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.distributed import comm
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    dev = _device()
    comm.init(120)
    model = AutoModelForCausalLM.from_pretrained(kit, dtype=torch.float32)
    numel = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    if dev.type != "cuda":
        FSDP2Engine(model, EngineSpec(lr=1e-5, train_batch_size=2, micro_batch_size=2, total_steps=2, bf16=True),
                    device=dev, load_on_first=True)
        comm.destroy()
        return verdict("load_peak", None, f"CPU: loaded {numel / 1e6:.1f}M params; a device move is a no-op here, "
                                          f"the peak is measured on CUDA only")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    FSDP2Engine(model, EngineSpec(lr=1e-5, train_batch_size=2, micro_batch_size=2, total_steps=2, bf16=True),
                device=dev, load_on_first=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bound = 4 * numel + 4 * largest
    comm.destroy()
    return verdict("load_peak", peak <= 1.05 * bound,
                   f"peak {peak / 2**30:.3f} GiB for {4 * numel / 2**30:.3f} GiB of fp32 shards + the largest tensor "
                   f"{4 * largest / 2**30:.3f} GiB (bound {1.05 * bound / 2**30:.3f}; {peak / (4 * numel):.2f}x the "
                   f"model)")


# ---- comm.init with device_id, new_group and object collectives ----------------------------------------------------
def gate_comm_init() -> int:
    """comm.init under ``cuda:nccl,cpu:gloo`` (eager NCCL init with ``device_id``; one rank on one GPU), then a
    world-wide ``new_group`` and the object collectives every stage uses (they run on the CPU backend)."""
    import torch

    from rlhf.distributed import comm

    cuda = torch.cuda.is_available()
    os.environ["RLHF_DIST_BACKEND"] = "cuda:nccl,cpu:gloo" if cuda else "gloo"
    rank, world, _, dev = comm.init(120)
    g = comm.new_group(list(range(world)))
    x = comm.all_reduce(torch.full((4,), 2.0, device=dev), group=g)
    objs = comm.all_gather_object({"rank": rank, "dev": str(dev)})
    b = comm.broadcast_object({"hello": [1, 2]}, src=0)
    ok = (x.device == dev and x.tolist() == [2.0 * world] * 4 and objs[0]["rank"] == 0 and b == {"hello": [1, 2]})
    backend = comm.backend_string()
    comm.destroy()
    return verdict("comm_init", ok, f"backend {backend}, device {dev}, all_reduce on the new group "
                                    f"{x.tolist()[:1]}, objects {objs}, broadcast_object {b}")


# ---- the weight receiver on device buffers ------------------------------------------------------------------------
def _direct_on_device(rank, world, out_dir):
    """tests/multiprocess/test_weight_transfer.py ``_direct`` with its vLLM workers' device on this machine's GPU: the receiver
    allocates each piece's flat buffer there (``receive_and_load``) and loads views of it."""
    import test_weight_transfer as twt
    import torch

    if torch.cuda.is_available():
        init = twt.FakeWorker.__init__

        def on_gpu(self, r):
            init(self, r)
            self.device = torch.device("cuda", 0)

        twt.FakeWorker.__init__ = on_gpu
        os.environ.setdefault("RLHF_WEIGHT_SYNC_BACKEND", "gloo")  # 3 processes on one GPU: NCCL refuses that
    twt._direct(rank, world, out_dir)


def gate_weight_receiver() -> int:
    import tempfile

    import torch
    from helpers.mp import spawn

    from rlhf.distributed import transport

    os.environ.setdefault(transport.BACKEND_ENV, "gloo")
    with tempfile.TemporaryDirectory() as d:
        try:
            spawn(_direct_on_device, 3, d)
        except AssertionError as e:
            return verdict("weight_receiver", False, str(e).strip().splitlines()[-1][:300])
        sent = torch.load(os.path.join(d, "sent_0.pt"))
    where = "CUDA buffers" if torch.cuda.is_available() else "CPU buffers (no GPU)"
    return verdict("weight_receiver", True, f"2 syncs of {sent[0]} bytes each, received bit-exact into {where} by "
                                            f"2 TP workers")


# ---- the fused head's log-prob gap ---------------------------------------------------------------------------------
def gate_head_gap(vocab: int, hidden: int, rows: int) -> int:
    """rlhf/models/lm_head.py ``head_logprobs`` with bf16 hidden states and weight (what --bf16 computes) against
    fp32 log_softmax of the same values' fp32 logits, at a Qwen-size vocabulary: the gap rollout_logprob_gap
    inherits.  PASS when finite and below 0.1 (README: ~1e-3..1e-2 expected on GPU)."""
    import torch

    from rlhf.models.lm_head import head_logprobs

    dev = _device()
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(rows, hidden, generator=g) * 2).to(dev)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(dev)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(dev)
    with torch.no_grad():
        ref = torch.log_softmax(h.double() @ w.double().T, -1).gather(1, labels[:, None]).squeeze(1)
        fp32, _ = head_logprobs(h, w, None, labels)
        bf16, _ = head_logprobs(h.bfloat16(), w.bfloat16(), None, labels)
    gap32 = float((fp32.double() - ref).abs().max())
    gap16 = float((bf16.double() - ref).abs().max())
    mean16 = float((bf16.double() - ref).abs().mean())
    ok = gap16 == gap16 and gap16 < 0.1 and gap32 < 1e-3
    return verdict("head_gap", ok, f"vocab {vocab}, {rows} rows on {dev}: max |log-prob gap| bf16 head {gap16:.2e} "
                                   f"(mean {mean16:.2e}), fp32 head {gap32:.2e}, against fp64")


# ---- fp32 masters at lr 1e-6 -----------------------------------------------------------------------------------------
def gate_master_update(kit: str) -> int:
    """One AdamW step at lr 1e-6 through the FSDP2 engine under --bf16 (fp32 masters, rlhf/models/load.py
    ``weight_dtype``): the fraction of weights that change.  A bf16 master rounds almost every such update away
    (bf16 spacing 2^-8 relative); the same step on a bf16 copy is shown beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.distributed import comm
    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    dev = _device()
    comm.init(120)
    model = AutoModelForCausalLM.from_pretrained(kit, dtype=torch.float32)
    spec = EngineSpec(lr=1e-6, train_batch_size=1, micro_batch_size=1, total_steps=10, bf16=True, warmup_ratio=0.0,
                      scheduler="constant")
    eng = FSDP2Engine(model, spec, device=dev, load_on_first=False)

    def flat():  # every weight but the input embedding (rows of tokens absent from the batch get no gradient)
        out = []
        for n, p in eng.model.named_parameters():
            if "embed_tokens" in n:
                continue
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out.append(t.detach().float().reshape(-1).cpu().clone())
        return torch.cat(out)

    before = flat()
    ids = torch.randint(3, model.config.vocab_size, (1, 32), device=dev)
    eng.backward(eng.model(input_ids=ids, labels=ids).loss, 0)
    eng.step()
    after = flat()
    moved = float((after != before).float().mean())
    bf = before.bfloat16()
    moved16 = float(((bf.float() - 1e-6 * torch.sign(after - before)).bfloat16() != bf).float().mean())
    comm.destroy()
    return verdict("master_update", moved > 0.9, f"lr 1e-6, one step: {100 * moved:.1f}% of the fp32 master weights "
                                                 f"moved, input embedding aside (the same update on bf16 weights: "
                                                 f"{100 * moved16:.1f}%)")


# ---- summary ---------------------------------------------------------------------------------------------------------
def summary(work: str, out: str) -> int:
    """$OUT/summary.json, summary.txt and failures.txt from the verdict lines and the trainer runs' records."""
    lines = [ln.strip() for ln in open(os.path.join(work, "verdicts.txt"))] \
        if os.path.isfile(os.path.join(work, "verdicts.txt")) else []
    gates = []
    for ln in lines:
        if not ln.startswith("GATE "):
            continue
        name, rest = ln[5:].split(":", 1)
        word, _, figures = rest.strip().partition(" ")
        gates.append({"gate": name, "verdict": word, "figures": figures})
    runs = [json.loads(x) for x in open(os.path.join(work, "results.jsonl"))] \
        if os.path.isfile(os.path.join(work, "results.jsonl")) else []
    extra = {}
    for f in sorted(glob.glob(os.path.join(work, "*.json"))):
        try:
            extra[os.path.basename(f)[:-5]] = json.load(open(f))
        except ValueError:
            pass
    failed = [g for g in gates if g["verdict"] == "FAIL"]
    res = {"gates": gates, "runs": runs, "extra": extra, "failed": len(failed)}
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    txt = ["==== GPU check: gates ===="] + [f"{g['verdict']:4}  {g['gate']:22} {g['figures']}" for g in gates]
    txt.append("")
    txt.append("per phase (rank 0): peak allocated / max reserved / free at the end (mem_get_info) / pinned host, GiB;"
               " the planner's stage prediction beside it")
    for r in runs:
        txt.append(f"{r.get('name', r['kind'])} at {r['world']} rank(s): {r.get('status')}, batch on "
                   f"{','.join(r.get('batch_devices', []))}, masters {r.get('master_dtypes', {}).get('params')}")
        for ph, m in r.get("memory", {}).items():
            pred = m.get("predicted_GiB")
            txt.append(f"    {ph:14} alloc {m['allocated_GiB']:7.3f}  reserved {m['reserved_GiB']:7.3f}  free "
                       f"{m['free_GiB']:7.3f}  pinned {m['pinned_GiB']:6.3f}  planned "
                       + (f"{pred:7.3f} ({m.get('stage')})" if pred is not None else "   n/a"))
    txt.append(f"{len(gates) - len(failed)} of {len(gates)} gates passed or skipped; {len(failed)} failed")
    with open(os.path.join(out, "summary.txt"), "w") as fh:
        fh.write("\n".join(txt) + "\n")
    with open(os.path.join(out, "failures.txt"), "w") as fh:
        fh.write("".join(f"GATE {g['gate']}: FAIL {g['figures']}\n" for g in failed))
    print("\n".join(txt))
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["imports", "load_peak", "comm_init", "weight_receiver", "head_gap",
                                    "master_update", "summary"])
    p.add_argument("--kit")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--work")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.what == "imports":
        return gate_imports()
    if a.what == "load_peak":
        return gate_load_peak(a.kit)
    if a.what == "comm_init":
        return gate_comm_init()
    if a.what == "weight_receiver":
        return gate_weight_receiver()
    if a.what == "head_gap":
        return gate_head_gap(a.vocab, a.hidden, a.rows)
    if a.what == "master_update":
        return gate_master_update(a.kit)
    return summary(a.work, a.out)


if __name__ == "__main__":
    sys.exit(main())
