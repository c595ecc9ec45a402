"""rlhf.tools.lora_combiner (OpenRLHF's openrlhf/cli/lora_combiner.py): base + peft adapter -> a plain HF folder
whose outputs equal base + adapter; reward models keep their value head."""
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlhf.tools.lora_combiner import main as combine


def _nonzero_lora(model, seed=0):
    """peft initialises B = 0 (the adapter starts as a no-op): give every LoRA matrix random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _keys(folder):
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def test_merged_causal_lm_equals_base_plus_adapter(tiny_kit, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_kit, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 23, 17, 24, 35, 205, 6, 25, 2, 7, 9]])
    with torch.no_grad():
        plain = base(ids).logits
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    _nonzero_lora(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        adapted = peft_model.eval()(ids).logits
    assert (adapted - plain).abs().max() > 1e-2  # the adapter changes the model, so the check below can fail

    out = combine(["--model_path", tiny_kit, "--lora_path", str(tmp_path / "adapter"),
                   "--output_path", str(tmp_path / "merged"), "--param_dtype", "fp32"])
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(ids).logits
    assert (got - adapted).abs().max() < 1e-5
    keys = _keys(out)
    assert not [k for k in keys if "lora_" in k or k.startswith("base_model.")], "adapter keys left in the merge"
    assert set(keys) == set(load_file(os.path.join(tiny_kit, "model.safetensors"))), "not the base model's layout"
    assert not os.path.exists(os.path.join(out, "adapter_config.json"))
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(tiny_kit).chat_template

    # OpenRLHF's default dtype is bf16 (also under its dotted spelling --ds.param_dtype)
    out16 = combine(["--model_path", tiny_kit, "--lora_path", str(tmp_path / "adapter"),
                     "--output_path", str(tmp_path / "merged16")])
    assert set(_keys(out16).values()) == {"BF16"}
    assert set(_keys(combine(["--model_path", tiny_kit, "--lora_path", str(tmp_path / "adapter"), "--output_path",
                              str(tmp_path / "merged_fp16"), "--ds.param_dtype", "fp16"])).values()) == {"F16"}


def test_reward_model_merge_keeps_the_value_head(tiny_kit, tmp_path):
    """--is_rm on an OpenRLHF-style RM (head saved as value_head, config value_head_prefix: value_head): an adapter
    with a trained copy of the head (SEQ_CLS, modules_to_save) gives that head; an adapter without one (OpenRLHF's
    LoRA RMs) keeps the base's. Either way the merged scores equal base + adapter, and the head is saved as score."""
    from peft import LoraConfig, get_peft_model

    from rlhf.models.load import load_reward_model
    from rlhf.rewards.reward_model import scores_at_positions

    rm = tmp_path / "rm"
    shutil.copytree(os.path.join(tiny_kit, "reward"), rm)
    w = load_file(rm / "model.safetensors")
    w["value_head.weight"] = w.pop("score.weight")
    save_file(w, rm / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((rm / "config.json").read_text())
    (rm / "config.json").write_text(json.dumps({**cfg, "value_head_prefix": "value_head"}))
    head = w["value_head.weight"]
    ids = torch.tensor([[5, 23, 17, 24, 35, 205, 6, 25, 2], [5, 24, 17, 24, 35, 205, 6, 26, 2]])
    att = torch.ones_like(ids)

    for task_type, trained_head in (("SEQ_CLS", True), (None, False)):
        model, _ = load_reward_model(str(rm))
        assert torch.equal(model.score.weight, head.reshape(model.score.weight.shape))
        lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                task_type=task_type))
        _nonzero_lora(lora, seed=1)
        if trained_head:  # the adapter's own copy of the head (peft ModulesToSaveWrapper)
            copy = lora.base_model.model.score.modules_to_save["default"]
            with torch.no_grad():
                copy.weight.add_(0.5)
        ad = tmp_path / f"adapter_{task_type}"
        lora.save_pretrained(ad)
        (ad / "reward_norm.json").write_text(json.dumps({"mean": 0.25, "std": 2.0}))
        with torch.no_grad():
            want = scores_at_positions(lora.eval(), ids, att)
        out = combine(["--model_path", str(rm), "--lora_path", str(ad), "--output_path", str(tmp_path / f"m_{task_type}"),
                       "--is_rm", "--param_dtype", "fp32"])
        merged, stats = load_reward_model(out)  # our RM loader: the head under config's value_head_prefix
        assert json.loads(open(os.path.join(out, "config.json")).read())["value_head_prefix"] == "score"
        assert stats == (0.25, 2.0), "reward_norm.json next to the adapter was not carried over"
        keys = _keys(out)
        assert "score.weight" in keys and "value_head.weight" not in keys and not [k for k in keys if "lora_" in k]
        got_head = load_file(os.path.join(out, "model.safetensors"))["score.weight"]
        assert torch.allclose(got_head, head.reshape(got_head.shape) + (0.5 if trained_head else 0.0)), task_type
        with torch.no_grad():
            got = scores_at_positions(merged, ids, att)
        assert (got - want).abs().max() < 1e-5, (task_type, got, want)

    # a causal-LM base (no head): fine when the adapter brings the head (TRL / peft SEQ_CLS reward models) ...
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_kit, num_labels=1, dtype=torch.float32)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_CLS"))
    _nonzero_lora(lora, seed=2)
    lora.save_pretrained(tmp_path / "ad_lm")
    with torch.no_grad():
        want = scores_at_positions(lora.eval(), ids, att)
    out = combine(["--model_path", tiny_kit, "--lora_path", str(tmp_path / "ad_lm"), "--output_path",
                   str(tmp_path / "m_lm"), "--is_rm", "--param_dtype", "fp32"])
    with torch.no_grad():
        assert (scores_at_positions(load_reward_model(out)[0], ids, att) - want).abs().max() < 1e-5
    # ... and an error when neither brings one (the merged head would be random)
    with pytest.raises(SystemExit, match=r"--is_rm: .*has no reward head weight 'score.weight'.* carries no head"):
        combine(["--model_path", tiny_kit, "--lora_path", str(tmp_path / "adapter_None"), "--output_path",
                 str(tmp_path / "m_bad"), "--is_rm"])


def test_bad_paths_name_the_flag(tiny_kit, tmp_path):
    with pytest.raises(SystemExit, match=r"--lora_path .*: a full model \(config.json\), not an adapter"):
        combine(["--model_path", tiny_kit, "--lora_path", tiny_kit, "--output_path", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match=r"--lora_path .*: no such directory"):
        combine(["--model_path", tiny_kit, "--lora_path", str(tmp_path / "nope"), "--output_path", str(tmp_path / "o")])
    ad = tmp_path / "ad"
    ad.mkdir()
    (ad / "adapter_config.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"--output_path .* is the --model_path: it would be overwritten"):
        combine(["--model_path", tiny_kit, "--lora_path", str(ad), "--output_path", tiny_kit])
    with pytest.raises(SystemExit, match=r"--model_path .*: no config.json in it"):
        combine(["--model_path", str(tmp_path), "--lora_path", str(ad), "--output_path", str(tmp_path / "o")])


def test_train_rm_with_lora_saves_an_adapter_that_merges(tiny_kit, tmp_path):
    """python -m rlhf.train_rm --lora_rank: LoRA on the backbone and a trained score head (peft SEQ_CLS
    modules_to_save), saved as an adapter folder with reward_norm.json; lora_combiner --is_rm then gives a plain
    RM whose scores equal the adapter's. (Before, train_rm ignored --lora_rank and trained every weight.)"""
    from e2e import torchrun
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
