"""A multi-turn environment with a Python tool: the policy's code runs in the sandbox.

Each action that holds a fenced ```python block is run in ``common.sandbox`` (no network, its own
directory, limits, killed whole; docs/environments.md) and what it printed, or why it failed, is
the environment's answer. An action without code is the final answer: reward 1 when its last line
equals the label, else 0; or an episode runs out of its ``MAX_CALLS`` tool calls (reward 0).

    python -m rollout_service ... --agent_func_path examples/agents/python_tool.py --agent_env_workers 2
    python -m learner.train_ppo ... --agent_func_path examples/agents/python_tool.py

One sandbox per process that loads this file (an environment worker with ``--agent_env_workers``,
else the rollout server), made at its first tool call and sized by ``RAYLESS_SANDBOX_WORKERS``
(default 4). ``extra_logs``: ``tool/calls``, ``tool/failed`` (calls that did not exit 0).
"""

from __future__ import annotations

import re

from common.sandbox import Sandbox, SandboxLimits
from rollout_service.agent_api import AgentInstanceBase, MultiTurnAgentExecutor

MAX_CALLS = 4
LIMITS = SandboxLimits(wall_s=5, cpu_s=5, memory_mb=512, max_output_bytes=16 << 10)
_CODE = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)
_sandbox: Sandbox | None = None


def sandbox() -> Sandbox:
    global _sandbox
    if _sandbox is None:
        _sandbox = Sandbox.from_env(limits=LIMITS)
    return _sandbox


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.calls = self.failed = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        blocks = _CODE.findall(states["action_text"])
        logs = {"tool/calls": float(self.calls), "tool/failed": float(self.failed)}
        if not blocks:  # the final answer
            lines = states["action_text"].strip().splitlines()
            right = bool(lines) and lines[-1].strip() == str(states.get("label", "")).strip()
            return {"rewards": float(right), "environment_feedback": "", "done": True, "extra_logs": logs}
        self.calls += 1
        result = await sandbox().run(blocks[-1])
        self.failed += not result.ok
        if result.ok:
            feedback = result.stdout
        else:
            feedback = f"{result.message}\n{result.stderr[-1000:]}"
        done = self.calls >= MAX_CALLS
        logs = {"tool/calls": float(self.calls), "tool/failed": float(self.failed)}
        return {
            "rewards": 0.0,
            "environment_feedback": "" if done else f"\n[output]\n{feedback}\n[/output]\n",
            "done": done,
            "extra_logs": logs,
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
