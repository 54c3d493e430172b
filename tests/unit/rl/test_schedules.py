"""The lockstep schedule's one step, with stand-ins for the trainer, the weight push and rank
0's driver (a world of one: the broadcasts pass values through). What is checked is the
order of a step and the decision: train and push, skip, or stop every rank."""

from __future__ import annotations

import pytest
import torch

from common.config import build
from learner.controller.types import Rollout, ScoredSample
from learner.rl.config import PPOConfig
from learner.rl.driver import StepBatch
from learner.rl.policy_trainer import StepResult
from learner.rl.schedules import SCHEDULES, Decision, RunParts, StoppedByRank0
from learner.rl.schedules import base as base_module

G = 2


def _rollout(n_groups: int, version: int = 0) -> Rollout:
    return Rollout(
        [
            ScoredSample(g, j, [1], torch.tensor([2, 3]), torch.zeros(2), None, float(j), policy_version=version)
            for g in range(n_groups)
            for j in range(G)
        ],
        G,
    )


class Recorder:
    """Trainer, weight push and driver in one: every call lands in ``calls``."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.calls: list[tuple] = []
        self.versions: list[int | None] = []  # the version each train call named as lag 0

    # trainer
    def step(self, rollout, *, on_policy=False, version=None):
        self.calls.append(("train", len(rollout), on_policy))
        self.versions.append(version)
        return StepResult({"rollout/reward": 0.5}, torch.zeros(len(rollout), 2))

    # weight push
    def push(self, version):
        self.calls.append(("push", version))

    # driver
    def gather(self, step):
        got = self.batches.pop(0)
        if isinstance(got, BaseException):
            raise got
        self.calls.append(("gather", step))
        return StepBatch(got)

    def skipped(self, step, batch):
        self.calls.append(("skipped", step, len(batch.rollout)))

    def report(self, step, total_steps, metrics, batch, *, n_trained, timings):
        assert set(timings) == {"generate_s", "train_s", "step_s", "eta_s", "total_steps"}
        self.calls.append(("report", step, n_trained))

    def evaluate(self, step, collect=None):
        got = self.batches.pop(0) if self.batches else None
        if isinstance(got, BaseException):
            raise got
        self.calls.append(("evaluate", step, collect))


def _schedule(rec: Recorder, *, driver: bool = True, train_batch_size: int = 4):
    cfg = build(
        PPOConfig,
        pretrain="m",
        prompt_data="p",
        rollout_batch_size=4,
        n_samples_per_prompt=G,
        train_batch_size=train_batch_size,
        micro_train_batch_size=2,
    )
    parts = RunParts(cfg, rec, rec, rec if driver else None, torch.device("cpu"), total_steps=5)
    return SCHEDULES["lockstep"](parts)


def test_a_step_gathers_trains_a_whole_number_of_train_batches_pushes_then_reports():
    rec = Recorder([_rollout(3)])  # one group of 4 failed scoring: 6 samples, train batches of 4: 4 trained
    assert _schedule(rec).step(1) is Decision.TRAIN
    assert rec.calls == [("gather", 1), ("train", 4, True), ("push", 1), ("report", 1, 4)]


def test_a_sample_from_older_weights_makes_the_step_off_policy():
    """Step 3 trains weights v2; a sample of v1 means the learner must recompute old log-probs.
    The trainer is told v2 is the lag-0 version (its rollout/logprob_diff is taken over those)."""
    rollout = _rollout(2, version=2)
    rollout.samples[0].policy_version = 1
    rec = Recorder([rollout])
    _schedule(rec).step(3)
    assert ("train", 4, False) in rec.calls and rec.versions == [2]


def test_start_pushes_version_0_before_any_step():
    rec = Recorder([])
    _schedule(rec).start()
    assert rec.calls == [("push", 0)]


def test_too_few_samples_skip_the_update_and_keep_the_weights():
    rec = Recorder([_rollout(1)])  # 2 samples < one train batch of 4 (scoring failed for the rest)
    assert _schedule(rec).step(3) is Decision.SKIP
    assert rec.calls == [("gather", 3), ("skipped", 3, 2)]


def test_a_controller_failure_raises_on_rank_0():
    rec = Recorder([TimeoutError("collect: 3 of 3 prompts not done")])
    with pytest.raises(TimeoutError, match="not done"):
        _schedule(rec).step(1)
    assert rec.calls == []


def test_other_ranks_stop_with_an_error_when_rank_0_fails(monkeypatch):
    """Rank 0 broadcasts STOP before raising; a rank without a driver raises instead of
    waiting in the rollout broadcast that rank 0 will never enter."""
    monkeypatch.setattr(base_module, "broadcast_decision", lambda mine: Decision.STOP)
    rec = Recorder([])
    with pytest.raises(StoppedByRank0, match="step 2: rank 0"):
        _schedule(rec, driver=False).step(2)
    assert rec.calls == []


def test_an_evaluation_runs_on_rank_0_with_the_controllers_collect():
    rec = Recorder([])
    _schedule(rec).evaluate(4)
    assert rec.calls == [("evaluate", 4, None)]


def test_a_failed_evaluation_raises_on_rank_0_and_stops_the_other_ranks(monkeypatch):
    """Rank 0 says 0 (failed) before raising; the other ranks raise instead of going on to a
    step whose collectives rank 0 will never enter."""
    sent = []
    monkeypatch.setattr(base_module, "broadcast_int", lambda value: sent.append(value) or value)
    rec = Recorder([TimeoutError("collect: 2 of 4 prompts not done")])
    with pytest.raises(TimeoutError, match="not done"):
        _schedule(rec).evaluate(5)
    assert sent == [0]
    monkeypatch.setattr(base_module, "broadcast_int", lambda value: 0)  # what rank 0 said
    with pytest.raises(StoppedByRank0, match="evaluation at step 5: rank 0"):
        _schedule(Recorder([]), driver=False).evaluate(5)


def test_lockstep_resuming_an_async_checkpoint_says_it_does_not_reissue_its_pending_prompts(caplog):
    feed = {"next_position": 52, "pending": [37, 41, 50], "outstanding": 3, "counters": {"trained": 40}}
    with caplog.at_level("WARNING", logger="learner"):
        _schedule(Recorder([])).load_state_dict({"feed": feed})
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "--async_train checkpoint in lockstep" in msg and "position 52 with 3 prompt(s)" in msg
    caplog.clear()
    _schedule(Recorder([])).load_state_dict({})  # a lockstep checkpoint: nothing to say
    _schedule(Recorder([]), driver=False).load_state_dict({"feed": feed})  # rank 0 says it, once
    assert not caplog.records


def test_eta_counts_only_the_steps_this_process_ran(monkeypatch):
    """A run resumed at step 8 of 10 that took 4 s for step 8: 2 steps left, 8 s -- not 4 s x 2 / 8."""
    now = [100.0]
    monkeypatch.setattr(base_module.time, "time", lambda: now[0])
    rec = Recorder([_rollout(2)])
    sched = _schedule(rec)
    sched.parts.total_steps = 10
    real_push = rec.push

    def slow_push(version):
        now[0] += 4.0  # the step takes 4 s
        real_push(version)

    rec.push = slow_push
    sched.step(8)
    assert sched.eta_s(8) == 8.0
