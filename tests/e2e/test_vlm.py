"""A tiny vision-language model (Qwen2-VL from a config, rlhf.models.tiny_vlm_kit) trains SFT, DPO and GRPO
through the CLIs on CPU with the HF engine, the three in this process (tests/helpers/run_clis.py: each module run
as ``python -m module argv`` would; a 1-rank job, as tests/unit/test_sleep_protocol.py runs its trainers)."""
import os

from helpers import run_clis
from helpers.e2e import flags_argv

from rlhf.utils.logging import read_metrics


def test_vlm_sft_dpo_grpo_through_the_clis(tmp_path, monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kit = str(tmp_path / "kit")  # built in the same process as the CLIs (one import of transformers' Qwen2-VL)
    d, sft, logs = os.path.join(kit, "data"), str(tmp_path / "sft"), {k: str(tmp_path / f"{k}_logs") for k in
                                                                      ("sft", "dpo", "grpo")}
    common = {"apply_chat_template": True, "input_key": "input", "micro_train_batch_size": 8, "max_len": 64,
              "no_progress_bar": True}
    chain = [
        ("rlhf.models.tiny_vlm_kit", ["--out", kit, "--n_train", 32, "--n_eval", 4]),
        ("rlhf.train_sft", flags_argv({**common, "pretrain": kit, "dataset": f"{d}/vlm_sft_train.jsonl",
                                       "output_key": "output", "train_batch_size": 16, "max_epochs": 1,
                                       "learning_rate": 3e-3, "packing_samples": True, "save_path": sft,
                                       "log_dir": logs["sft"]})),
        ("rlhf.train_dpo", flags_argv({**common, "pretrain": sft, "dataset": f"{d}/vlm_pref_train.jsonl",
                                       "chosen_key": "chosen", "rejected_key": "rejected", "train_batch_size": 16,
                                       "max_global_steps": 2, "learning_rate": 1e-3, "freeze_visual_encoder": True,
                                       "save_path": str(tmp_path / "dpo"), "log_dir": logs["dpo"]})),
        ("rlhf.train_grpo", flags_argv({**common, "pretrain": sft, "prompt_data": f"{d}/vlm_prompts_train.jsonl",
                                        "eval_dataset": f"{d}/vlm_prompts_eval.jsonl", "label_key": "label",
                                        "remote_rm_url": f"{d}/reward_colour.py", "rollout_engine": "hf",
                                        "generate_max_len": 3, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                                        "train_batch_size": 16, "micro_rollout_batch_size": 8, "max_global_steps": 2,
                                        "use_kl_loss": True, "init_kl_coef": 0.01, "packing_samples": True,
                                        "logprob_gap_interval": 1, "eval_n_samples_per_prompt": 1,
                                        "eval_temperature": 0.0, "save_path": str(tmp_path / "grpo"),
                                        "log_dir": logs["grpo"]})),
    ]
    run_clis.main(chain)  # in this process: transformers is imported already (a subprocess re-imports it: ~10 s)
    import torch.distributed as dist

    assert not dist.is_initialized(), "a CLI left its process group behind (later tests in this process expect none)"
    m = {k: [r for r in read_metrics(os.path.join(v, "metrics.jsonl")) if r["split"] == "train"] for k, v in logs.items()}
    sft_loss = [r["loss"] for r in m["sft"]]
    assert len(sft_loss) == 2 and sft_loss[-1] < sft_loss[0] - 0.3, f"SFT on image rows did not learn: {sft_loss}"
    assert os.path.isfile(os.path.join(sft, "preprocessor_config.json")), "the export lost the image processor"
    assert len(m["dpo"]) == 2 and all(abs(r["loss"]) < 5 for r in m["dpo"]), m["dpo"]
    g = m["grpo"]
    assert len(g) == 2, g
    gaps = [r["rollout_logprob_gap"] for r in g]
    assert max(gaps) < 1e-4, f"rollout (HF engine) vs trainer log-prob gap on image prompts: {gaps}"
    assert all(0.0 <= r["reward"] <= 1.0 and r["response_len"] > 0 for r in g), g
