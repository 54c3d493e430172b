"""An agent file whose environment misbehaves on command: the label of a prompt says how.

For the environment worker pool (``rollout_service/env_pool.py``): healthy episodes beside ones
whose step hangs, crashes the worker, leaks memory or exits. Two actions per healthy episode
(feedback " 1" after the first), reward 1 per step. The label picks the fault, in the second
step (after its second action, so the episode has turns to lose):

* ``ok``: healthy; ``slow:S``: healthy, each step sleeps S seconds (asyncio);
* ``hang``: the step awaits forever (cancellable); ``hang_def``: a plain ``def`` step that blocks
  its thread forever; ``hang_loop``: an ``async`` step that blocks the worker's event loop;
* ``segv``: the worker segfaults (SIGSEGV); ``os_exit``: ``os._exit(7)``;
* ``leak``: allocates (and touches) 64 MiB every 5 ms, without bound;
* ``exit``: ``sys.exit(3)``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from typing import Any

from rollout_service.agent_api import AgentInstanceBase, MultiTurnAgentExecutor

TURNS = 2
FEEDBACK = " 1"  # in the stand-in engine's vocabulary (100) as a character tokenizer encodes it


def _healthy(turn: int) -> dict:
    done = turn >= TURNS
    return {"rewards": 1.0, "environment_feedback": "" if done else FEEDBACK, "done": done, "extra_logs": {}}


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.turn = 0

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        self.label = str(states.get("label") or "ok")
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        self.turn += 1
        fault = self.label if self.turn == TURNS else "ok"
        if fault.startswith("slow:"):
            await asyncio.sleep(float(fault.split(":")[1]))
        elif fault == "hang":
            await asyncio.Event().wait()
        elif fault == "hang_def":
            await asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)
        elif fault == "hang_loop":
            time.sleep(3600)
        elif fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif fault == "os_exit":
            os._exit(7)
        elif fault == "leak":
            blobs = []
            while True:
                blobs.append(bytearray(b"\x01") * (64 << 20))
                await asyncio.sleep(0.005)
        elif fault == "exit":
            sys.exit(3)
        return _healthy(self.turn)


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self) -> None:
        super().__init__(AgentInstance)
