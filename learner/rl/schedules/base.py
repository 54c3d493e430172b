"""The step every schedule runs, and what a schedule supplies to it.

A schedule is a small object with one ``step(step)``, run by every learner rank in the same
order. The step is written once, here::

    rank 0: batch = next_batch(step)                      where the schedules differ
    decision broadcast (TRAIN / SKIP / STOP)              before any other collective of the step
    rollout broadcast, trimmed to whole train batches
    train                                                 PolicyTrainer.step, every rank
    push the weights as version `step`                    every rank (a gather under ZeRO-3)
    rank 0: report (the schedule adds its own metrics)

Rank 0 decides (it gathered enough samples or not, or failed) and every rank learns the
decision from one broadcast before any other collective of the step, so a controller failure
stops every rank with an error instead of leaving them waiting in a collective that rank 0
will never enter.

A schedule supplies where rank 0's batch comes from (``next_batch``: lockstep collects the
step's prompts, async takes scored groups from its pump) and its own metrics
(``step_metrics``). How the learner and the engines share devices is a separate object every
schedule receives, ``Turns``: a no-op here, where every role has its own devices;
``learner.rl.schedules.colocated.ColocatedTurns`` hands the GPUs back and forth, so the
colocated schedule is lockstep with those turns, not a schedule of its own.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from learner.controller.types import Rollout
from learner.rl.config import PPOConfig
from learner.rl.driver import Driver, StepBatch
from learner.rl.experience import broadcast_rollout
from learner.rl.policy_trainer import StepResult

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


class Trainer(Protocol):
    """``learner.rl.policy_trainer.PolicyTrainer``, as a schedule uses it (every rank)."""

    def step(self, rollout: Rollout, *, on_policy: bool = False, version: int | None = None) -> StepResult: ...


class Weights(Protocol):
    """``learner.rl.weight_push.WeightPush``, as a schedule uses it (every rank)."""

    def push(self, version: int) -> Any: ...


class Turns:
    """How the learner and the engines share devices between the phases of a step.

    Here they do not (each role has its own devices): every turn is a no-op. Hooks run on every
    rank unless marked rank 0; ``learner.rl.schedules.colocated.ColocatedTurns`` is the other kind.
    """

    name: ClassVar[str | None] = None  # what the run's log calls a schedule with these turns

    def start(self) -> None:
        """Before the first push."""

    def started(self) -> None:
        """After the first push."""

    def finish(self) -> None:
        """After the last step (and its evaluation and checkpoint)."""

    @contextlib.contextmanager
    def states_resident(self) -> Iterator[None]:
        """The learner's states where a checkpoint save can read them."""
        yield

    def before_generate(self) -> None:
        """Rank 0, before the step's prompts go out."""

    def after_generate(self) -> None:
        """Once the step trains (rank 0 before the rollout broadcast: the other ranks wait there)."""

    def before_train(self) -> None:
        pass

    def after_train(self) -> None:
        pass

    def before_push(self) -> None:
        pass


@dataclass
class RunParts:
    """What a schedule drives; built once by ``learner.rl.run``."""

    cfg: PPOConfig
    trainer: Trainer
    weights: Weights
    driver: Driver | None  # rank 0 only
    device: torch.device
    total_steps: int
    turns: Turns = field(default_factory=Turns)


@dataclass
class StepTimes:
    """Seconds of one step, on rank 0."""

    wait_s: float  # getting the batch: generating and scoring (lockstep), waiting for the pump (async)
    train_s: float
    step_s: float


class Schedule(abc.ABC):
    kind: ClassVar[str]
    # Whether generation runs while the learner trains: then the step's generation time is the
    # whole step, and what the learner waited for its batch is a metric of its own.
    generation_overlaps: ClassVar[bool] = False

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self.cfg = parts.cfg
        self.driver = parts.driver
        self.turns = parts.turns
        self._first: tuple[int, float] | None = None  # (step, time) this process started stepping at

    @property
    def rank0_driver(self) -> Driver:
        """The driver, for the code that runs on rank 0 only (``next_batch``, the report)."""
        assert self.driver is not None, "rank 0 only: the other ranks have no driver"
        return self.driver

    @property
    def name(self) -> str:
        return self.turns.name or self.kind

    def start(self, version: int = 0) -> None:
        """Before the first step: every server starts from the learner's weights (``version``:
        0, or the resumed one, which servers that outlived the old learner may be past)."""
        self.turns.start()
        self.push_weights(version)
        self.turns.started()

    def finish(self) -> None:
        """After the last step (and its evaluation and checkpoint)."""
        self.turns.finish()

    def states_resident(self) -> contextlib.AbstractContextManager[None]:
        """The learner's states where a checkpoint save can read them (colocated turns may have
        parked them in host memory)."""
        return self.turns.states_resident()

    def push_weights(self, version: int) -> None:
        """One push, on every rank: the fleet (and the pool's policy version) then hold ``version``."""
        self.parts.weights.push(version)

    # ------------------------------------------------------------------ what a schedule supplies
    @abc.abstractmethod
    def next_batch(self, step: int) -> StepBatch:
        """Rank 0: the groups ``step`` trains on."""

    def step_metrics(self, step: int, rollout: Rollout, result: StepResult, times: StepTimes) -> dict[str, float]:
        """Rank 0, after the push: the schedule's own metrics, beside the trainer's."""
        return {}

    def data_path(self) -> contextlib.AbstractContextManager[Any]:
        """Rank 0: the controller, for reading while the step reports."""
        return contextlib.nullcontext()

    def train(self, rollout: Rollout, step: int) -> StepResult:
        """Every rank. Step ``step`` trains the weights pushed as version ``step - 1``: when every
        sample came from them the step is on-policy, and the trainer may take the old log-probs
        from its training forward (lockstep always; async when nothing lags, e.g. K = 0). The
        samples of that version are the ones the trainer's ``rollout/logprob_diff`` is taken over."""
        on_policy = all(s.policy_version == step - 1 for s in rollout.samples)
        return self.parts.trainer.step(rollout, on_policy=on_policy, version=step - 1)

    def abandon(self) -> None:  # noqa: B027 - a hook: nothing to release unless the schedule runs something
        """A step raised: release what the schedule runs beside the step (before the error goes up)."""

    def after_step(self, step: int) -> None:  # noqa: B027 - a hook: most schedules have nothing to do
        """Every rank, after a trained step's report."""

    def eval_collect(self) -> Any:
        """Rank 0: how an evaluation's prompts are collected now (None: ``Controller.collect``;
        the async schedule's pump owns the controller while it runs and collects them itself)."""
        return None

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> None:
        """Every rank, between steps: rank 0 evaluates the weights pushed as version ``step``
        (``Driver.evaluate``, through the same services; nothing of it is trained on) while the
        other ranks wait to learn it went well. A failed evaluation stops every rank, as a failed
        step does, instead of leaving them in the next step's collective."""
        if self.driver is not None:
            try:
                self.turns.before_generate()  # colocated: the engines wake (they stay awake for the next step)
                self.driver.evaluate(step, self.eval_collect())
            except BaseException:
                broadcast_int(0)  # release the other ranks before raising here
                try:
                    self.abandon()
                except Exception:  # the evaluation's own error is the one to raise
                    log.exception("releasing the schedule after a failed evaluation")
                raise
        if not broadcast_int(1):  # rank 0's 1: done (the other ranks' value is not read)
            raise StoppedByRank0(f"evaluation at step {step}: rank 0 (the controller) failed; its log has the error")

    # ------------------------------------------------------------------ the step
    def step(self, step: int) -> Decision:
        """One training step, on every rank."""
        try:
            return self._step(step)
        except BaseException:
            try:
                self.abandon()
            except Exception:  # the step's own error is the one to raise
                log.exception("releasing the schedule after a failed step")
            raise

    def _step(self, step: int) -> Decision:
        cfg, parts = self.cfg, self.parts
        t0 = time.time()
        if self._first is None:
            self._first = (step, t0)
        batch, decision = None, None
        if self.driver is not None:
            try:
                self.turns.before_generate()
                batch = self.next_batch(step)
            except BaseException:
                broadcast_decision(Decision.STOP)  # release the other ranks before raising here
                raise
            decision = Decision.TRAIN if len(batch.rollout) >= cfg.train.batch_size else Decision.SKIP
        decision = broadcast_decision(decision)
        if decision is Decision.STOP:
            raise StoppedByRank0(f"step {step}: rank 0 (the controller) failed; its log has the error")
        if decision is Decision.SKIP:
            if self.driver is not None:
                assert batch is not None  # rank 0 gathered it above
                self.driver.skipped(step, batch)
            return decision
        wait_s = time.time() - t0
        self.turns.after_generate()
        rollout = broadcast_rollout(
            batch.rollout if batch else None, cfg.rollout.n_samples_per_prompt, device=parts.device
        )
        rollout.samples = rollout.samples[: len(rollout) // cfg.train.batch_size * cfg.train.batch_size]
        self.turns.before_train()
        result = self.train(rollout, step)
        self.turns.after_train()
        train_s = time.time() - t0 - wait_s
        self.turns.before_push()
        self.push_weights(step)
        if self.driver is not None:
            assert batch is not None  # rank 0 gathered it above
            times = StepTimes(wait_s, train_s, time.time() - t0)
            self._report(step, batch, rollout, result, times)
        self.after_step(step)
        return decision

    def _report(self, step: int, batch: StepBatch, rollout: Rollout, result: StepResult, times: StepTimes) -> None:
        total = self.parts.total_steps
        timings = {
            # With generation overlapping training the step is generation's time; what the
            # learner waited is the schedule's metric (async: learner_idle_frac).
            "generate_s": times.step_s if self.generation_overlaps else times.wait_s,
            "train_s": times.train_s,
            "step_s": times.step_s,
            "eta_s": self.eta_s(step),
            "total_steps": total,
        }
        with self.data_path():
            metrics = {**result.metrics, **self.step_metrics(step, rollout, result, times)}
            self.rank0_driver.report(step, total, metrics, batch, n_trained=len(rollout), timings=timings)

    def eta_s(self, step: int) -> float:
        """Seconds left, from the steps this process ran (a resumed run's earlier steps are not its)."""
        first, t_first = self._first or (step, time.time())
        done = step - first + 1
        return (time.time() - t_first) / done * (self.parts.total_steps - step)
