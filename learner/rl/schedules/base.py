"""What every schedule shares: the per-step decision and the parts it drives.

A schedule is a small object with one ``step(step)``, run by every learner rank in the same
order. Rank 0 decides (its ``Driver`` gathered enough samples or not, or failed) and every
rank learns the decision from one broadcast before any other collective of the step, so a
controller failure stops every rank with an error instead of leaving them waiting in a
collective that rank 0 will never enter.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from learner.rl.config import PPOConfig
from learner.rl.driver import Driver

log = logging.getLogger("learner")


class Decision(enum.IntEnum):
    TRAIN = 1  # every rank trains on the rollout rank 0 broadcasts next
    SKIP = 2  # too few samples scored (failures, filtering): no update this step, the run goes on
    STOP = 3  # rank 0 failed (its error is in its log): every rank raises


class StoppedByRank0(RuntimeError):
    pass


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (a collective; a world of one returns it as is)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.broadcast(t, 0)
    return int(t.item())


def broadcast_decision(decision: Decision | None) -> Decision:
    """Rank 0 passes its decision, the others None; everyone returns rank 0's."""
    return Decision(broadcast_int(int(decision) if decision is not None else 0))


@dataclass
class RunParts:
    """What a schedule drives; built once by ``learner.rl.run``."""

    cfg: PPOConfig
    trainer: Any  # PolicyTrainer: step(rollout) -> metrics, on every rank
    weights: Any  # WeightPush: push(version) on every rank
    driver: Driver | None  # rank 0 only
    device: torch.device
    total_steps: int
    turns: Any = None  # colocated only: learner.rl.schedules.colocated.Turns


class Schedule(abc.ABC):
    name: ClassVar[str]

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self.cfg = parts.cfg
        self.driver = parts.driver
        self.t_start = time.time()

    def start(self, version: int = 0) -> None:
        """Before the first step: every server starts from the learner's weights (``version``:
        0, or the resumed one, which servers that outlived the old learner may be past)."""
        self.push_weights(version)

    def finish(self) -> None:
        """After the last step, before the final evaluation."""

    @contextlib.contextmanager
    def states_resident(self) -> Iterator[None]:
        """The learner's states where a checkpoint save can read them (the colocated schedule
        may have parked them in host memory)."""
        yield

    @abc.abstractmethod
    def step(self, step: int) -> Decision:
        """One training step, on every rank."""

    def push_weights(self, version: int) -> None:
        self.parts.weights.push(version)
        if self.driver is not None:
            self.driver.weights_pushed(version)

    def eta_s(self, step: int) -> float:
        return (time.time() - self.t_start) / step * (self.parts.total_steps - step)
