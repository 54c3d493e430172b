"""Schedules of an RL run, one file each, siblings over one controller and one trainer.

``SCHEDULES`` maps a name to its class; ``learner.rl.run`` picks one from the flags. Today:
``lockstep`` (the default) and ``async`` (``--async_train``, off-policy with bounded staleness).
The colocated (hybrid) schedule will sit beside them.
"""

from __future__ import annotations

from learner.rl.schedules.async_ import AsyncSchedule
from learner.rl.schedules.base import Decision, RunParts, Schedule, StoppedByRank0
from learner.rl.schedules.lockstep import LockstepSchedule

SCHEDULES: dict[str, type[Schedule]] = {s.name: s for s in (LockstepSchedule, AsyncSchedule)}

__all__ = ["SCHEDULES", "Decision", "RunParts", "Schedule", "StoppedByRank0"]
