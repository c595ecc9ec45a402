"""Does the tiny VLM learn to read its images?  The colour task of rlhf.models.tiny_vlm_kit (a coloured square on a
grey image; the question is the same for every row, so the answer is in the image only):

1. held-out greedy accuracy of the raw kit, then after SFT (12 epochs) (rlhf.train_sft on image rows), each also "blind"
   (every eval image replaced by a plain grey one: accuracy must drop to about the majority colour's share if the
   model reads the image);
2. GRPO (rlhf.train_grpo, HF engine, reward 1 for the right colour) from a shorter SFT (6 epochs): eval pass@1 over
   the steps, held-out accuracy before and after.

    python bench/vlm_colour.py [--out /tmp/vlm_bench] [--sft_epochs 12] [--grpo_from_epochs 6] [--grpo_steps 30]

Prints one JSON line with the numbers (CPU, fp32; minutes on 2 cores).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import click

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def accuracy(model_dir: str, rows: list, blind: bool = False) -> float:
    from types import SimpleNamespace as NS

    import torch
    from PIL import Image

    from rlhf.data.images import ImageInputs
    from rlhf.engines.hf_engine import HFEngine
    from rlhf.engines.rollout import SamplingParams
    from rlhf.models.load import load_causal_lm, load_tokenizer

    tok, images = load_tokenizer(model_dir), ImageInputs.from_model_dir(model_dir)
    if blind:
        grey = os.path.join(os.path.dirname(rows[0]["images"][0]), "_grey.png")
        Image.new("RGB", (48, 32), (130, 130, 130)).save(grey)
        rows = [{**r, "images": [grey]} for r in rows]
    d = NS(input_key="input", label_key="label", apply_chat_template=True, input_template=None, prompt_max_len=64)
    prompts = images.build_prompts(rows, tok, d)
    eng = HFEngine(load_causal_lm(model_dir, trainable=False), tok)
    with torch.no_grad():
        b = eng.generate([p.ids for p in prompts], SamplingParams(n=1, temperature=0.0, max_new_tokens=3,
                                                                  stop_token_ids=(tok.eos_token_id,)),
                         images=[p.images for p in prompts])
    texts = tok.batch_decode([s[b.prompt_len:][m.bool()] for s, m in zip(b.sequences, b.action_mask)],
                             skip_special_tokens=True)
    return sum(t.strip().startswith(r["label"]) for t, r in zip(texts, rows)) / len(rows)


def run_chain(chain, env):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "helpers", "run_clis.py"), json.dumps(chain)],
                       env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stdout[-2000:] + p.stderr[-4000:])


@click.command()
@click.option("--out", default="/tmp/vlm_bench")
@click.option("--sft_epochs", default=12)
@click.option("--grpo_from_epochs", default=6, help="GRPO starts from an SFT of this many epochs")
@click.option("--grpo_steps", default=30)
@click.option("--grpo_lr", default=5e-4)
def main(out, sft_epochs, grpo_from_epochs, grpo_steps, grpo_lr):
    from rlhf.data.loading import read_jsonl
    from rlhf.models.tiny_vlm_kit import make_tiny_vlm
    from rlhf.utils.logging import read_metrics

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    kit = make_tiny_vlm(os.path.join(out, "kit"), n_train=192, n_eval=48)
    d = os.path.join(kit, "data")
    ev = read_jsonl(f"{d}/vlm_prompts_eval.jsonl")
    common = ["--apply_chat_template", "--input_key", "input", "--max_len", 64, "--no_progress_bar"]
    sft, sft1 = os.path.join(out, "sft"), os.path.join(out, "sft1")
    run_chain([("rlhf.train_sft", common + ["--pretrain", kit, "--dataset", f"{d}/vlm_sft_train.jsonl",
                                            "--output_key", "output", "--train_batch_size", 16,
                                            "--micro_train_batch_size", 16, "--max_epochs", sft_epochs,
                                            "--learning_rate", 2e-3, "--save_path", sft,
                                            "--log_dir", os.path.join(out, "sft_logs")]),
               ("rlhf.train_sft", common + ["--pretrain", kit, "--dataset", f"{d}/vlm_sft_train.jsonl",
                                            "--output_key", "output", "--train_batch_size", 16,
                                            "--micro_train_batch_size", 16, "--max_epochs", grpo_from_epochs,
                                            "--learning_rate", 2e-3, "--save_path", sft1,
                                            "--log_dir", os.path.join(out, "sft1_logs")]),
               ("rlhf.train_grpo", common + ["--pretrain", sft1, "--prompt_data", f"{d}/vlm_prompts_train.jsonl",
                                             "--eval_dataset", f"{d}/vlm_prompts_eval.jsonl", "--label_key", "label",
                                             "--remote_rm_url", f"{d}/reward_colour.py", "--rollout_engine", "hf",
                                             "--generate_max_len", 3, "--rollout_batch_size", 8,
                                             "--n_samples_per_prompt", 8, "--train_batch_size", 64,
                                             "--micro_train_batch_size", 16, "--micro_rollout_batch_size", 64,
                                             "--max_global_steps", grpo_steps, "--actor_learning_rate", grpo_lr,
                                             "--eval_steps", 5, "--eval_n_samples_per_prompt", 1,
                                             "--eval_temperature", 0.0, "--save_path", os.path.join(out, "grpo"),
                                             "--log_dir", os.path.join(out, "grpo_logs")])], env)
    grpo = [r for r in read_metrics(os.path.join(out, "grpo_logs", "metrics.jsonl"))]
    res = {"raw_acc": accuracy(kit, ev), "sft_acc": accuracy(sft, ev), "sft_blind_acc": accuracy(sft, ev, blind=True),
           "grpo_start_acc": accuracy(sft1, ev), "grpo_end_acc": accuracy(os.path.join(out, "grpo"), ev),
           "majority_share": max(sum(r["label"] == c for r in ev) for c in {r["label"] for r in ev}) / len(ev),
           "sft_loss": [round(r["loss"], 3) for r in read_metrics(os.path.join(out, "sft_logs", "metrics.jsonl"))
                        if r["split"] == "train"][::6],
           "grpo_eval_pass1": [(r["step"], r.get("eval_default_pass1")) for r in grpo if r["split"] == "eval"],
           "grpo_reward": [round(r["reward"], 3) for r in grpo if r["split"] == "train"],
           "grpo_max_logprob_gap": max((r.get("rollout_logprob_gap", 0.0) for r in grpo if r["split"] == "train"),
                                       default=None)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
