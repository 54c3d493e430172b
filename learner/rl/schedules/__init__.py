"""Schedules of an RL run, siblings over one controller, one trainer and one ``Schedule.step``.

``SCHEDULES`` maps a kind to its class: ``lockstep`` (the default) and ``async``
(``--async_train``, off-policy with bounded staleness). The colocated schedule
(``--colocate_all_models``) is lockstep run with ``ColocatedTurns`` (``colocated.py``): learner
and engines take turns on the same GPUs. ``schedule_name`` is what the run's log calls it.
"""

from __future__ import annotations

from learner.rl.config.sections import TrainSection
from learner.rl.schedules.async_ import AsyncSchedule
from learner.rl.schedules.base import Decision, RunParts, Schedule, StoppedByRank0, Turns
from learner.rl.schedules.lockstep import LockstepSchedule

SCHEDULES: dict[str, type[Schedule]] = {s.kind: s for s in (LockstepSchedule, AsyncSchedule)}


def schedule_kind(train: TrainSection) -> str:
    """The schedule class the ``train`` section asks for (PPOConfig refuses --colocate_all_models
    with --async_train)."""
    return AsyncSchedule.kind if train.async_enable else LockstepSchedule.kind


def schedule_name(train: TrainSection) -> str:
    """The schedule as the run's log names it: lockstep, async, or colocated (lockstep with turns)."""
    return "colocated" if train.colocate_all else schedule_kind(train)


def make_schedule(parts: RunParts) -> Schedule:
    return SCHEDULES[schedule_kind(parts.cfg.train)](parts)


__all__ = [
    "SCHEDULES",
    "Decision",
    "RunParts",
    "Schedule",
    "StoppedByRank0",
    "Turns",
    "make_schedule",
    "schedule_kind",
    "schedule_name",
]
