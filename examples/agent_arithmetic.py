"""Multi-turn agent for the built-in arithmetic task: a wrong answer gets feedback and another try.

    torchrun --standalone --nproc_per_node 2 -m rlhf.train_grpo --config configs/grpo_tiny.yaml \
        --agent_func_path examples/agent_arithmetic.py --max_steps 2
"""
from rlhf.agents.base import AgentInstanceBase
from rlhf.data.arithmetic import arithmetic_score, extract_answer


class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        correct = extract_answer(states["action_text"]) == str(states["label"]).strip()
        reward = arithmetic_score(states["action_text"], states["label"]) * (0.5 ** states["step"])
        return {"rewards": reward, "scores": float(correct), "done": correct,
                "environment_feedback": "" if correct else " wrong, again:", "extra_logs": {}}
