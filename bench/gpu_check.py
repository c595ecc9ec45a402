"""The GPU check's driver (bench/gpu.sh runs it): the trainers at 1 and 2 ranks, instrumented, and a summary table.

    python bench/gpu_check.py kit --path DIR [--smoke]        # the model, built from a config (nothing downloaded)
    torchrun --nproc_per_node N bench/gpu_check.py run --kind sft|rm|dpo|grpo --kit DIR --out DIR [--steps 3]
    torchrun --nproc_per_node 2 bench/gpu_check.py collectives --out DIR
    python bench/gpu_check.py peak --out DIR                   # matmul peak FLOP/s of this device (MFU's divisor)
    python bench/gpu_check.py report --out DIR

``run`` builds the trainer the CLI would build (``rlhf.config.parse`` + SupervisedTrainer / RLTrainer), wraps its
watchdog's phases to record the peak device memory and time of every top-level phase (load, train, rollout, ref,
actor_update, save, ...), records the device of every tensor the trained model's forward receives and the tokens it
trains on, and appends one JSON line (rank 0's figures plus every rank's peaks) to ``OUT/results.jsonl``.
``collectives`` drives ``rlhf.distributed.comm`` and the RL stages' gathers (``gather_rows``, ``gather_max``,
``all_gather_objects``) at 2 ranks with the job's backend, and probes whether that backend rejects a CPU tensor
and runs FSDP2's collectives (all_gather_into_tensor, reduce_scatter_tensor).
Only argparse here (no click): the driver runs where the CLI's optional packages are missing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Qwen2.5-0.5B's shape (its config.json): 494M parameters, tied embeddings
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
KINDS = ("sft", "rm", "dpo", "grpo")


# ---- the model --------------------------------------------------------------------------------------------------
def build_kit(path: str, smoke: bool) -> str:
    """The tiny kit's tokenizer and data with, unless ``smoke``, a Qwen2.5-0.5B-shaped random model (bf16 on disk,
    as released checkpoints are).  Built once per shape (a stamp file)."""
    from rlhf.models.tiny_kit import make_tiny

    want = {"shape": "tiny" if smoke else "qwen2.5-0.5b"}
    stamp = os.path.join(path, "gpu_check_kit.json")
    if os.path.isfile(stamp) and json.load(open(stamp)) == want:
        return path
    make_tiny(path, arch="qwen2")
    if not smoke:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(path)
        for k, v in QWEN_05B.items():
            setattr(cfg, k, v)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(path)
    with open(stamp, "w") as fh:
        json.dump(want, fh)
    return path


# ---- measuring --------------------------------------------------------------------------------------------------
class Probe:
    """Peak memory and wall time per top-level watchdog phase; devices and token counts of the trained model's
    inputs.  CUDA: ``max_memory_allocated`` since the phase began.  CPU: the process's peak RSS so far (getrusage;
    it cannot be reset, so it only grows)."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"
        self.phases: Dict[str, List[dict]] = {}
        self.current = None
        self.devices = set()
        self.train_tokens: List[int] = []
        self._t0 = 0.0

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset(self):
        self.sync()
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()

    def peak_bytes(self) -> int:
        if self.cuda:
            return int(self.torch.cuda.max_memory_allocated())
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def memory(self) -> dict:
        """The phase's peak reserved bytes (the caching allocator's hold: what other processes cannot use), the
        device's free bytes now (``mem_get_info``) and the pinned host bytes PyTorch's host allocator holds (sleep
        / offload copies), beside the peak allocated bytes."""
        if not self.cuda:
            return {"reserved": 0, "free": 0, "pinned": 0}
        cuda = self.torch.cuda
        stats = getattr(cuda, "host_memory_stats", None)
        host = stats() if stats is not None else {}
        pinned = next((int(v) for k, v in host.items() if k.endswith("allocated_bytes.current")), 0) \
            if isinstance(host, dict) else 0
        return {"reserved": int(cuda.max_memory_reserved()), "free": int(cuda.mem_get_info()[0]), "pinned": pinned}

    def record(self, name: str):
        self.sync()
        self.phases.setdefault(name, []).append({"s": time.perf_counter() - self._t0, "peak": self.peak_bytes(),
                                                 **self.memory()})

    def wrap_watchdog(self, watchdog):
        """Record every top-level phase the trainer enters (nested ones, e.g. reward_function, count in theirs)."""
        orig, depth = watchdog.phase, [0]

        @contextlib.contextmanager
        def phase(name, *a, **kw):
            top = depth[0] == 0
            depth[0] += 1
            if top:
                self.current = name
                self.reset()
            try:
                with orig(name, *a, **kw):
                    yield
            finally:
                depth[0] -= 1
                if top:
                    self.record(name)
                    self.current = None

        watchdog.phase = phase

    def watch_inputs(self, model):
        """A forward pre-hook: the device of every tensor argument; tokens of train-phase forwards."""
        torch = self.torch

        def hook(mod, args, kwargs):
            tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
            self.devices.update(str(t.device) for t in tensors)
            ids = kwargs.get("input_ids", tensors[0] if tensors else None)
            if self.current in ("train", "actor_update") and ids is not None and torch.is_grad_enabled():
                self.train_tokens.append(int(ids.numel()))

        model.register_forward_pre_hook(hook, with_kwargs=True)


def master_dtypes(engine) -> Dict[str, List[str]]:
    """dtypes of the parameters the optimizer updates and of its state (fp32 master weights under --bf16).  Read
    from the optimizer's param groups, not ``model.parameters()``: an FSDP2 unit left unsharded after a forward
    (the root, reshard_after_forward=False) shows its bf16 compute copies there until the next backward."""
    import torch

    opt = engine.optimizer
    params = sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]}) if opt else \
        sorted({str(p.dtype) for p in engine.model.parameters()})
    state = sorted({str(v.dtype) for st in (engine.optimizer.state.values() if engine.optimizer else [])
                    for v in st.values() if torch.is_tensor(v) and v.dim() > 0})
    return {"params": params, "optimizer_state": state}


def model_numel(engine) -> int:
    """Parameters of the whole model (DTensor shards count their global size)."""
    return int(sum(p.numel() for p in engine.model.parameters()))


# ---- one trainer ------------------------------------------------------------------------------------------------
def trainer_argv(kind: str, kit: str, out: str, steps: int, world: int, gen_len: int, name: str = "") -> List[str]:
    d = os.path.join(kit, "data")
    run = os.path.join(out, f"{name or kind}_w{world}")
    argv = ["--pretrain", kit, "--bf16", "--max_global_steps", str(steps), "--no_progress_bar",
            "--save_path", os.path.join(run, "model"), "--ckpt_path", os.path.join(run, "ckpt"),
            "--log_dir", os.path.join(run, "logs"), "--max_samples", "256"]
    if kind == "grpo":
        return argv + ["--prompt_data", f"{d}/prompts_train.jsonl", "--remote_rm_url", "builtin:arithmetic",
                       "--rollout_engine", "hf", "--colocate_all_models", "--rollout_batch_size", "4",
                       "--n_samples_per_prompt", "4", "--train_batch_size", "16", "--micro_train_batch_size", "4",
                       "--micro_rollout_batch_size", "8", "--generate_max_len", str(gen_len)]
    data = "sft_train.jsonl" if kind == "sft" else "pref_train.jsonl"
    return argv + ["--dataset", f"{d}/{data}", "--train_batch_size", "8", "--micro_train_batch_size", str(8 // world)]


def planned(cfg, kind: str, placement, world: int, device_bytes: float, cuda: bool) -> Dict[str, float]:
    """The memory planner's peak per stage for rank 0 of this job (rlhf/planning), in bytes; {} when it cannot
    plan (a model it cannot read)."""
    try:
        from rlhf.planning import job_from_flags, plan_with_fixes, role_dims

        job = job_from_flags(kind, cfg.model, cfg.data, cfg.topology, cfg.rollout, cfg.optim)
        plan, _ = plan_with_fixes(job, role_dims(cfg.model), placement, world, device_bytes, cuda, False)
    except Exception as e:  # noqa: BLE001 - the prediction is a figure beside the measurement, not the gate
        print(f"[gpu_check] memory plan unavailable: {type(e).__name__}: {e}", flush=True)
        return {}
    group = next((g for g in plan.groups if 0 in g.ranks), plan.groups[0])
    return {s.name: s.total for s in group.stages}


PHASE_STAGE = {"train": "train", "actor_update": "actor_update", "critic_update": "critic_update", "ref": "ref",
               "rollout": "rollout", "old_logprobs": "old_logprobs", "weight_sync": "weight_sync", "reward": "reward",
               "values": "values", "load": "load"}


def memory_rows(probe, plan: Dict[str, float]) -> Dict[str, dict]:
    """Per phase: the largest record of rank 0 beside the planner's stage of the same name."""
    g = 2 ** 30
    out = {}
    for ph, recs in probe.phases.items():
        r = max(recs, key=lambda x: x["peak"])
        stage = PHASE_STAGE.get(ph)
        out[ph] = {"allocated_GiB": round(r["peak"] / g, 4), "reserved_GiB": round(r["reserved"] / g, 4),
                   "free_GiB": round(r["free"] / g, 4), "pinned_GiB": round(r["pinned"] / g, 4), "stage": stage,
                   "predicted_GiB": round(plan[stage] / g, 4) if stage in plan else None}
    return out


def run_kind(kind: str, kit: str, out: str, steps: int, gen_len: int, name: str = "",
             extra: Optional[List[str]] = None) -> None:
    import torch

    from rlhf.config import parse
    from rlhf.distributed import comm

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    probe = Probe(dev)
    argv = trainer_argv(kind, kit, out, steps, world, gen_len, name) + list(extra or [])
    name = name or kind
    probe.reset()
    t0 = time.perf_counter()
    if kind == "grpo":
        from rlhf.rl.trainer import RLTrainer
        from rlhf.train_grpo import GRPO_DEFAULTS

        cfg = parse("grpo", argv, GRPO_DEFAULTS)
        trainer = RLTrainer(cfg, "gpu_check_grpo")
        engine = trainer.roles.actor.engine
    else:
        import importlib

        from rlhf.supervised import tasks
        from rlhf.supervised.trainer import SupervisedTrainer

        mod = importlib.import_module(f"rlhf.train_{kind}")
        task = {"sft": tasks.SFTTask, "rm": tasks.RMTask, "dpo": tasks.DPOTask}[kind]
        cfg = parse(kind, argv, mod.DEFAULTS)
        trainer = SupervisedTrainer(cfg, task, "sft" if kind == "sft" else "pref")
        engine = trainer.engine
    probe.record("load")
    load_s = time.perf_counter() - t0
    probe.wrap_watchdog(trainer.watchdog)
    probe.watch_inputs(engine.model)
    trainer.fit()
    trainer.watchdog.stop()
    numel = model_numel(engine)
    train = "train" if kind != "grpo" else "actor_update"
    mine = {"rank": comm.rank(), "peaks_GB": {k: round(max(r["peak"] for r in v) / 1e9, 3)
                                              for k, v in probe.phases.items()}}
    ranks = comm.all_gather_object(mine)
    comm.barrier()
    failed = False
    if comm.rank() == 0:
        times = [r["s"] for r in probe.phases.get(train, [])]
        steady = sorted(times[1:] or times)
        step_s = steady[len(steady) // 2] if steady else float("nan")
        tokens = sum(probe.train_tokens) / max(1, len(times))   # per step, this rank (padded tokens)
        total = torch.cuda.mem_get_info()[1] if cuda else 80 * 2 ** 30
        plan = planned(cfg, kind, getattr(trainer, "plan", None), world, float(total), cuda)
        res = {"name": name, "kind": kind, "world": world, "backend": comm.backend_string(), "status": "ok",
               "argv": argv, "memory": memory_rows(probe, plan),
               "device": str(dev), "batch_devices": sorted(probe.devices), "master_dtypes": master_dtypes(engine),
               "params": numel, "model_fp32_GB": round(numel * 4 / 1e9, 3), "model_bf16_GB": round(numel * 2 / 1e9, 3),
               "load_s": round(load_s, 2), "train_step_s": round(step_s, 4),
               "train_tokens_per_step_rank0": tokens, "train_flops_per_step_rank0": 6 * numel * tokens,
               "phase_s": {k: round(sorted(r["s"] for r in v)[len(v) // 2], 4) for k, v in probe.phases.items()},
               "ranks": ranks, "steps": trainer.step}
        with open(os.path.join(out, "results.jsonl"), "a") as fh:
            fh.write(json.dumps(res) + "\n")
        print(f"[gpu_check] {kind} world {world}: ok, {trainer.step} steps", flush=True)
        on = {d.split(":")[0] for d in probe.devices}
        masters = master_dtypes(engine)["params"]
        ok = trainer.step >= 1 and on <= {dev.type} and masters == ["torch.float32"]
        pk = res["memory"]
        print(f"GATE {name}: {'PASS' if ok else 'FAIL'} {trainer.step} steps at {world} rank(s), batch on "
              f"{sorted(probe.devices)}, masters {masters}, peak GiB " +
              " ".join(f"{k}={v['allocated_GiB']:.2f}" + (f"/plan {v['predicted_GiB']:.2f}" if v["predicted_GiB"]
                                                           is not None else "") for k, v in pk.items()), flush=True)
        failed = not ok
    comm.barrier()
    comm.destroy()
    if failed:
        raise SystemExit(1)


# ---- the collective discipline at 2 ranks --------------------------------------------------------------------------
def run_collectives(out: str) -> None:
    """comm's collectives and the RL gathers with the job's backend (``cuda:gloo`` on one GPU: CUDA tensors only,
    as NCCL); each check records ok or the error, so one unsupported op does not hide the others."""
    import torch
    import torch.distributed as dist  # only to probe the backend itself with a raw CPU tensor / FSDP2's ops

    from rlhf.distributed import comm
    from rlhf.distributed.sharding import all_gather_objects, gather_max, gather_rows, shard_rows

    rank, world, _, dev = comm.init(120)
    checks: Dict[str, str] = {}

    def check(name, fn):
        try:
            r = fn()
            checks[name] = "ok" if r is None or r is True else r if str(r).startswith("n/a") else f"WRONG: {r}"
        except Exception as e:  # noqa: BLE001 - recorded, reported in the table
            checks[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"

    def all_reduce_device():
        x = comm.all_reduce(torch.full((4,), float(rank + 1), device=dev))
        return True if x.device == dev and x.tolist() == [world * (world + 1) / 2] * 4 else (x.device, x.tolist())

    def all_reduce_cpu_input():  # comm moves a CPU tensor to the collective device and the result back
        x = comm.all_reduce(torch.ones(3))
        return True if x.device.type == "cpu" and x.tolist() == [float(world)] * 3 else (x.device, x.tolist())

    def broadcast():
        x = comm.broadcast(torch.arange(5.0, device=dev) * (rank == 0), src=0)
        return True if x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] else x.tolist()

    def rows_gather():  # what every role's forward / the rollout gather does: rows split over ranks, one all_reduce
        n = 7
        rows = shard_rows(n, rank, world)
        local = torch.arange(n, dtype=torch.float32, device=dev)[rows].unsqueeze(1) * 10
        y = gather_rows(local, rows, n, 1)
        return True if y.squeeze(1).tolist() == [10.0 * i for i in range(n)] else y.tolist()

    def max_gather():
        return True if gather_max([rank, 5 - rank]) == [world - 1, 5] else gather_max([rank, 5 - rank])

    def objects():
        got = all_gather_objects({"r": rank})
        return True if got == [{"r": r} for r in range(world)] else got

    def raw_cpu_rejected():
        if dev.type == "cpu":
            return "n/a (a CPU job: the CPU tensor is the collective device's tensor)"
        try:
            dist.all_reduce(torch.ones(2))
        except Exception:  # noqa: BLE001 - the backend refusing a CPU tensor is the expected outcome
            return True
        return "the backend accepted a CPU tensor (a CPU backend is registered: NCCL-only discipline not tested)"

    def fsdp2_all_gather():
        out_t = torch.empty(2 * world, device=dev)
        dist.all_gather_into_tensor(out_t, torch.full((2,), float(rank), device=dev))
        return True if out_t.tolist() == [float(r) for r in range(world) for _ in range(2)] else out_t.tolist()

    def fsdp2_reduce_scatter():
        out_t = torch.empty(2, device=dev)
        dist.reduce_scatter_tensor(out_t, torch.ones(2 * world, device=dev))
        return True if out_t.tolist() == [float(world)] * 2 else out_t.tolist()

    for name, fn in (("all_reduce (device tensor)", all_reduce_device), ("all_reduce (CPU input)", all_reduce_cpu_input),
                     ("broadcast", broadcast), ("gather_rows (RL stages)", rows_gather), ("gather_max", max_gather),
                     ("all_gather_objects", objects), ("raw CPU tensor rejected", raw_cpu_rejected),
                     ("all_gather_into_tensor (FSDP2)", fsdp2_all_gather),
                     ("reduce_scatter_tensor (FSDP2)", fsdp2_reduce_scatter)):
        check(name, fn)
    gathered = comm.all_gather_object(checks)
    if rank == 0:
        with open(os.path.join(out, "collectives.json"), "w") as fh:
            json.dump({"backend": comm.backend_string(), "world": world, "device": str(dev), "ranks": gathered}, fh,
                      indent=1)
        for k, v in gathered[0].items():
            print(f"[collectives] {k}: {v}", flush=True)
        bad = sorted({k for c in gathered for k, v in c.items() if v != "ok" and not str(v).startswith("n/a")})
        print(f"GATE collectives: {'FAIL' if bad else 'PASS'} {len(gathered[0])} checks at {world} ranks on "
              f"{comm.backend_string()} ({dev})" + (f"; not ok: {', '.join(bad)}" if bad else ""), flush=True)
    comm.barrier()
    comm.destroy()


# ---- peak and report ----------------------------------------------------------------------------------------------
def matmul_peak(out: str) -> None:
    """The best of a few large matmuls: bf16 8192^2 on CUDA, fp32 1024^2 on CPU (the smoke run)."""
    import torch

    cuda = torch.cuda.is_available()
    n, dt = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    dev = "cuda" if cuda else "cpu"
    a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
    best = float("inf")
    for _ in range(6):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dt), "peak_flops": 2 * n ** 3 / best}
    with open(os.path.join(out, "peak.json"), "w") as fh:
        json.dump(res, fh)
    print(f"[peak] {res['device']} {dt}: {res['peak_flops'] / 1e9:.1f} GFLOP/s", flush=True)


def report(out: str) -> int:
    """The summary table from OUT/results.jsonl, failures.txt, collectives.json, peak.json; exit 1 if any failed."""
    rows = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))] \
        if os.path.isfile(os.path.join(out, "results.jsonl")) else []
    fails = [line.strip() for line in open(os.path.join(out, "failures.txt"))] \
        if os.path.isfile(os.path.join(out, "failures.txt")) else []
    peak = json.load(open(os.path.join(out, "peak.json"))) if os.path.isfile(os.path.join(out, "peak.json")) else None
    print("\n==== GPU check summary ====")
    if peak:
        print(f"device {peak['device']}, matmul peak {peak['peak_flops'] / 1e9:.1f} GFLOP/s ({peak['dtype']})")
    hdr = (f"{'kind':5} {'ranks':5} {'backend':18} {'master params/optim':20} {'batch on':9} {'load pk GB':>10} "
           f"{'model fp32 GB':>13} {'pk/model':>8} {'step s':>7} {'MFU':>6}  peak GB per phase (rank 0 (max of ranks))")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        md = r["master_dtypes"]
        dtypes = "/".join(d.replace("torch.", "").replace("float", "fp").replace("bfp16", "bf16")
                          for d in md["params"] + ["|"] + md["optimizer_state"]).replace("/|/", " | ")
        mfu = ""
        if peak and r["train_step_s"] == r["train_step_s"] and r["train_step_s"] > 0:
            mfu = f"{100 * r['train_flops_per_step_rank0'] / r['train_step_s'] / peak['peak_flops']:.1f}%"
        pk = {k: v for k, v in r["ranks"][0]["peaks_GB"].items()}
        mx = {k: max(x["peaks_GB"].get(k, 0) for x in r["ranks"]) for k in pk}
        phases = " ".join(f"{k}={pk[k]:.2f}" + (f"({mx[k]:.2f})" if r["world"] > 1 else "") for k in pk)
        ratio = f"{pk.get('load', 0) / r['model_fp32_GB']:.2f}" if r["device"].startswith("cuda") else "n/a"
        print(f"{r['kind']:5} {r['world']:<5} {r['backend']:18} {dtypes:20} {','.join(r['batch_devices']):9} "
              f"{pk.get('load', 0):>10.3f} {r['params'] * 4 / 1e9:>13.3g} {ratio:>8} {r['train_step_s']:>7.3f} {mfu:>6}  "
              f"{phases}")
    for f in fails:
        print(f"FAILED  {f}")
    coll = os.path.join(out, "collectives.json")
    if os.path.isfile(coll):
        c = json.load(open(coll))
        print(f"\ncollectives at {c['world']} ranks, backend {c['backend']}, device {c['device']}:")
        for k, v in c["ranks"][0].items():
            others = {x.get(k) for x in c["ranks"][1:]}
            print(f"  {k:32} {v}" + ("" if others <= {v} else f"  (other ranks: {sorted(others)})"))
    print("MFU: 6 x params x the trained model's (padded) tokens per step on rank 0 / the median step time after "
          "the first / the matmul peak; load pk: peak device memory from the trainer's start to the end of loading "
          "(CPU: peak RSS so far)")
    return 1 if fails else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["kit", "run", "collectives", "peak", "report"])
    p.add_argument("--path", help="kit folder (kit)")
    p.add_argument("--kit", help="kit folder (run)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu"))
    p.add_argument("--kind", choices=KINDS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gen_len", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="kit: the tiny model (CPU)")
    p.add_argument("--name", default="", help="run: the gate's name (default: the kind)")
    a, extra = p.parse_known_args(argv)
    if extra and a.what != "run":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    os.makedirs(a.out, exist_ok=True)
    if a.what == "kit":
        print(build_kit(a.path, a.smoke))
    elif a.what == "run":
        run_kind(a.kind, a.kit, a.out, a.steps, a.gen_len, a.name, extra)
    elif a.what == "collectives":
        run_collectives(a.out)
    elif a.what == "peak":
        matmul_peak(a.out)
    else:
        return report(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
