"""A LoRA reward model trained through the CLI (python -m rlhf.train_rm) saves an adapter that rlhf.tools.lora_combiner
merges."""
import json
import os

import torch

from rlhf.tools.lora_combiner import main as combine


def test_train_rm_with_lora_saves_an_adapter_that_merges(tiny_kit, tmp_path):
    """python -m rlhf.train_rm --lora_rank: LoRA on the backbone and a trained score head (peft SEQ_CLS
    modules_to_save), saved as an adapter folder with reward_norm.json; lora_combiner --is_rm then gives a plain
    RM whose scores equal the adapter's. (Before, train_rm ignored --lora_rank and trained every weight.)"""
    from helpers.e2e import torchrun
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from rlhf.models.load import load_reward_model
    from rlhf.rewards.reward_model import scores_at_positions

    d = os.path.join(tiny_kit, "data")
    train, _, out = torchrun("rlhf.train_rm", 0, ["--pretrain", tiny_kit, "--dataset", f"{d}/pref_train.jsonl",
                                                  "--eval_split", 0, "--max_global_steps", 2, "--lora_rank", 4,
                                                  "--learning_rate", 1e-2, "--save_path", tmp_path / "rm"],
                             tmp_path, str(tmp_path / "logs"))
    ad = tmp_path / "rm"
    cfg = json.loads((ad / "adapter_config.json").read_text())
    assert cfg["task_type"] == "SEQ_CLS" and cfg["r"] == 4, cfg
    assert os.path.isfile(ad / "reward_norm.json") and len(train) == 2
    base = AutoModelForSequenceClassification.from_pretrained(tiny_kit, num_labels=1, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, ad).eval()
    trained_head = adapted.base_model.model.score.modules_to_save["default"].weight
    assert not torch.equal(trained_head, adapted.base_model.model.score.original_module.weight), \
        "the score head did not train (frozen by peft?)"
    merged_dir = combine(["--model_path", tiny_kit, "--lora_path", str(ad), "--output_path", str(tmp_path / "m"),
                          "--is_rm", "--param_dtype", "fp32"])
    merged, stats = load_reward_model(merged_dir)
    assert stats == tuple(json.loads((ad / "reward_norm.json").read_text())[k] for k in ("mean", "std"))
    ids = torch.tensor([[5, 23, 17, 24, 35, 205, 6, 25, 2], [5, 24, 17, 24, 35, 205, 6, 26, 2]])
    att = torch.ones_like(ids)
    with torch.no_grad():
        assert (scores_at_positions(merged, ids, att) - scores_at_positions(adapted, ids, att)).abs().max() < 1e-5
