"""AsyncSchedule end to end in one process: the real controller, feed and pump thread over fake
services, a fake trainer that takes its time. The lag of every trained sample stays within
--max_staleness, the overlap is real (most samples lag exactly K = 1), nothing is lost."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

from common import protocol as P
from common.config import build
from common.transport import Endpoint
from helpers.async_fakes import FakeReward, FakeRollout
from learner.controller.controller import Controller
from learner.controller.ledger import PromptLedger
from learner.controller.pool import ServicePool
from learner.controller.rollout_client import RolloutClient
from learner.controller.types import PromptItem
from learner.rl.config import PPOConfig
from learner.rl.driver import Driver
from learner.rl.evaluation import Evaluator, eval_due
from learner.rl.policy_trainer import StepResult
from learner.rl.prompts import PromptStream
from learner.rl.schedules import SCHEDULES, RunParts

B, G = 4, 2


class Sink:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, step, metrics) -> None:
        self.rows.append({"step": step, **metrics})

    def close(self) -> None:
        pass


class SlowTrainer:
    """Records what it trained on; 'old log-probs' equal the rollout's, so behaviour KL is 0."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.trained: list[list] = []
        self.on_policy: list[bool] = []

    def step(self, rollout, *, on_policy=False, version=None):
        time.sleep(self.seconds)
        self.trained.append(list(rollout.samples))
        self.on_policy.append(on_policy)
        T = max(len(s.response) for s in rollout.samples)
        old = torch.stack(
            [torch.nn.functional.pad(s.rollout_logprobs, (0, T - len(s.response))) for s in rollout.samples]
        )
        metrics = {
            "rollout/reward": 0.0,
            "rollout/logprob_diff": 0.0,
            "policy/kl_to_ref": 0.0,
            "policy/is_filter_frac": 0.0,
        }
        return StepResult(metrics, old)


class Weights:
    """A push without weights: the fleet's version (the pool's) moves, as a real push moves it."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.pushed: list[int] = []

    def push(self, version: int) -> None:
        self.pool.weights_pushed(version, [])
        self.pushed.append(version)


@contextlib.contextmanager
def controller_and_services():
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    pool = ServicePool(ep, peer_timeout_s=5.0, needs_preparation=())
    ledger = PromptLedger(generate_timeout_s=30, score_timeout_s=30)
    c = Controller(RolloutClient(ep, pool), ledger, sampling=P.SamplingParams(n=G, max_new_tokens=2))
    services = [FakeRollout(ep.address, delay=0.02), FakeReward(ep.address)]
    for s in services:
        s.start()
    try:
        c.wait_for_services(1, 1, timeout_s=10)
        yield c, services
    finally:
        for s in services:
            s.stop.set()
        ep.close(0)


@pytest.fixture
def setup():
    with controller_and_services() as got:
        yield got


def run_schedule(c, *, k: int, steps: int, train_s: float):
    cfg = build(
        PPOConfig,
        pretrain="m",
        prompt_data="p",
        rollout_batch_size=B,
        n_samples_per_prompt=G,
        train_batch_size=B * G,
        micro_train_batch_size=B * G,
        async_train=True,
        max_staleness=k,
        generate_timeout_s=20,
        score_timeout_s=20,
    )
    its = [PromptItem(tokens=[100 + i, 7], text=f"p{i}") for i in range(B * steps)]
    sink = Sink()
    driver = Driver(cfg, c, PromptStream(its, B), sink)
    trainer, weights = SlowTrainer(train_s), Weights(c.pool)
    sched = SCHEDULES["async"](RunParts(cfg, trainer, weights, driver, torch.device("cpu"), steps))
    sched.start()
    for step in range(1, steps + 1):
        sched.step(step)
    return cfg, sched, trainer, weights, sink


def test_slow_learner_k1_every_sample_within_the_bound_most_at_lag_one(setup):
    c, _ = setup
    steps = 6
    cfg, sched, trainer, weights, sink = run_schedule(c, k=1, steps=steps, train_s=0.3)
    assert weights.pushed == list(range(steps + 1))
    lags = [step - 1 - s.policy_version for step, batch in enumerate(trainer.trained, 1) for s in batch]
    assert len(lags) == steps * B * G and min(lags) >= 0 and max(lags) <= 1
    assert lags.count(1) / len(lags) >= 0.7, lags  # step 1 has nothing older; the rest overlap
    prompts = [s.prompt[0] for batch in trainer.trained for s in batch[::G]]
    assert sorted(prompts) == [100 + i for i in range(B * steps)], "each prompt trained once"
    rows = sink.rows
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    last = rows[-1]
    assert last["async/dropped_stale"] == 0 and last["async/trained_groups"] == steps * B
    assert last["async/admitted"] == steps * B  # nothing generated beyond what the run needs
    assert rows[2]["async/lag_1"] == B * G and rows[2]["async/behaviour_kl_lag_1"] == 0.0
    # The learner is the slow side: it hardly waits, the rollout server idles.
    assert sum(r["async/learner_idle_frac"] for r in rows[1:]) / (steps - 1) < 0.3
    assert rows[-2]["async/rollout_idle_frac"] > 0.5
    assert sched.pump is None  # stopped after the last step: the controller is the main thread's again


def test_k0_trains_lockstep_batches_at_lag_zero(setup):
    c, _ = setup
    steps = 3
    _, _, trainer, _, sink = run_schedule(c, k=0, steps=steps, train_s=0.1)
    for step, batch in enumerate(trainer.trained, 1):
        assert {s.policy_version for s in batch} == {step - 1}
        assert sorted({s.prompt[0] for s in batch}) == [100 + (step - 1) * B + i for i in range(B)]
    assert sink.rows[-1]["async/admitted"] == steps * B
    # Nothing lags, so the trainer is told what lockstep tells it: the step is on-policy (it may
    # take the old log-probs from its training forward instead of a pass of their own).
    assert trainer.on_policy == [True] * steps


def test_k1_steps_with_lagging_samples_are_off_policy(setup):
    c, _ = setup
    _, _, trainer, _, _ = run_schedule(c, k=1, steps=4, train_s=0.3)
    for step, (batch, on_policy) in enumerate(zip(trainer.trained, trainer.on_policy, strict=True), 1):
        assert on_policy == all(s.policy_version == step - 1 for s in batch)
    assert not all(trainer.on_policy[1:]), "the slow learner's batches lag: the old log-probs are recomputed"


def test_a_resumed_run_trains_every_prompt_once_across_the_restart(setup):
    """The checkpoint round trip of the async schedule, in one process: a run saves its state
    after step K_SAVE (as ``Checkpointer`` does, through JSON) with prompts in flight and groups
    ready, trains one step more and "dies"; a new schedule loads the state, pushes the saved
    version and runs to the end. The killed run's steps 1..K_SAVE and the resumed run's steps
    together train every prompt of the run exactly once (what the killed run trained after the
    save is done again, and nothing it had pending is lost)."""
    c, _ = setup
    steps, k_save = 6, 3
    cfg = build(PPOConfig, 
        pretrain="m", prompt_data="p", rollout_batch_size=B, n_samples_per_prompt=G,
        train_batch_size=B * G, micro_train_batch_size=B * G, async_train=True, max_staleness=1,
        generate_timeout_s=20, score_timeout_s=20,
    )  # fmt: skip
    its = [PromptItem(tokens=[100 + i, 7], text=f"p{i}") for i in range(B * steps)]

    def schedule(trainer, c):
        driver = Driver(cfg, c, PromptStream(its, B), Sink())
        return SCHEDULES["async"](RunParts(cfg, trainer, Weights(c.pool), driver, torch.device("cpu"), steps))

    first = schedule(SlowTrainer(0.3), c)
    first.start()
    for step in range(1, k_save + 1):
        first.step(step)
    state = json.loads(json.dumps(first.state_dict()))
    first.step(k_save + 1)  # trained, then lost: the checkpoint is older
    first._stop_pump()  # the "kill": what the old learner had in flight dies with it

    feed = state["feed"]
    assert feed["counters"]["trained"] == k_save * B
    assert feed["pending"], "nothing was in flight or ready at the save: the test shows nothing"
    trained_before = [s.prompt[0] for batch in first.parts.trainer.trained[:k_save] for s in batch[::G]]
    assert sorted(trained_before + [100 + p for p in feed["pending"]]) == [
        100 + p for p in range(feed["next_position"])
    ]

    with controller_and_services() as (c2, _):  # the new learner's controller: prompt ids from 0 again
        resumed = schedule(SlowTrainer(0.05), c2)
        resumed.load_state_dict(state)
        resumed.push_weights(k_save)  # what run.py does on a resume, before any prompt
        for step in range(k_save + 1, steps + 1):
            resumed.step(step)
    trained_after = [s.prompt[0] for batch in resumed.parts.trainer.trained for s in batch[::G]]
    assert sorted(trained_before + trained_after) == [100 + i for i in range(B * steps)], "each prompt once"
    rows = resumed.driver.sink.rows
    assert [r["step"] for r in rows] == list(range(k_save + 1, steps + 1))
    # The counters are the run's: admission after the resume saw the groups trained before it.
    assert rows[-1]["async/trained_groups"] == steps * B
    assert rows[-1]["async/outstanding_max"] <= (cfg.train.max_staleness + 1) * B
    lags = [step - 1 - s.policy_version for step, b in enumerate(resumed.parts.trainer.trained, k_save + 1) for s in b]
    assert min(lags) >= 0 and max(lags) <= cfg.train.max_staleness


@pytest.mark.parametrize("kind", ["lockstep", "async"])
def test_evaluations_between_steps_are_never_trained_on_and_keep_the_accounting(setup, kind):
    """--eval_steps 2 over 6 steps: evaluations at 0, 2, 4 and 6 through the same fake services
    with their own sampling (3 samples per prompt, not G), each answered by the weights just
    pushed, and no evaluation prompt in any trained batch. Async: those at 2 and 4 go through the
    running pump (the feed, tagged), and the training accounting stays exact around them, the
    evaluation's kept apart."""
    c, _ = setup
    steps, async_train = 6, kind == "async"
    cfg = build(PPOConfig, 
        pretrain="m", prompt_data="p", rollout_batch_size=B, n_samples_per_prompt=G,
        train_batch_size=B * G, micro_train_batch_size=B * G, async_train=async_train,
        eval_dataset="e", eval_steps=2, eval_n_samples_per_prompt=3, generate_timeout_s=20, score_timeout_s=20,
    )  # fmt: skip
    its = [PromptItem(tokens=[100 + i, 7], text=f"p{i}") for i in range(B * steps)]
    evals = [PromptItem(tokens=[900 + i, 7], text=f"e{i}", source="ab"[i % 2]) for i in range(4)]
    evaluator = Evaluator(evals, P.SamplingParams(n=3, max_new_tokens=2), threshold=0.5)
    sink = Sink()
    driver = Driver(cfg, c, PromptStream(its, B), sink, evaluator=evaluator)
    trainer = SlowTrainer(0.1)
    sched = SCHEDULES[kind](RunParts(cfg, trainer, Weights(c.pool), driver, torch.device("cpu"), steps))
    sched.start()
    sched.evaluate(0)
    through_pump, eval_counters = [], []
    for step in range(1, steps + 1):
        sched.step(step)
        if eval_due(step, steps, cfg.eval.steps):
            through_pump.append(sched.eval_collect() is not None)
            sched.evaluate(step)
            if getattr(sched, "pump", None) is not None:
                with sched.pump.hold() as feed:
                    feed.check_accounting()
                    eval_counters.append(dict(feed.eval_counters))
    rows = [r for r in sink.rows if "eval/accuracy" in r]
    assert [r["step"] for r in rows] == [0, 2, 4, 6]
    assert [r["eval/policy_version"] for r in rows] == [0, 2, 4, 6]  # the weights pushed just before
    for r in rows:  # FakeReward scores sample i with i: samples 1 and 2 of 3 pass 0.5, so each prompt passes at 3
        assert r["eval/accuracy"] == pytest.approx(2 / 3) and r["eval/pass@3"] == 1.0 and r["eval/reward"] == 1.0
        assert r["eval/a/prompts"] == 2 and r["eval/b/prompts"] == 2 and r["eval/failed_groups"] == 0
    trained = [s.prompt[0] for batch in trainer.trained for s in batch[::G]]
    assert sorted(trained) == [100 + i for i in range(B * steps)], "each training prompt once, no evaluation prompt"
    assert all(len(batch) == B * G for batch in trainer.trained)
    if async_train:
        assert through_pump == [True, True, False]  # the pump stops after the last step
        assert eval_counters == [
            {"admitted": 4, "returned": 4, "aborted": 0},
            {"admitted": 8, "returned": 8, "aborted": 0},
        ]
        step_rows = [r for r in sink.rows if "async/admitted" in r]
        assert step_rows[-1]["async/admitted"] == steps * B  # evaluation took no training admission
        assert max(r["async/outstanding_max"] for r in step_rows) <= (cfg.train.max_staleness + 1) * B
    else:
        assert through_pump == [False, False, False]
