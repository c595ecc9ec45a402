"""The SFT and GRPO CLIs run with the optional packages (datasets, wandb, submitit, uvicorn) hidden."""
import os
import subprocess
import sys

BLOCKER = '''
import sys

BLOCKED = ("datasets", "wandb", "submitit", "uvicorn")


class _Hide:
    """A meta-path finder wrapper: the blocked packages are not found, as on the GPU image (not installed)."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
'''


def test_sft_and_grpo_clis_run_without_datasets_wandb_submitit_uvicorn(tiny_kit, tmp_path):
    """The GPU image has no datasets, wandb, submitit or uvicorn: the SFT and GRPO CLIs (world 1, tiny kit, one
    step, local .jsonl data) run with those hidden from import (a sitecustomize on PYTHONPATH); before, every
    .jsonl went through ``datasets.load_dataset``."""
    (tmp_path / "block").mkdir()
    (tmp_path / "block" / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "block"), os.getcwd()]), HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    check = subprocess.run([sys.executable, "-c", "import importlib.util as u; print([u.find_spec(m) is None for m in "
                            "('datasets', 'wandb', 'submitit', 'uvicorn')])"], env=env, capture_output=True, text=True)
    assert check.stdout.strip() == "[True, True, True, True]", check.stdout + check.stderr
    data = os.path.join(tiny_kit, "data")
    common = ["--pretrain", tiny_kit, "--max_global_steps", "1", "--no_progress_bar", "--max_samples", "8"]
    runs = {
        "rlhf.train_sft": ["--dataset", f"{data}/sft_train.jsonl", "--train_batch_size", "8",
                           "--micro_train_batch_size", "8"],
        "rlhf.train_grpo": ["--prompt_data", f"{data}/prompts_train.jsonl", "--eval_dataset",
                            f"{data}/prompts_eval.jsonl", "--remote_rm_url", "builtin:arithmetic",
                            "--rollout_batch_size", "4", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
                            "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8",
                            "--generate_max_len", "4", "--rollout_engine", "hf",
                            "--eval_temperature", "0", "--eval_n_samples_per_prompt", "1"],
    }
    for mod, flags in runs.items():
        out = tmp_path / mod
        r = subprocess.run([sys.executable, "-m", mod, *common, *flags, "--save_path", str(out / "model"),
                            "--ckpt_path", str(out / "ckpt"), "--log_dir", str(out / "logs")],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{mod} rc {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert "[train 1]" in r.stdout, f"{mod} did not train a step:\n{r.stdout[-2000:]}"


# ---- issue 18, data side (from tests/test_silent_data.py): --max_len truncation and drops (counted), JSONL
# errors with line numbers, the label-key fix, empty and long prompts
