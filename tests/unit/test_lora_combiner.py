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
    # ... and an error when neither brings one (the merged head would be random); that adapter's base is rm, so
    # --allow_base_mismatch gets past the base check to the head check
    with pytest.raises(SystemExit, match=r"--is_rm: .*has no reward head weight 'score.weight'.* carries no head"):
        combine(["--model_path", tiny_kit, "--lora_path", str(tmp_path / "adapter_None"), "--output_path",
                 str(tmp_path / "m_bad"), "--is_rm", "--allow_base_mismatch"])


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


def _adapter(base_dir, out_dir, seed=0):
    """A peft LoRA adapter (non-zero) on ``base_dir``, saved to ``out_dir`` (records base_dir as its base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    _nonzero_lora(lora, seed)
    lora.save_pretrained(out_dir)
    return str(out_dir)


def _digests(folder):
    """{relative path: bytes} of every file under ``folder``."""
    out = {}
    for base, _, names in os.walk(folder):
        for n in names:
            p = os.path.join(base, n)
            out[os.path.relpath(p, folder)] = open(p, "rb").read()
    return out


def test_output_path_holding_the_inputs_keeps_them(tiny_kit, tmp_path):
    """Issue 42 item 1: --output_path pointed at the folder holding the base and the adapter (and a notes file) used
    to be deleted whole before the rename (rc 0). Now the merge goes in beside them: base, adapter and foreign files
    are byte-identical afterwards; a second merge replaces only the first merge's files (a stale file the first
    export wrote is dropped); a foreign file the merge would overwrite is refused before anything loads.
    Contract: OpenRLHF's openrlhf/cli/lora_combiner.py saves with save_pretrained into the folder (no deletion)."""
    from transformers import AutoModelForCausalLM

    from rlhf.checkpoint import EXPORT_RECORD, export_record

    models = tmp_path / "models"
    shutil.copytree(tiny_kit, models / "base", ignore=shutil.ignore_patterns("data", "reward"))
    ad = _adapter(str(models / "base"), models / "adapter")
    (models / "notes.txt").write_text("mine")
    before = _digests(models)
    out = combine(["--model_path", str(models / "base"), "--lora_path", ad, "--output_path", str(models),
                   "--param_dtype", "fp32"])
    after = _digests(models)
    lost = [k for k, v in before.items() if after.get(k) != v]
    assert not lost, f"the merge deleted or changed files it did not write: {lost}"
    assert "model.safetensors" in export_record(out) and "config.json" in export_record(out)
    AutoModelForCausalLM.from_pretrained(out)  # the merged model loads from the shared folder

    # a second merge replaces the first merge's files only; one the first wrote and the second does not is dropped
    stale = models / "model-00002-of-00002.safetensors"
    stale.write_bytes(b"old shard")
    rec = json.loads((models / EXPORT_RECORD).read_text())
    (models / EXPORT_RECORD).write_text(json.dumps({**rec, "files": rec["files"] + [stale.name]}))
    combine(["--model_path", str(models / "base"), "--lora_path", ad, "--output_path", str(models),
             "--param_dtype", "fp32"])
    assert not stale.exists(), "a file of the previous export was left behind"
    assert all(_digests(models).get(k) == v for k, v in before.items())

    # a folder holding someone else's model: refused before loading, nothing touched
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"mine": 1}')
    with pytest.raises(SystemExit, match=r"--output_path .*other holds config.json, which the final export would "
                                         r"overwrite and which no export of this project wrote"):
        combine(["--model_path", str(models / "base"), "--lora_path", ad, "--output_path", str(other)])
    assert (other / "config.json").read_text() == '{"mine": 1}' and not (tmp_path / "other.tmp").exists()


def test_adapter_of_another_base_is_refused_naming_both(tiny_kit, tmp_path):
    """Issue 42 item 7: the adapter's adapter_config.json base_model_name_or_path (peft/config.py
    ``PeftConfig.base_model_name_or_path``, filled from the model's name_or_path when peft wraps it) is compared
    with --model_path before anything loads: another model of the
    same shape (weights differ), another hub name, or LoRA shapes that do not fit are refused naming both; the same
    folder, a byte copy, or --allow_base_mismatch pass."""
    load, save = load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(tiny_kit, base, ignore=shutil.ignore_patterns("data", "reward"))
    ad = _adapter(str(base), tmp_path / "ad")
    other = tmp_path / "other"  # same shapes, other weights (a fine-tuned sibling)
    shutil.copytree(base, other)
    w = load(other / "model.safetensors")
    save({k: v + 0.05 for k, v in w.items()}, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SystemExit, match="weights differ") as e:
        combine(["--model_path", str(other), "--lora_path", ad, "--output_path", str(tmp_path / "o1")])
    assert str(base) in str(e.value) and str(other) in str(e.value) and "--allow_base_mismatch" in str(e.value)
    assert not (tmp_path / "o1").exists()

    copy = tmp_path / "copy"  # a byte copy of the base under another path: accepted
    shutil.copytree(base, copy)
    assert os.path.isdir(combine(["--model_path", str(copy), "--lora_path", ad, "--output_path", str(tmp_path / "o2"),
                                  "--param_dtype", "fp32"]))

    cfg_file = os.path.join(ad, "adapter_config.json")  # recorded as a hub name that is not --model_path
    cfg = json.loads(open(cfg_file).read())
    with open(cfg_file, "w") as fh:
        json.dump({**cfg, "base_model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}, fh)
    with pytest.raises(SystemExit, match=r"trained on Qwen/Qwen2.5-0.5B-Instruct .* --model_path is .*base: the names "
                                         r"differ"):
        combine(["--model_path", str(base), "--lora_path", ad, "--output_path", str(tmp_path / "o3")])
    with open(cfg_file, "w") as fh:
        json.dump(cfg, fh)

    wa = load(os.path.join(ad, "adapter_model.safetensors"))  # a pair that does not fit the base's weight
    key = sorted(k for k in wa if "lora_A" in k)[0]
    wa[key] = torch.zeros(4, 99)
    save(wa, os.path.join(ad, "adapter_model.safetensors"))
    with pytest.raises(SystemExit, match=rf"does not fit --model_path .*{key} has shape \[4, 99\]"):
        combine(["--model_path", str(base), "--lora_path", ad, "--output_path", str(tmp_path / "o4"),
                 "--allow_base_mismatch"])


def test_base_names_match_across_hub_cache_and_local_folders(tmp_path):
    """Training from a hub name records the HF cache snapshot folder (or the name); the same model given as the hub
    name, the snapshot or a local folder of that name matches; another hub name does not."""
    from rlhf.tools.lora_combiner import base_mismatch

    snap = tmp_path / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert base_mismatch("Qwen/Qwen2.5-0.5B", str(snap)) is None
    assert base_mismatch(str(snap), "Qwen/Qwen2.5-0.5B") is None
    assert base_mismatch("/models/qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B") is None
    assert base_mismatch("Qwen/Qwen2.5-0.5B-Instruct", str(snap)) == "the names differ"
    assert "is not a folder here" in base_mismatch("/models/llama", "/scratch/job1/qwen")
