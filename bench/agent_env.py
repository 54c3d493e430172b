"""The environment ``bench/agent.py`` runs episodes of: ``RAYLESS_BENCH_TURNS`` actions, no
feedback text, reward 1; each step waits ``RAYLESS_BENCH_STEP_S`` seconds (read at every step, so
one loaded file serves every variant). ``RAYLESS_BENCH_BLOCKING=1`` makes the step a plain
``def`` that sleeps (the server runs it in a thread) instead of an ``async def`` that awaits."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from rollout_service.agent_api import AgentInstanceBase, MultiTurnAgentExecutor


def _turns() -> int:
    return int(os.environ.get("RAYLESS_BENCH_TURNS", "3"))


def _delay() -> float:
    return float(os.environ.get("RAYLESS_BENCH_STEP_S", "0"))


def _answer(turn: int) -> dict:
    done = turn >= _turns()
    return {"rewards": 1.0, "environment_feedback": "", "done": done}


class AsyncInstance(AgentInstanceBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.turn = 0

    async def step(self, states: dict, **kwargs: Any) -> dict:
        self.turn += 1
        if _delay():
            await asyncio.sleep(_delay())
        return _answer(self.turn)


class BlockingInstance(AsyncInstance):
    def step(self, states: dict, **kwargs: Any) -> dict:  # type: ignore[override]
        self.turn += 1
        time.sleep(_delay())
        return _answer(self.turn)


def _variant() -> type:
    return BlockingInstance if os.environ.get("RAYLESS_BENCH_BLOCKING") == "1" else AsyncInstance


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self) -> None:
        super().__init__(_variant())

    async def execute(self, *args: Any, **kwargs: Any) -> dict:
        # the variant is read per episode, so that one loaded file serves both kinds of step
        self.agent_instance_cls = _variant()
        return await super().execute(*args, **kwargs)
