"""Offline KD in SFT (``rlhf.train_sft --teacher_pretrain``): loss = (1 - a) CE + a KL(teacher || student) on the
data tokens, the teacher loaded from its own directory, frozen on the student's rank."""
import os
import shutil

import torch
from helpers.net import free_port


def _teacher(kit, out):
    """The kit model with seeded noise on its LM head, scaled up (the same tokenizer, a peaked distribution)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(kit, out, ignore=shutil.ignore_patterns("data", "reward", "*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(kit)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        w.mul_(20.0).add_(torch.randn(w.shape, generator=g))
    model.save_pretrained(out)
    return str(out)


def test_sft_kd_mixes_ce_and_forward_kl(tiny_kit, tmp_path):
    from rlhf.config import parse
    from rlhf.train_sft import DEFAULTS, run
    from rlhf.utils.logging import read_metrics

    teacher = _teacher(tiny_kit, tmp_path / "teacher")
    os.environ.update(MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    d = os.path.join(tiny_kit, "data")
    cfg = parse("sft", ["--pretrain", tiny_kit, "--dataset", f"{d}/sft_train.jsonl", "--max_global_steps", "3",
                        "--train_batch_size", "10", "--micro_train_batch_size", "5", "--learning_rate", "3e-3",
                        "--teacher_pretrain", teacher, "--kd_coef", "0.3", "--log_dir", str(tmp_path / "l"),
                        "--save_path", str(tmp_path / "m"), "--no_progress_bar"], DEFAULTS)
    run(cfg)
    rows = [r for r in read_metrics(str(tmp_path / "l" / "metrics.jsonl")) if r["split"] == "train"]
    assert len(rows) == 3, rows
    for r in rows:
        assert abs(r["loss"] - (0.7 * r["ce_loss"] + 0.3 * r["kd_loss"])) < 1e-4, r
        assert r["kd_loss"] > 0.5, r  # the student is not the teacher: the teacher came from --teacher_pretrain
    assert rows[-1]["loss"] < rows[0]["loss"], rows
