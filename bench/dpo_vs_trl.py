"""DPO step time and peak memory: rlhf.train_dpo vs TRL's DPOTrainer, same model, pairs, batch, lengths.

    pip install -e ".[bench]"
    python bench/dpo_vs_trl.py --size tiny                       # 32 pairs, the kit's 1-2 token answers
    python bench/dpo_vs_trl.py --size medium --resp_tokens 128   # 32k vocab, 8 pairs, 64-128 token responses
    python bench/dpo_vs_trl.py --size medium --resp_tokens 512

Single process on the CPU, sigmoid loss, beta 0.1, the frozen reference model computed on the fly on both sides,
padded batches on both sides.  ``--resp_tokens L`` writes pairs whose chosen and rejected responses are the
answer followed by a digit string, L/2..L tokens in all (digits are single tokens in the kits' tokenizer), so
lengths vary within a batch as real data does.  Like with like: the same ``--precision`` (fp32 by default; TRL
would pick bf16 on its own) and ``--gradient_checkpointing`` (off; TRL's own default is on) on both sides, each
side reporting what it resolved, the run refused if they differ (bench/common.py ``check_like_with_like``);
``--ours_only`` runs our side alone.  The two sides alternate in short blocks (bench/common.py);
writes bench/results/dpo_<size>_<resp_tokens>.json.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile

import click

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    PRECISIONS,
    Gate,
    gate_rlhf_logger,
    need_trl,
    rlhf_flags,
    rlhf_resolved,
    run_interleaved,
    save,
    set_threads,
    table,
    trl_args,
    trl_resolved,
)
from kits import build_kit, kit_settings  # noqa: E402

SIZES = {  # defaults per kit size: pairs per step, response tokens (0: the kit's own pairs), warm-up, block
    "tiny": dict(batch=32, resp_tokens=0, warmup=5, block=5),
    "medium": dict(batch=8, resp_tokens=128, warmup=2, block=2),
}


def pairs_file(path: str, resp_tokens: int) -> str:
    """The kit's preference pairs, or (resp_tokens > 0) long-response pairs derived from them."""
    src = os.path.join(path, "data", "pref_train.jsonl")
    if resp_tokens <= 0:
        return src
    out = os.path.join(path, "data", f"pref_long_{resp_tokens}.jsonl")
    if not os.path.isfile(out):
        rng = random.Random(0)
        rows = [json.loads(line) for line in open(src)][:512]
        tmp = out + f".{os.getpid()}"
        with open(tmp, "w") as fh:
            for r in rows:
                pad = lambda a: a + " " + "".join(rng.choice("0123456789")  # noqa: E731
                                                 for _ in range(max(0, rng.randint(resp_tokens // 2, resp_tokens)
                                                                    - len(a) - 2)))
                fh.write(json.dumps(dict(r, chosen=pad(r["chosen"]), rejected=pad(r["rejected"]))) + "\n")
        os.replace(tmp, out)
    return out


def tokens_per_pair(path: str, data: str) -> float:
    """Mean tokens of a pair (prompt + chosen + eos, prompt + rejected + eos) over the file: the same on both sides."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    rows = [json.loads(line) for line in open(data)]
    n = sum(len(tok(r["input"] + r["chosen"])["input_ids"]) + len(tok(r["input"] + r["rejected"])["input_ids"]) + 2
            for r in rows)
    return n / len(rows)


def side_trl(path, data, gate, batch, lr, max_len, per_step_tokens, precision, ckpt):
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    ds = load_dataset("json", data_files=data, split="train")
    ds = ds.rename_column("input", "prompt").remove_columns(["label"])
    tok = AutoTokenizer.from_pretrained(path)

    class Step(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                gate.step(per_step_tokens)

    cfg = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, max_steps=gate.total,
                    learning_rate=lr, beta=0.1, loss_type=["sigmoid"], use_cpu=True, report_to="none",
                    save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, max_length=max_len,
                    dataloader_num_workers=0, **trl_args(precision, ckpt))
    tr = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(path),
                    ref_model=AutoModelForCausalLM.from_pretrained(path), args=cfg, train_dataset=ds,
                    processing_class=tok, callbacks=[Step()])
    gate.info.update(trl_resolved(tr))
    tr.train()


def side_rlhf(path, data, gate, batch, lr, max_len, per_step_tokens, precision, ckpt):
    from rlhf.config import parse
    from rlhf.supervised.tasks import DPOTask
    from rlhf.supervised.trainer import run_supervised

    log = tempfile.mkdtemp()
    cfg = parse("dpo", ["--pretrain", path, "--dataset", data, "--eval_split", "0",
                        "--train_batch_size", str(batch), "--micro_train_batch_size", str(batch),
                        "--max_global_steps", str(gate.total), "--learning_rate", str(lr), "--beta", "0.1",
                        "--logging_steps", "1", "--log_dir", log, "--save_path", os.path.join(log, "m"),
                        "--no_progress_bar", "--max_len", str(max_len), *rlhf_flags(precision, ckpt)])
    gate.info.update(rlhf_resolved(cfg))
    gate_rlhf_logger(gate, lambda m: per_step_tokens)
    run_supervised(cfg, DPOTask, "pref")


@click.command()
@click.option("--size", type=click.Choice(["tiny", "medium"]), default="tiny", help="bench kit (bench/kits.py)")
@click.option("--side", type=click.Choice(["both", "trl", "rlhf"]), default="both")
@click.option("--batch", type=int, default=None, help="pairs per step [size default]")
@click.option("--resp_tokens", type=int, default=None, help="response length (0: the kit's pairs) [size default]")
@click.option("--warmup", type=int, default=None, help="untimed steps per side before the first block")
@click.option("--block", type=int, default=None, help="steps per timed block")
@click.option("--rounds", default=8, help="rounds of one block per side, alternating which goes first")
@click.option("--lr", default=5e-5)
@click.option("--kit_dir", default=None, help="where the kit is built [/tmp/rlhf-bench-kit-<size>]")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32",
              help="both sides: fp32, or bf16 mixed precision (TRL bf16=True, rlhf --bf16)")
@click.option("--gradient_checkpointing", is_flag=True, help="both sides recompute activations in backward")
@click.option("--ours_only", is_flag=True, help="run our side only (no TRL): its s/step, CPU-s/step and RSS")
def main(size, side, batch, resp_tokens, warmup, block, rounds, lr, kit_dir, precision, gradient_checkpointing,
         ours_only):
    d = SIZES[size]
    batch = batch or d["batch"]
    resp_tokens = d["resp_tokens"] if resp_tokens is None else resp_tokens
    warmup, block = warmup or d["warmup"], block or d["block"]
    kit_dir = kit_dir or os.path.join(tempfile.gettempdir(), f"rlhf-bench-kit-{size}")
    path = build_kit(size, kit_dir)
    data = pairs_file(path, resp_tokens)
    max_len = max(64, resp_tokens + 32)  # never truncates: prompt (4) + response (<= resp_tokens) + eos
    if side != "both":
        set_threads()
        gate = Gate(warmup, block, rounds)
        fn = side_trl if side == "trl" else side_rlhf
        fn(path, data, gate, batch, lr, max_len, batch * tokens_per_pair(path, data), precision,
           gradient_checkpointing)
        return
    need_trl(ours_only)
    args = ["--size", size, "--batch", str(batch), "--resp_tokens", str(resp_tokens), "--warmup", str(warmup),
            "--block", str(block), "--rounds", str(rounds), "--lr", str(lr), "--kit_dir", kit_dir,
            "--precision", precision] + (["--gradient_checkpointing"] if gradient_checkpointing else [])
    same = {"precision": precision, "gradient_checkpointing": gradient_checkpointing}
    settings = {**kit_settings(path), **same, "pairs_per_step": batch, "resp_tokens": resp_tokens or "kit",
                "tokens_per_pair": round(tokens_per_pair(path, data), 1),
                "threads": os.environ.get("OMP_NUM_THREADS", "1"), "warmup": warmup, "block": block, "rounds": rounds}
    print("DPO step: " + json.dumps(settings), flush=True)
    rows, ratios = run_interleaved(__file__, args, rounds, which=("rlhf",) if ours_only else ("trl", "rlhf"),
                                   same=same)
    print(table("DPO step", rows, settings, ratios))
    name = f"dpo_{size}_{resp_tokens}" + ("" if precision == "fp32" else f"_{precision}") + ("_ours" if ours_only
                                                                                            else "")
    print("wrote", save(name, rows, settings, ratios))


if __name__ == "__main__":
    main()
