"""Rank 0's side of an RL run: the controller, the prompt stream, evaluation and reporting.

A schedule holds a ``Driver`` on rank 0 and ``None`` on every other rank, so "only the
controller does this" is one ``if self.driver`` instead of a rank check per line. The driver
never touches torch.distributed: collectives belong to the schedule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from learner.controller.controller import Controller
from learner.controller.types import CollectResult, Rollout
from learner.rl.config import PPOConfig
from learner.rl.evaluation import EvalHistory, Evaluator, best_metric_key, sample_rows
from learner.rl.filtering import filter_and_refill
from learner.rl.metrics import log_step, run_metrics
from learner.rl.prompts import PromptStream, fingerprint
from learner.runtime.metrics import MetricsWriter

log = logging.getLogger("learner")

SAMPLES_PER_LOG = 4  # --log_samples_steps: how many samples (one per prompt) each log shows

# How an evaluation's prompts are generated and scored: ``Controller.collect`` between steps, or
# the async schedule's pump (``learner.rl.schedules.async_``) while its feed runs.
Collect = Callable[..., CollectResult]


@dataclass
class StepBatch:
    """What rank 0 gathered for one step."""

    rollout: Rollout  # the groups to train on (after dynamic filtering)
    failed_groups: int = 0  # groups dropped since the last step because their scoring failed
    generated_tokens: int = 0  # response tokens generated for the step (filtered groups included)
    filter_stats: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, collected: CollectResult, rollout: Rollout | None = None, **kw: Any) -> StepBatch:
        """A step's batch from its collect; ``rollout``: what is left of it to train on."""
        tokens = sum(len(s.response) for s in collected.rollout.samples)
        return cls(collected.rollout if rollout is None else rollout, collected.failed_groups, tokens, **kw)


class Driver:
    def __init__(
        self,
        cfg: PPOConfig,
        controller: Controller,
        prompts: PromptStream,
        sink: MetricsWriter,
        *,
        evaluator: Evaluator | None = None,
        decode: Callable[[list[list[int]]], list[str]] | None = None,
    ) -> None:
        """``evaluator``: the --eval_dataset prompts (None: no evaluation); ``decode``: token ids
        to text, for the samples log (--log_samples_steps)."""
        self.cfg = cfg
        self.controller = controller
        self.prompts = prompts
        self.sink = sink
        self.evaluator = evaluator
        self.decode = decode
        self.history = EvalHistory(best_metric_key(cfg.ckpt.best_metric_key) if evaluator is not None else None)
        self.timeout_s = cfg.services.generate_timeout_s + cfg.services.score_timeout_s

    def wait_for_services(self) -> None:
        from learner.rl.build import check_reward_sources

        c, cfg = self.controller, self.cfg
        log.info(
            "controller listening on %s; waiting for %d rollout server(s) and %d reward service(s)",
            c.endpoint.address,
            cfg.services.min_rollout_servers,
            cfg.services.min_reward_services,
        )
        c.wait_for_services(
            cfg.services.min_rollout_servers, cfg.services.min_reward_services, cfg.services.wait_for_services_s
        )
        check_reward_sources(cfg, c.pool.alive("reward"))

    def gather(self, step: int) -> StepBatch:
        """Generates and scores ``step``'s prompts; with --dynamic_filtering, refills."""
        res = self.controller.collect(self.prompts.batch(step), timeout_s=self.timeout_s)
        if not self.cfg.algo.dynamic_filtering_enable:
            return StepBatch.of(res)
        rollout, stats = filter_and_refill(self.controller, self.cfg, res.rollout, self.prompts.refills(step))
        return StepBatch.of(res, rollout, filter_stats=stats)

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's part of a checkpoint (``learner.rl.checkpoint``): JSON-able values only. The
        evaluations' scores rank the checkpoints (--best_metric_key); the metrics writer (and
        the tracked run's id) is a checkpoint part of its own."""
        return {"prompts": self.prompts.state_dict(), "eval": self.history.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.history.load_state_dict(state.get("eval", {}))

    def skipped(self, step: int, batch: StepBatch) -> None:
        log.warning("step %d: too few scored samples to train (%d); skipping", step, len(batch.rollout))
        if self.cfg.algo.dynamic_filtering_enable:
            self.sink.write(step, {**batch.filter_stats, "step_skipped": 1})

    def report(
        self,
        step: int,
        total_steps: int,
        metrics: dict[str, Any],
        batch: StepBatch,
        *,
        n_trained: int,
        timings: dict[str, float],
    ) -> None:
        metrics.update(run_metrics(self.controller, batch, n_trained, timings))
        metrics.update(batch.filter_stats)
        # Which prompts this step trained on, as one number: a resumed run's must equal the
        # uninterrupted run's step for step (tests/e2e/test_e2e_resume.py).
        metrics["data/prompts_crc"] = fingerprint(s.prompt for s in batch.rollout.samples[:: batch.rollout.group_size])
        if batch.rollout.samples:  # the oldest weights that sampled this step (lockstep: step - 1)
            metrics["rollout/min_policy_version"] = min(s.policy_version for s in batch.rollout.samples)
        if step % self.cfg.logger.logging_steps == 0 or step == total_steps:
            self.sink.write(step, metrics)
            log_step(step, total_steps, metrics)
        if self._log_samples(step):
            g = batch.rollout.group_size
            picked = [("", s) for s in batch.rollout.samples[::g][:SAMPLES_PER_LOG]]
            self.sink.write_samples(step, sample_rows(picked, self.decode, split="train"))

    def _log_samples(self, step: int) -> bool:
        every = self.cfg.logger.log_samples_steps
        return bool(every) and self.decode is not None and step % every == 0

    def evaluate(self, step: int, collect: Collect | None = None) -> dict[str, float] | None:
        """Generates and scores the --eval_dataset prompts with the evaluation's sampling
        (``collect``: how, default ``Controller.collect``; never trained on) and writes their
        metrics (``learner.rl.evaluation``) at ``step``. None without evaluation data."""
        from learner.rl.build import RunError

        ev = self.evaluator
        if ev is None:
            return None
        t0 = time.time()
        res = (collect or self.controller.collect)(ev.items, sampling=ev.sampling, timeout_s=self.timeout_s)
        metrics = ev.measure(res)
        metrics["eval/time_s"] = time.time() - t0
        self.sink.write(step, metrics)
        if self.cfg.logger.log_samples_steps and self.decode is not None:
            self.sink.write_samples(step, ev.samples(res, self.decode, SAMPLES_PER_LOG))
        try:
            self.history.record(step, metrics)
        except ValueError as e:  # a --best_metric_key naming no metric: the user's to fix (the metrics are written)
            raise RunError(str(e)) from None
        log.info(
            "eval at step %d: accuracy %.3f (pass@1 over %d prompt(s) x %d), reward %.3f, %.1fs",
            step,
            metrics["eval/accuracy"],
            int(metrics.get("eval/prompts", 0)),
            ev.sampling.n,
            metrics.get("eval/reward", float("nan")),
            metrics["eval/time_s"],
        )
        return metrics

    def close(self, ok: bool) -> None:
        """Ends rank 0's side of the run. Once training finished, every service is told to exit.
        After a failure (this rank's, or a peer rank's that broke a collective) they are not:
        services outlive the learner, waiting ``--reconnect_timeout_s`` for a restarted one that
        resumes from a checkpoint (``launch.local --restart_learner``, launch/grpo_70b.slurm);
        a launcher that gives up on the learner ends them itself. With ``--keep_services`` they
        outlive a finished run too, for the next learner to join."""
        if ok and not self.cfg.services.keep_services:
            self.controller.shutdown_services("training finished")
        self.controller.endpoint.close()
        self.sink.close()
