"""Rank 0's side of an RL run: the controller, the prompt stream, evaluation and reporting.

A schedule holds a ``Driver`` on rank 0 and ``None`` on every other rank, so "only the
controller does this" is one ``if self.driver`` instead of a rank check per line. The driver
never touches torch.distributed: collectives belong to the schedule.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from common.protocol import SamplingParams
from learner.controller.controller import Controller
from learner.controller.types import CollectResult, PromptItem, Rollout
from learner.rl.config import PPOConfig
from learner.rl.filtering import filter_and_refill
from learner.rl.metrics import log_step, run_metrics
from learner.rl.prompts import PromptStream, fingerprint
from learner.runtime.metrics import MetricsWriter

log = logging.getLogger("learner")


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
        eval_items: list[PromptItem] = (),
        greedy: SamplingParams | None = None,
    ) -> None:
        self.cfg = cfg
        self.controller = controller
        self.prompts = prompts
        self.sink = sink
        self.eval_items = list(eval_items)
        self.greedy = greedy
        self.timeout_s = cfg.generate_timeout_s + cfg.score_timeout_s

    def wait_for_services(self) -> None:
        from learner.rl.build import check_reward_sources

        c, cfg = self.controller, self.cfg
        log.info(
            "controller listening on %s; waiting for %d rollout server(s) and %d reward service(s)",
            c.endpoint.address,
            cfg.min_rollout_servers,
            cfg.min_reward_services,
        )
        c.wait_for_services(cfg.min_rollout_servers, cfg.min_reward_services, cfg.wait_for_services_s)
        check_reward_sources(cfg, c.pool.alive("reward"))

    def gather(self, step: int) -> StepBatch:
        """Generates and scores ``step``'s prompts; with --dynamic_filtering, refills."""
        res = self.controller.collect(self.prompts.batch(step), timeout_s=self.timeout_s)
        if not self.cfg.dynamic_filtering:
            return StepBatch.of(res)
        rollout, stats = filter_and_refill(self.controller, self.cfg, res.rollout, self.prompts.refills(step))
        return StepBatch.of(res, rollout, filter_stats=stats)

    def state_dict(self) -> dict[str, Any]:
        """Rank 0's part of a checkpoint (``learner.rl.checkpoint``): JSON-able values only. The
        metrics writer's part is the tracked run's id, so that a resumed run continues it."""
        return {"prompts": self.prompts.state_dict(), "metrics": self.sink.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.sink.load_state_dict(state.get("metrics", {}))

    def skipped(self, step: int, batch: StepBatch) -> None:
        log.warning("step %d: too few scored samples to train (%d); skipping", step, len(batch.rollout))
        if self.cfg.dynamic_filtering:
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
        if step % self.cfg.logging_steps == 0 or step == total_steps:
            self.sink.write(step, metrics)
            log_step(step, total_steps, metrics)

    def evaluate(self, step: int, key: str) -> None:
        """Mean score (exact-match accuracy for rule rewards) of greedy answers to --eval_data;
        never trained on. Written as ``key`` at ``step``."""
        if not self.eval_items:
            return
        res = self.controller.collect(self.eval_items, sampling=self.greedy, timeout_s=self.timeout_s)
        r = res.rollout.rewards()
        acc = float(r.mean()) if len(r) else math.nan
        self.sink.write(step, {key: acc})
        log.info("%s %.3f on %d prompts", key, acc, len(self.eval_items))

    def close(self, ok: bool) -> None:
        """Ends rank 0's side of the run. Once training finished, every service is told to exit.
        After a failure (this rank's, or a peer rank's that broke a collective) they are not:
        services outlive the learner, waiting ``--reconnect_timeout_s`` for a restarted one that
        resumes from a checkpoint (``launch.local --restart_learner``, launch/grpo_70b.slurm);
        a launcher that gives up on the learner ends them itself."""
        if ok:
            self.controller.shutdown_services("training finished")
        self.controller.endpoint.close()
        self.sink.close()
