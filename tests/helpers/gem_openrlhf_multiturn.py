"""A stand-in of OpenRLHF 0.10's ``examples/python/agent_func_gem_multiturn.py``, of the same shape.

What that file does, reproduced here (in our own words, not its code): an ``AgentInstance`` with
an ``async def __init__`` that makes a GEM game with a time-based seed; ``reset`` resets the game
with a random seed and keeps the learner's prompt as the observation; ``step`` passes the action
text to ``env.step``, clamps the reward at -1, ends on ``terminated or truncated``, writes the
next observation in Qwen's chat markup itself (``<|im_start|>user ... <|im_end|>`` and the
assistant's opening, with ``<|im_end|>`` first when the action text lacks it) and returns
tensors for the reward, score and logs; the ``AgentExecutor`` is ``MultiTurnAgentExecutor``.

One difference: OpenRLHF's file asks for ``game:GuessTheNumber-v0``, an id of GEM's
``train_openrlhf`` branch that gem-llm 0.1.0 does not register (0.1.0 has ``-easy``, ``-hard``,
``-random``); this one asks for ``game:GuessTheNumber-v0-easy``.
"""

import random
import time
from typing import Any

import gem
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

GAME = "game:GuessTheNumber-v0-easy"


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.turns = 0
        self.env = gem.make(GAME, seed=time.time_ns())
        self.max_steps = self.env.max_turns

    async def reset(self, states: dict, **kwargs):
        random.seed(kwargs.get("seed", time.time_ns()))
        self.env.reset(random.randint(1, 10_000_000))
        self.turns = 0
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict[str, Any]:
        observation, reward, terminated, truncated, info = self.env.step(states["action_text"])
        reward = max(reward, -1.0)
        done = terminated or truncated
        self.turns += 1
        if done:
            feedback = f"<|im_start|>user\n{observation}<|im_end|>"
        else:
            feedback = (
                f"<|im_start|>user\n{observation}\nYour next guess, in \\boxed{{}}.<|im_end|>\n<|im_start|>assistant\n"
            )
        if "<|im_end|>" not in states["action_text"]:
            feedback = "<|im_end|>\n" + feedback
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"turn_count": torch.tensor(self.turns)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
