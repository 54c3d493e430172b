"""A deterministic agent for tests on the real engine: three actions, " ok" after each of the
first two, reward 1 per step (3 summed), ``turn`` in its logs. Loaded by a rollout server with
``--agent_func_path`` (tests/unit/rollout_service/test_rollout_service.py and bench/agent.py)."""

from __future__ import annotations

from typing import Any

from rollout_service.agent_api import AgentInstanceBase, MultiTurnAgentExecutor

TURNS = 3
FEEDBACK = " ok"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.turn = 0

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        self.turn += 1
        done = self.turn >= TURNS
        return {
            "rewards": 1.0,
            "environment_feedback": "" if done else FEEDBACK,
            "done": done,
            "extra_logs": {"turn": float(self.turn)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self) -> None:
        super().__init__(AgentInstance)
