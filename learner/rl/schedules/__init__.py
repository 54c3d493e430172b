"""Schedules of an RL run, one file each, siblings over one controller and one trainer.

``SCHEDULES`` maps a name to its class; ``learner.rl.run`` picks one from the flags
(``schedule_name``): ``lockstep`` (the default), ``async`` (``--async_train``, off-policy with
bounded staleness) and ``colocated`` (``--colocate_all_models``, lockstep with learner and
engines taking turns on the same GPUs).
"""

from __future__ import annotations

from learner.rl.config import PPOConfig
from learner.rl.schedules.async_ import AsyncSchedule
from learner.rl.schedules.base import Decision, RunParts, Schedule, StoppedByRank0
from learner.rl.schedules.colocated import ColocatedSchedule
from learner.rl.schedules.lockstep import LockstepSchedule

SCHEDULES: dict[str, type[Schedule]] = {s.name: s for s in (LockstepSchedule, AsyncSchedule, ColocatedSchedule)}


def schedule_name(cfg: PPOConfig) -> str:
    """The schedule the flags ask for (PPOConfig refuses --colocate_all_models with --async_train)."""
    if cfg.colocate_all_models:
        return ColocatedSchedule.name
    return AsyncSchedule.name if cfg.async_train else LockstepSchedule.name


__all__ = ["SCHEDULES", "Decision", "RunParts", "Schedule", "StoppedByRank0", "schedule_name"]
