"""Scores that vary from sample to sample on the tiny random kit, for the sweep (whose model never solves the
arithmetic task, so the built-in reward is 0 everywhere and every advantage 0): the score of a response is the
sum of its characters' code points mod 3, halved (0, 0.5 or 1).

- ``reward_func`` (--remote_rm_url): OpenRLHF's reward_func contract, scored on the response only, so the
  samples of one prompt differ (an update moves the weights; groups are kept or filtered by their mean).
- ``AgentInstance`` (--agent_func_path): a two-turn agent (rlhf.agents.base): the first turn always gets
  feedback (action-mask 0 tokens between the turns), the second ends the episode with the score of its text.
"""
from rlhf.agents.base import AgentInstanceBase


def score(text: str) -> float:
    return float(sum(map(ord, text)) % 3) / 2


def reward_func(queries, prompts, labels, **kwargs):
    return {"rewards": [score(q[len(p):]) for q, p in zip(queries, prompts)]}


class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        if states["step"] == 0:
            return {"rewards": 0.0, "scores": 0.0, "done": False, "environment_feedback": " ?",
                    "extra_logs": {}}
        s = score(states["action_text"])
        return {"rewards": s, "scores": s, "done": True, "environment_feedback": "", "extra_logs": {}}
