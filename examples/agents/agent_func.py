"""A multi-turn environment written for OpenRLHF's agent API, trained by rayless unchanged.

Everything here follows OpenRLHF's published contract (``openrlhf/utils/agent.py`` and its
``examples/python/agent_func.py``): the file imports its base classes from
``openrlhf.utils.agent`` (rayless provides that path when OpenRLHF is not installed), defines an
``AgentInstance`` whose async ``reset``/``step`` take and return OpenRLHF's dicts (rewards and
logs as tensors), and an ``AgentExecutor`` built on ``MultiTurnAgentExecutor``. Run it with::

    python -m learner.train_ppo ... --agent_func_path examples/agents/agent_func.py
    python -m rollout_service ... --agent_func_path examples/agents/agent_func.py

The environment is a toy for the plumbing, which a small random model can still learn from:
each action is judged by its first character (an even code point is "right"); a right action
ends the episode, a wrong one gets OpenRLHF-style feedback and another try, at most three.
A right step is worth 1 and a wrong one costs 0.5, summed over the episode as OpenRLHF does:
right at once 1.0, at the second try 0.5, at the third 0.0, never -1.5.
"""

from typing import Any, Dict

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

MAX_TRIES = 3


def is_right(action_text: str) -> bool:
    return bool(action_text) and ord(action_text[0]) % 2 == 0


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.tries = 0

    async def reset(self, states: dict, **kwargs):
        # The prompt as the first observation (an environment may rewrite it here).
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        self.tries += 1
        right = is_right(states["action_text"])
        done = right or self.tries >= MAX_TRIES
        reward = torch.tensor(1.0 if right else -0.5)
        feedback = "\n\nHuman: [CORRECT]\n" if right else "\n\nHuman: [INCORRECT]\nTry again.\n\nAssistant: "
        return {
            "rewards": reward,  # for the advantages
            "scores": reward,  # for dynamic filtering
            "environment_feedback": "" if done else feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"tries": torch.tensor(float(self.tries)), "right": torch.tensor(float(right))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
