"""An OpenRLHF agent file, unchanged: it imports ``openrlhf.utils.agent`` and defines AgentInstance and
AgentExecutor(MultiTurnAgentExecutor), as OpenRLHF's examples/python/agent_func.py does (that example draws a
random episode length and random rewards; this one checks the arithmetic answer so its numbers can be tested).

    torchrun --standalone --nproc_per_node 2 -m rlhf.train_grpo --config configs/grpo_tiny.yaml \
        --agent_func_path examples/agent_openrlhf.py
"""
import re
from typing import Any, Dict

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = 2

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        found = re.findall(r"-?\d+", states["action_text"])
        correct = bool(found) and found[-1] == str(states["label"]).strip()
        self.step_idx += 1
        done = correct or self.step_idx >= self.max_steps
        reward = torch.tensor(1.0) if correct else torch.tensor(-0.5)
        return {
            "rewards": reward,  # summed over the steps by MultiTurnAgentExecutor
            "scores": torch.tensor(float(correct)),
            "environment_feedback": "" if done else " wrong, again:",
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"correct": float(correct)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
