"""A tiny environment written in GEM's own style (a ``gem.Env`` subclass, ``gem.register``), for
``--agent_func_path 'gem:rayless-test:Faults-v0?import=helpers.gem_envs'``.

The seed (the prompt's label, ``hub_envs.task_seed``) picks how it behaves:

* ``0``: healthy: the observation ``COUNT TO 2``; each action is answered ``OK N`` with reward
  0.5 and the second one terminates the episode (rewards 0.5 + 0.5);
* ``1``: its ``step`` raises ``RuntimeError('board on fire')``;
* ``2``: its ``step`` returns a number as the observation (not text);
* ``3``: never terminates by itself (only ``--max_len``/``--agent_max_turns`` end it).
"""

from __future__ import annotations

from typing import Any

import gem
from gem.envs.registration import ENV_REGISTRY

ENV_ID = "rayless-test:Faults-v0"


class FaultsEnv(gem.Env):
    def __init__(self, goal: int = 2, **_: Any) -> None:
        super().__init__()
        self.goal = goal
        self.mode = 0
        self.turn = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed)
        self.mode, self.turn = (seed or 0) % 4, 0
        return f"COUNT TO {self.goal}", {}

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        if self.mode == 1:
            raise RuntimeError("board on fire")
        if self.mode == 2:
            return 42, 0.0, False, False, {}
        done = self.mode == 0 and self.turn >= self.goal
        return f"OK {self.turn}", 0.5, done, False, {"turn": self.turn}


if ENV_ID not in ENV_REGISTRY:  # imported again by another name: already there
    gem.register(ENV_ID, FaultsEnv)
