"""rlhf: torchrun-native RLHF training (PPO, GRPO, RLOO, REINFORCE++, DPO, RM, SFT) without Ray."""
__version__ = "0.1.0"
