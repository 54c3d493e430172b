"""The agent demo's task (``make demo TASK=agent``): reverse a digit string, with a second try.

The same prompts as ``launch/demo_task.py`` (``"4721>"`` -> ``"1274"``), run as a multi-turn
episode of this file's environment: a right answer ends the episode with reward 1; a wrong
one gets the environment's feedback, which repeats the question (``" no 4721>"``), and a second
try worth 0.5 if right, 0 if not. The policy thus learns from two kinds of turn: its first
answer, and an answer given after seeing its own mistake and the environment's words (mask 0:
context, not trained). ``accuracy`` (solved in either try) is what the demo reports as the
held-out success rate; ``first_try`` is logged beside it.

Written against OpenRLHF's agent contract (``AgentExecutor`` built on ``MultiTurnAgentExecutor``),
so the rollout servers load this very file with ``--agent_func_path launch/demo_agent_task.py``.
"""

from __future__ import annotations

from typing import Any

from launch.demo_task import problems, write_jsonl  # noqa: F401 - the same split as the plain demo
from rollout_service.agent_api import AgentInstanceBase, MultiTurnAgentExecutor

SECOND_TRY_REWARD = 0.5


def answer(action_text: str) -> str:
    return action_text.strip()


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.tries = 0
        self.question = ""

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        self.question = states["observation"]
        return {"observation": self.question}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        self.tries += 1
        right = answer(states["action_text"]) == str(states["label"])
        last = right or self.tries >= 2
        reward = (1.0 if self.tries == 1 else SECOND_TRY_REWARD) if right else 0.0
        return {
            "rewards": reward,
            "scores": reward,
            # A wrong first answer: "no", then the question again (ends on '>' as the prompt does).
            "environment_feedback": "" if last else f" no {self.question}",
            "done": last,
            "extra_logs": {"accuracy": float(right), "first_try": float(right and self.tries == 1)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self) -> None:
        super().__init__(AgentInstance)
