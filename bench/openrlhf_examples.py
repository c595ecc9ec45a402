"""OpenRLHF's own example commands, run here (issue 41).

    python bench/openrlhf_examples.py --src DIR [--kit DIR] [--work DIR] [--run] [--only SUBSTR] [--timeout 240]

DIR holds OpenRLHF material, one folder or file per source, e.g. (from ``git show TAG:path`` of OpenRLHF's repository
and the 0.11.2 wheel's METADATA):

    DIR/v0.10.1/{*.sh, README.md, reward_func.py, agent_func.py, ...}
    DIR/v0.11.0/{...}
    DIR/README_0.11.2.md

Every ``openrlhf.cli.X`` command in the scripts and README code blocks is turned into ours:
launcher -> ``torchrun --standalone --nproc_per_node 1 -m rlhf.X``, model paths -> the tiny kit, hub data sets ->
local jsonl files with the keys the command names (content from the kit's task data), GPU counts -> 1, sizes ->
one step on CPU (batch sizes, sample counts, generation lengths); every other flag as written.  Each command is
first checked against OpenRLHF's own parser (its flags, rlhf/tools/openrlhf_flags.json; a command OpenRLHF
refuses is not counted), then parsed by ours (in-process), then, with --run, launched once.  Prints one line per
command and the count table.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request

import click

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

OURS = {"train_sft": ("rlhf.train_sft", "sft"), "train_rm": ("rlhf.train_rm", "rm"),
        "train_dpo": ("rlhf.train_dpo", "dpo"), "train_ppo_ray": ("rlhf.train_ppo", "ppo"),
        "serve_rm": ("rlhf.serve_rm", None)}
NOT_TRAINING = {"lora_combiner"}        # a tool, not a training or serving command
# flags, flat and dotted, by the role they play in the conversion
ACTOR = {"pretrain", "model.model_name_or_path", "actor.model_name_or_path", "ref_pretrain",
         "ref.model_name_or_path"}
REWARD = {"reward_pretrain", "reward.model_name_or_path", "critic_pretrain", "critic.model_name_or_path"}
DATA = {"dataset", "data.dataset", "prompt_data", "data.prompt_dataset", "eval_dataset", "eval.dataset",
        "pretrain_data", "data.pretrain_dataset"}
OUTPUT = {"save_path", "ckpt_path", "ckpt.output_dir", "ckpt.path", "use_tensorboard", "logger.tensorboard_dir"}
FUNC = {"remote_rm_url", "reward.remote_url", "agent_func_path", "train.agent_func_path"}
GPUS = re.compile(r"(num_gpus_per_node|num_nodes|vllm_num_engines|vllm\.num_engines|tensor_parallel_size|"
                  r"ring_attn_size)$")
SIZES = {  # flag -> value for one step on CPU
    "train_batch_size": 4, "train.batch_size": 4, "micro_train_batch_size": 1, "train.micro_batch_size": 1,
    "rollout_batch_size": 2, "rollout.batch_size": 2, "micro_rollout_batch_size": 2,
    "rollout.micro_batch_size": 2, "max_samples": 4, "data.max_samples": 4, "max_epochs": 1,
    "train.max_epochs": 1, "num_episodes": 1, "train.num_episodes": 1,
    "generate_max_len": 16, "max_new_tokens": 16, "rollout.max_new_tokens": 16,
    "max_len": 64, "data.max_len": 64, "prompt_max_len": 32, "data.prompt_max_len": 32,
    "eval_steps": -1, "eval.steps": -1, "save_steps": -1, "ckpt.save_steps": -1,
}
WANDB = {"use_wandb", "logger.wandb.key"}


# ---- extraction ---------------------------------------------------------------------------------------------

def sources(src):
    """(label, path) of every script and README under src."""
    out = []
    for root, _, files in sorted(os.walk(src)):
        for f in sorted(files):
            if f.endswith(".sh") or f.endswith(".md"):
                label = os.path.relpath(os.path.join(root, f), src)
                out.append((label, os.path.join(root, f)))
    return out


def commands(text):
    """[(cli module, argv)] of every ``openrlhf.cli.X`` command in a script or README."""
    arrays = {}
    for name, body in re.findall(r"^\s*([A-Za-z_]\w*)=\(\s*$(.*?)^\s*\)", text, re.M | re.S):
        words = []
        for line in body.splitlines():
            with contextlib.suppress(ValueError):
                words += shlex.split(line, comments=True)
        arrays[name] = " ".join(shlex.quote(w) for w in words)
    text = re.sub(r"\$\{(\w+)\[@\]\}", lambda m: arrays.get(m.group(1), m.group(0)), text)
    text = re.sub(r"\\\r?\n", " ", text)
    env = {k: v.strip('"\'') for k, v in
           re.findall(r"^\s*(?:export\s+)?([A-Z_][A-Z0-9_]*)=(\S+)\s*$", text, re.M)}
    out = []
    for line in text.splitlines():
        m = re.search(r"openrlhf\.cli\.(\w+)(.*)", line)
        if not m:
            continue
        rest = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda v: env.get(v.group(1), v.group(0)), m.group(2))
        try:
            argv = shlex.split(rest, comments=True)
        except ValueError:
            argv = rest.split()
        out.append((m.group(1), argv))
    return out


def flag_values(argv):
    """[(flag without dashes, [values])] in order."""
    out = []
    for a in argv:
        if a.startswith("--"):
            name, eq, v = a[2:].partition("=")
            out.append((name, [v] if eq else []))
        elif out:
            out[-1][1].append(a)
    return out


# ---- OpenRLHF's parser ----------------------------------------------------------------------------------------

def openrlhf_refuses(version, module, argv):
    """The flags of argv OpenRLHF's parser of that version does not know (argparse: prefix abbreviations too)."""
    from rlhf.tools.openrlhf_flags import load

    known = load()[version].get(module, {})
    bad = []
    for name, _ in flag_values(argv):
        if name not in known and not [k for k in known if k.startswith(name)]:
            bad.append(name)
    return bad


def version_of(label):
    for v in ("0.10.1", "0.11.0", "0.11.2"):
        if v in label:
            return v
    return "0.11.2"


# ---- conversion -----------------------------------------------------------------------------------------------

def _kit_rows(kit, name):
    with open(os.path.join(kit, "data", name)) as fh:
        return [json.loads(x) for x in fh]


def write_data(kit, path, kind, keys, chat):
    """A jsonl file with the keys the command names, content from the kit's task data."""
    rows = []
    if kind in ("sft",):
        for r in _kit_rows(kit, "sft_train.jsonl")[:8]:
            q, a = r["input"], r["output"]
            row = {keys["input_key"]: [{"role": "user", "content": q}] if chat and not keys.get("output_key")
                   else q}
            if keys.get("output_key"):
                row[keys["output_key"]] = a
            elif chat:
                row[keys["input_key"]].append({"role": "assistant", "content": a})
            rows.append(row)
    elif kind in ("rm", "dpo"):
        for r in _kit_rows(kit, "pref_train.jsonl")[:8]:
            q = r["input"]
            if keys.get("prompt_key"):
                row = {keys["prompt_key"]: q, keys["chosen_key"]: r["chosen"], keys["rejected_key"]: r["rejected"]}
            elif chat:     # OpenRLHF's preference_dataset_mixture2_and_safe_pku: whole conversations
                row = {k: [{"role": "user", "content": q}, {"role": "assistant", "content": r[c]}]
                       for k, c in ((keys["chosen_key"], "chosen"), (keys["rejected_key"], "rejected"))}
            else:
                row = {keys["chosen_key"]: q + r["chosen"], keys["rejected_key"]: q + r["rejected"]}
            rows.append(row)
    else:
        for r in _kit_rows(kit, "prompts_train.jsonl")[:8]:
            row = {keys["input_key"]: [{"role": "user", "content": r["input"]}] if chat else r["input"]}
            if keys.get("label_key"):
                row[keys["label_key"]] = r["label"]
            rows.append(row)
    with open(path, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    return path


DEFAULT_KEYS = {"sft": {"input_key": "input", "output_key": None}, "rm": {"chosen_key": "chosen",
                "rejected_key": "rejected", "prompt_key": None}, "ppo": {"input_key": "input", "label_key": None}}
DEFAULT_KEYS["dpo"] = DEFAULT_KEYS["rm"]


def convert(module, argv, kit, work, src_dir):
    """(our argv, notes) for one OpenRLHF command; notes say what was swapped."""
    kind = OURS[module][1]
    fv = flag_values(argv)
    given = {n.split(".")[-1]: v for n, v in fv}
    keys = dict(DEFAULT_KEYS.get(kind or "ppo", {}))
    for k in keys:
        if given.get(k):
            keys[k] = given[k][0]
    chat = "apply_chat_template" in given
    out, notes = [], []
    os.makedirs(work, exist_ok=True)
    n = 1
    for k in ("n_samples_per_prompt",):
        if given.get(k):
            n = min(int(given[k][0]), 4)
    sizes = dict(SIZES)
    if kind == "ppo":
        sizes.update({"train_batch_size": 2 * n, "train.batch_size": 2 * n})
    for name, vals in fv:
        flag = "--" + name
        if name in ACTOR:
            vals = [kit]
        elif name in REWARD:
            vals = [",".join(os.path.join(kit, "reward") for _ in vals[0].split(","))] if vals else vals
        elif name in DATA:
            n = len(vals[0].split(",")) if vals else 1
            files = [write_data(kit, os.path.join(work, f"{name}_{i}.jsonl"), kind or "ppo", keys, chat)
                     for i in range(n)]
            vals = [",".join(files)]
        elif name in OUTPUT:
            vals = [os.path.join(work, name.replace(".", "_"))]
        elif name in FUNC and vals:
            if vals[0].endswith(".py"):
                f = os.path.join(src_dir, os.path.basename(vals[0]))
                if not os.path.exists(f):
                    notes.append(f"{name}: {os.path.basename(vals[0])} not in the sources")
                else:
                    dst = os.path.join(work, os.path.basename(f))
                    shutil.copy(f, dst)
                    vals = [dst]
            else:
                notes.append(f"{name} {vals[0]}: a remote server")
        elif GPUS.search(name):
            vals = ["1"]
        elif name in sizes:
            vals = [str(sizes[name])]
        elif name in ("n_samples_per_prompt", "rollout.n_samples_per_prompt") and vals and int(vals[0]) > 4:
            vals = ["4"]
        elif name in WANDB:
            notes.append(f"--{name} dropped (no wandb account)")
            continue
        elif name == "port":
            vals = ["0"]
        out += [flag] + vals
    if kind and "max_samples" not in given:
        out += ["--max_samples", "2" if kind == "ppo" else "4"]
    if kind and "train_batch_size" not in given and "batch_size" not in given:
        out += ["--train_batch_size", str(2 * n if kind == "ppo" else 4)]
    if kind and "micro_train_batch_size" not in given and "micro_batch_size" not in given:
        out += ["--micro_train_batch_size", "1"]
    if kind == "ppo" and "rollout_batch_size" not in given and "rollout.batch_size" not in {x for x, _ in fv}:
        out += ["--rollout_batch_size", "2"]
    if kind and not any(n in OUTPUT for n, _ in fv):
        out += ["--save_path", os.path.join(work, "save")]
    return out, notes


# ---- running ------------------------------------------------------------------------------------------------

def trainer_defaults(kind):
    """The defaults our entry point for kind passes to the parser (rlhf.train_X.DEFAULTS / PPO_DEFAULTS)."""
    import importlib

    mod = importlib.import_module(f"rlhf.train_{kind}")
    return getattr(mod, "PPO_DEFAULTS" if kind == "ppo" else "DEFAULTS", None)


def parse_ours(module, argv):
    """None if our parser accepts argv, else its one-line message."""
    from rlhf.config import parse

    kind = OURS[module][1]
    if kind is None:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            parse(kind, argv, trainer_defaults(kind))
    except (SystemExit, Exception) as e:  # noqa: BLE001 - the harness reports every refusal (click.UsageError, ...)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def env():
    e = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
             OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run_train(module, argv, work, timeout, nproc=1):
    """(status, message, seconds); a layout that needs more ranks than 1 (roles on ranks of their own, as written)
    is launched again with the ranks it asks for (one per role: the GPU counts are already 1)."""
    cmd = ["torchrun", "--standalone", "--nproc_per_node", str(nproc), "-m", OURS[module][0]] + argv
    t = time.time()
    try:
        p = subprocess.run(cmd, cwd=work, env=env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"> {timeout}s", time.time() - t
    text = p.stdout + p.stderr
    with open(os.path.join(work, "log.txt" if nproc == 1 else f"log_{nproc}.txt"), "w") as fh:
        fh.write(" ".join(shlex.quote(c) for c in cmd) + "\n" + text)
    if p.returncode == 0:
        return ("runs" if nproc == 1 else f"runs_{nproc}_ranks"), "", time.time() - t
    need = re.search(r"launch with --nproc_per_node x --nnodes = (\d+)", text)
    if need and nproc == 1 and int(need.group(1)) <= 4:
        status, msg, dt = run_train(module, argv, work, timeout, int(need.group(1)))
        return status, msg, dt + time.time() - t
    return "fails", last_error(text) or f"rc {p.returncode}", time.time() - t


def last_error(text):
    """The line that says what went wrong: our one-line refusal (error: ...), else the last exception line."""
    lines = [x for x in text.splitlines() if "elastic" not in x and "ChildFailedError" not in x]
    for pat in (r"^error: ", r"^\w*(Error|Exception)\b.*: ", r"Error|refuse|not supported"):
        hits = [x for x in lines if re.search(pat, x.strip())]
        if hits:
            return hits[-1].strip()[:300]
    return lines[-1][:300] if lines else ""


def run_serve(argv, work, timeout):
    cmd = [sys.executable, "-m", "rlhf.serve_rm"] + argv
    t = time.time()
    log = open(os.path.join(work, "log.txt"), "w")
    p = subprocess.Popen(cmd, cwd=work, env=env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        while time.time() - t < timeout and p.poll() is None:
            time.sleep(1)
            m = re.findall(r"(?:127\.0\.0\.1|0\.0\.0\.0|port)[: ]+(\d{3,5})", open(log.name).read())
            if m:
                port = int(m[-1])
                try:
                    body = json.dumps({"query": ["7+4=11"], "prompts": ["7+4="], "labels": ["11"]}).encode()
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/get_reward", data=body,
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=30) as r:
                        reply = json.loads(r.read())
                    return "runs", str(reply)[:120], time.time() - t
                except OSError:
                    continue
        tail = open(log.name).read().strip().splitlines()
        return "fails", (tail[-1] if tail else f"rc {p.poll()}")[:300], time.time() - t
    finally:
        if p.poll() is None:
            p.terminate()
            p.wait(10)
        log.close()


@click.command()
@click.option("--src", required=True)
@click.option("--kit", default=None, help="a tiny kit (python -m rlhf.models.tiny_kit); built under --work if absent")
@click.option("--work", default="/tmp/openrlhf_examples")
@click.option("--run", "do_run", is_flag=True, help="launch each command our parser accepts")
@click.option("--only", default=None, help="only sources/commands whose label contains this")
@click.option("--timeout", default=240)
@click.option("--json_out", default=None)
def main(src, kit, work, do_run, only, timeout, json_out):
    if kit is None:
        kit = os.path.join(work, "kit")
        if not os.path.exists(kit):
            from rlhf.models.tiny_kit import make_tiny
            make_tiny(kit)
    results = []
    seen = {}
    for label, path in sources(src):
        with open(path) as fh:
            text = fh.read()
        for i, (module, argv) in enumerate(commands(text)):
            cid = f"{label}#{i}:{module}"
            if only and only not in cid:
                continue
            r = {"id": cid, "module": module, "argv": argv}
            results.append(r)
            if module in NOT_TRAINING or module not in OURS:
                r["status"] = "skipped"
                r["why"] = "not a training or serving command" if module in NOT_TRAINING else "no entry point here"
                continue
            if "..." in argv or not argv:
                r["status"], r["why"] = "skipped", "a fragment (README '...'), not a whole command"
                continue
            bad = openrlhf_refuses(version_of(label), module, argv)
            if bad:
                r["status"], r["why"] = "openrlhf_refuses", "unknown to OpenRLHF's parser: " + ", ".join(bad)
                continue
            key = (module, tuple(argv))
            if key in seen:
                r["status"], r["why"] = "duplicate", seen[key]
                continue
            seen[key] = cid
            d = os.path.join(work, re.sub(r"[^A-Za-z0-9_.-]", "_", cid))
            shutil.rmtree(d, ignore_errors=True)
            ours, notes = convert(module, argv, kit, d, os.path.dirname(path))
            r["ours"], r["notes"] = ours, notes
            msg = parse_ours(module, ours)
            if msg:
                r["status"], r["why"] = "parser_refuses", msg
            elif not do_run:
                r["status"], r["why"] = "parses", ""
            else:
                if module == "serve_rm":
                    r["status"], r["why"], r["seconds"] = run_serve(ours, d, timeout)
                else:
                    r["status"], r["why"], r["seconds"] = run_train(module, ours, d, timeout)
            click.echo(f"{r['status']:16s} {cid}  {r.get('why', '')}", err=True)
    counts = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    click.echo(json.dumps(counts))
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
