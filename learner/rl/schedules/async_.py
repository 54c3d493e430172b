"""Async (off-policy): generation never waits for training; staleness is bounded and corrected.

``--async_train``. The step is ``Schedule.step`` (``base.py``), as lockstep's; what differs is
where rank 0's batch comes from. Rank 0 runs a pump thread that owns the controller between steps: it
admits prompts under the staleness budget, routes samples to scoring and keeps scored groups
ready (``learner.controller.feed.OffPolicyFeed``, which documents the three places
``--max_staleness`` K is enforced). Every rank runs the same collectives in the same order as
lockstep: the decision broadcast, the rollout broadcast, the optimizer steps, the weight push.
Step ``s`` trains the weights pushed as version ``s - 1`` on a batch whose samples were started
by versions ``>= s - 1 - K``; the loss corrects the lag with ``--is_correction`` (default
``tis``: decoupled PPO, the proximal policy is the learner's own old log-probs, the behaviour
policy the sampler's).

Why a thread on rank 0 (and not pumping between micro-steps): the trainer stays unaware of
the schedule, and the data path keeps moving through the old log-prob pass and the optimizer
steps alike. The controller is single-threaded: only the pump thread touches it, except
inside ``hold()``, which parks the pump between two turns; the main thread holds it to abort
stale work and push weights (the push talks on the controller's socket), and to read
counters. Batches cross from the pump to the main thread through a one-slot queue. A push
uses pause mode "keep": in-flight requests continue on the new weights, so the generation
gap per push is the push itself.

Evaluation between steps (``--eval_steps``) goes through the pump too (``_Pump.collect_eval``):
its prompts join the feed tagged as evaluation's, while generation for training goes on within
the staleness budget; the main thread waits for them before the next step, so no push lands
while they generate and every evaluation sample comes from the weights just pushed. They never
reach a training batch and are accounted apart from the training prompts
(``OffPolicyFeed.add_eval``).

Checkpoints (``state_dict`` / ``load_state_dict``, called by ``learner.rl.checkpoint``): a
checkpoint is taken after step k's push, with generation for later steps under way. The
schedule saves the feed's place in the prompt stream: the next position and the positions of
the prompts drawn but neither trained nor dropped (ready groups, prompts in flight, aborted
ones), and its run-total counters. The resumed run admits those prompts again first (their
samples are generated anew by the resumed weights) and then goes on from the next position,
so no prompt is skipped or trained twice (``OffPolicyFeed.restore``).

Differences from AReaL's async PPO: the same bound and admission rule, but groups are
dropped whole, aborts happen only at pushes, and weights are pushed after every step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import Counter
from typing import Any

import torch

from learner.controller.feed import OffPolicyFeed
from learner.controller.types import Rollout
from learner.rl.driver import StepBatch
from learner.rl.policy_trainer import StepResult
from learner.rl.schedules.base import RunParts, Schedule, StepTimes

log = logging.getLogger("learner")

# Test-only: seconds of sleep added to every training step, to make the learner the slow side.
SLOW_LEARNER_ENV = "RAYLESS_TEST_SLOW_LEARNER_S"


class _Pump(threading.Thread):
    """Rank 0's data path while the learner trains. See the module docstring."""

    def __init__(self, feed: OffPolicyFeed) -> None:
        super().__init__(name="async-pump", daemon=True)
        self.feed = feed
        self._lock = threading.Lock()
        self._holders = 0  # main-thread hold() requests waiting: the pump lets them in
        self._stop_evt = threading.Event()
        self._want: int | None = None  # train version the main thread waits for a batch of
        self.batches: queue.Queue[list[Any]] = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()

    def run(self) -> None:
        try:
            while not self._stop_evt.is_set():
                if self._holders:
                    time.sleep(0.001)  # Lock is not fair: step aside so hold() gets in
                    continue
                with self._lock:
                    n_ready = len(self.feed.ready)
                    self.feed.pump(0.02)
                    if len(self.feed.ready) != n_ready:
                        self.last_progress = time.monotonic()
                    if self._want is not None:
                        batch = self.feed.take_batch(self._want)
                        if batch is not None:
                            self._want = None
                            self.batches.put(batch)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            self.error = e

    @contextlib.contextmanager
    def hold(self):
        """The feed (and its controller) for the main thread, the pump parked meanwhile."""
        self._holders += 1
        try:
            with self._lock:
                yield self.feed
        finally:
            self._holders -= 1

    def next_batch(self, train_version: int, timeout_s: float) -> list[Any]:
        with self.hold():
            self._want = train_version
            self.last_progress = time.monotonic()
        while True:
            try:
                return self.batches.get(timeout=0.1)
            except queue.Empty:
                pass
            if self.error is not None:
                raise RuntimeError(f"the async data path failed: {self.error!r}") from self.error
            if not self.is_alive():
                raise RuntimeError("the async data path stopped")
            if time.monotonic() - self.last_progress > timeout_s:
                with self.hold() as feed:
                    c = feed.controller
                    raise TimeoutError(
                        f"async: no scored group for {timeout_s:.0f} s while waiting for a batch for v{train_version} "
                        f"({len(feed.ready)} ready, {len(feed.in_flight)} in flight, counters {feed.counters}); "
                        f"rollout servers alive: {[p.name for p in c.pool.alive('rollout')]}, "
                        f"reward services alive: {[p.name for p in c.pool.alive('reward')]}"
                    )

    def collect_eval(self, items: list[Any], *, sampling: Any, timeout_s: float) -> Any:
        """An evaluation while the pump runs: its prompts go through the feed, tagged as
        evaluation's (never a training group, outside the staleness budget and the training
        accounting), and this waits until every one is scored; the pump keeps generating for
        training meanwhile. Raises TimeoutError naming what is missing (its prompts are aborted)."""
        with self.hold() as feed:
            ids = feed.add_eval(items, sampling)
        deadline = time.monotonic() + timeout_s
        while True:
            with self.hold() as feed:
                done = feed.take_eval(ids, sampling.n)
                if done is not None:
                    return done
                if time.monotonic() > deadline:
                    waiting = feed.eval_waiting(ids)
                    feed.abort_eval("evaluation timed out")
                    c = feed.controller
                    raise TimeoutError(
                        f"async evaluation: {waiting} of {len(ids)} prompt(s) not scored after {timeout_s:.0f} s; "
                        f"rollout servers alive: {[p.name for p in c.pool.alive('rollout')]}, "
                        f"reward services alive: {[p.name for p in c.pool.alive('reward')]}"
                    )
            if self.error is not None:
                raise RuntimeError(f"the async data path failed: {self.error!r}") from self.error
            if not self.is_alive():
                raise RuntimeError("the async data path stopped")
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop_evt.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=10)


def _lag_metrics(samples: list[Any], train_version: int, k: int, old_lp: torch.Tensor) -> dict[str, float]:
    """Lag histogram of the trained samples and behaviour KL (sampler vs learner old log-probs,
    ``mean_t log pi_rollout - log pi_old``, the k1 estimate of KL(behaviour || proximal)) by lag."""
    lags = [train_version - s.policy_version for s in samples]
    hist = Counter(lags)
    out: dict[str, float] = {f"async/lag_{i}": float(hist.get(i, 0)) for i in range(k + 1)}
    out["async/max_lag"] = float(max(lags))
    out["async/min_version"] = float(min(s.policy_version for s in samples))
    out["async/train_version"] = float(train_version)
    if old_lp.shape[0] == len(samples):
        sums: dict[int, list[float]] = {}
        for i, (s, lag) in enumerate(zip(samples, lags, strict=True)):
            t = len(s.response)
            if t:
                d = s.rollout_logprobs[:t].float() - old_lp[i, :t].float().cpu()
                acc = sums.setdefault(lag, [0.0, 0.0])
                acc[0] += float(d.sum())
                acc[1] += t
        for lag, (total, n) in sums.items():
            out[f"async/behaviour_kl_lag_{lag}"] = total / max(n, 1)
    return out


class AsyncSchedule(Schedule):
    kind = "async"
    generation_overlaps = True

    def __init__(self, parts: RunParts) -> None:
        super().__init__(parts)
        self.pump: _Pump | None = None
        self.slow_s = float(os.environ.get(SLOW_LEARNER_ENV, "0") or 0)
        self._last_report = time.monotonic()
        self._last_idle = 0.0
        self._failed_before = 0  # groups dropped for failed scoring by the previous step
        self._feed_state: dict[str, Any] | None = None  # from a checkpoint, or the last feed's at its end

    # ------------------------------------------------------------------ rank 0's data path
    def _start_pump(self, first_step: int) -> _Pump:
        cfg, driver = self.cfg, self.rank0_driver
        keep = None
        if cfg.algo.dynamic_filtering_enable:
            from learner.algorithms.shaping import dynamic_filter_mask
            from learner.rl.filtering import filter_reward_range

            reward_range = filter_reward_range(cfg)

            def keep(samples):
                rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
                return bool(dynamic_filter_mask(rewards, len(samples), reward_range)[0])

        B = cfg.rollout.batch_size
        # Where the run stands in the prompt stream: the checkpoint's feed state, or (a fresh
        # run, or a resume from a checkpoint without one) the state of a run that trained steps
        # 1..first_step-1 with nothing pending, as lockstep leaves it.
        state = self._feed_state or {
            "next_position": (first_step - 1) * B,
            "pending": [],
            "counters": {"admitted": (first_step - 1) * B, "trained": (first_step - 1) * B},
        }
        trained = int(state.get("counters", {}).get("trained", 0))
        if trained != (first_step - 1) * B:
            raise RuntimeError(
                f"async checkpoint state: {trained} group(s) trained, but step {first_step} follows "
                f"{first_step - 1} step(s) of {B}"
            )
        feed = OffPolicyFeed(
            driver.controller,
            driver.prompts.stream(int(state["next_position"])),
            batch_groups=B,
            max_staleness=cfg.train.max_staleness,
            total_groups=self.parts.total_steps * B,  # a run total, as the restored counters are
            keep_group=keep,
            first_position=int(state["next_position"]),
        )
        if first_step > 1:
            feed.restore(state, driver.prompts.at)
        self._failed_before = feed.counters["dropped_failed"]  # run totals: a resumed feed's include the old run's
        self.pump = pump = _Pump(feed)
        pump.start()
        self._last_report = time.monotonic()
        return pump

    def _stop_pump(self) -> dict[str, int]:
        if self.pump is None:
            return {}
        pump, self.pump = self.pump, None
        pump.stop()
        self._feed_state = pump.feed.state_dict()  # a checkpoint after the last step saves it
        return pump.feed.close()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Rank 0's part of a checkpoint taken after a step's push (JSON-able): the feed's state
        (``OffPolicyFeed.state_dict``), read with the pump parked."""
        if self.pump is not None:
            with self.pump.hold() as feed:
                return {"feed": feed.state_dict()}
        return {"feed": self._feed_state} if self._feed_state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before the first step of a resumed run: the feed starts from this state."""
        self._feed_state = state.get("feed")

    def push_weights(self, version: int) -> None:
        if self.pump is None:
            return super().push_weights(version)
        t0 = time.monotonic()
        with self.pump.hold() as feed:
            t1 = time.monotonic()
            feed.abort_stale(next_train_version=version)
            t2 = time.monotonic()
            super().push_weights(version)
        if t2 - t0 > 1.0:  # the data path held the push up: say where
            log.warning(
                "push of v%d: %.2f s to park the data path, %.2f s to abort stale groups", version, t1 - t0, t2 - t1
            )

    # ------------------------------------------------------------------ the step
    def next_batch(self, step: int) -> StepBatch:
        cfg = self.cfg
        pump = self.pump if self.pump is not None else self._start_pump(step)
        groups = pump.next_batch(step - 1, cfg.services.generate_timeout_s + cfg.services.score_timeout_s)
        # Which prompts each step trains, by stream position: what an audit of a resumed run
        # (nothing skipped, nothing twice) reads; ranges keep the line short.
        log.info("step %d trains stream positions %s", step, _ranges(g.position for g in groups))
        with pump.hold() as feed:
            failed = feed.counters["dropped_failed"]
        rollout = Rollout([s for g in groups for s in g.samples], cfg.rollout.n_samples_per_prompt)
        batch = StepBatch(rollout, failed - self._failed_before, sum(len(s.response) for s in rollout.samples))
        self._failed_before = failed
        return batch

    def train(self, rollout: Rollout, step: int) -> StepResult:
        result = super().train(rollout, step)
        if self.slow_s:
            time.sleep(self.slow_s)
        return result

    def abandon(self) -> None:
        self._stop_pump()  # the controller's socket is the main thread's again (driver.close)

    def after_step(self, step: int) -> None:
        if step == self.parts.total_steps and self.driver is not None:
            self._stop_pump()

    def eval_collect(self) -> Any:
        """While the pump runs it owns the controller: an evaluation goes through its feed."""
        return self.pump.collect_eval if self.pump is not None else None

    def data_path(self) -> contextlib.AbstractContextManager[Any]:
        # run_metrics reads the pool and the ledger, which the pump thread changes
        return self.pump.hold() if self.pump is not None else contextlib.nullcontext()

    def step_metrics(self, step: int, rollout: Rollout, result: StepResult, times: StepTimes) -> dict[str, float]:
        """Called inside ``data_path()``: the pump is parked."""
        assert self.pump is not None, "the step's report comes before after_step stops the pump"
        cfg, feed = self.cfg, self.pump.feed
        now = time.monotonic()
        counters = dict(feed.counters)
        idle = feed.rollout_idle_s
        feed.check_accounting()
        span = max(now - self._last_report, 1e-6)
        metrics = _lag_metrics(rollout.samples, step - 1, cfg.train.max_staleness, result.old_logprobs)
        metrics.update(
            {
                "async/dropped_stale": counters["dropped_stale"],
                "async/dropped_failed": counters["dropped_failed"],
                "async/aborted": counters["aborted"],
                "async/admitted": counters["admitted"],
                "async/trained_groups": counters["trained"],
                "async/outstanding": feed.outstanding(),
                "async/outstanding_max": feed.outstanding_max,
                "async/learner_idle_frac": times.wait_s / max(times.step_s, 1e-6),
                "async/rollout_idle_frac": min(1.0, (idle - self._last_idle) / span),
                "async/is_truncated_frac": result.metrics.get("policy/is_filter_frac", 0.0),
            }
        )
        if cfg.algo.dynamic_filtering_enable:
            metrics["filter/groups_filtered"] = counters["dropped_filtered"]
        self._last_report, self._last_idle = now, idle
        return metrics


def _ranges(positions) -> str:
    """[3, 4, 5, 9] -> "3-5,9"."""
    out: list[str] = []
    run: list[int] = []
    for p in sorted(positions):
        if run and p == run[-1] + 1:
            run.append(p)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [p]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
