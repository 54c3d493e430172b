"""Schedules of an RL run, one file each, siblings over one controller and one trainer.

``SCHEDULES`` maps a name to its class; ``learner.rl.run`` picks one from the flags. Today:
``lockstep``. The async (off-policy) and colocated (hybrid) schedules will sit beside it.
"""

from __future__ import annotations

from learner.rl.schedules.base import Decision, RunParts, Schedule, StoppedByRank0
from learner.rl.schedules.lockstep import LockstepSchedule

SCHEDULES: dict[str, type[Schedule]] = {LockstepSchedule.name: LockstepSchedule}

__all__ = ["SCHEDULES", "Decision", "RunParts", "Schedule", "StoppedByRank0"]
