"""The ``extra_logs`` a reward function or an agent returns reach every metrics sink as their
means over the step's samples: ``reward/<name>`` and ``agent/<name>`` (OpenRLHF logs them too).

From the wire batches the controller joins (``scored_samples``) through the step's data-path
metrics (``run_metrics``, which ``Driver.report`` writes) into one ``MetricsWriter`` with its
three sinks: metrics.jsonl, TensorBoard and a stand-in for the wandb sink (it receives each
record whole, as ``WandbSink.log`` does). No service runs.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from common import protocol as P
from learner.controller.controller import AGENT_SCORER, scored_samples
from learner.controller.ledger import Entry
from learner.controller.types import PromptItem, Rollout
from learner.rl.driver import StepBatch
from learner.rl.metrics import extra_log_metrics, run_metrics
from learner.runtime.metrics import MetricsWriter

NAN = float("nan")


def _samples(pid: int, n: int, **agent) -> P.SampleBatch:
    lengths = [2] * n
    extra = {}
    if agent:  # agent episodes: their own prompt, a mask, and what the agent reported
        extra = dict(
            prompt_token_ids=[[1, 2]] * n,
            episodes=P.EpisodeOutputs(
                action_mask=torch.ones(2 * n, dtype=torch.uint8), rewards=[1.0] * n, turns=[2] * n, **agent
            ),
        )
    return P.SampleBatch(
        prompt_ids=[pid] * n,
        sample_indices=list(range(n)),
        response_lengths=lengths,
        response_ids=torch.arange(2 * n, dtype=torch.int32),
        logprobs=torch.zeros(2 * n),
        finish_reasons=["stop"] * n,
        policy_versions=[0] * n,
        **extra,
    )


def _entry(pid: int, sb: P.SampleBatch, logs: dict, server: str = "reward-0") -> Entry:
    n = len(sb)
    scores = P.ScoredBatch(
        prompt_ids=[pid] * n, sample_indices=list(range(n)), rewards=torch.ones(n), extra_logs=logs, server=server
    )
    return Entry(prompt_id=pid, payload=PromptItem(tokens=[1, 2]), samples=sb, scores=scores)


def _reward_function_rollout() -> Rollout:
    # Two prompts of two samples, scored by a reward function that logged (per sample):
    #   prompt 0: math/has_answer [1, 0], reward/func:a.py [0.5, 1.0] (the service's per-source reward)
    #   prompt 1: math/has_answer [1, 1], format [NaN, 1] (NaN: not logged for that sample)
    entries = [
        _entry(0, _samples(0, 2), {"math/has_answer": [1.0, 0.0], "reward/func:a.py": [0.5, 1.0]}),
        _entry(1, _samples(1, 2), {"math/has_answer": [1.0, 1.0], "format": [NAN, 1.0]}),
    ]
    return Rollout([s for e in entries for s in scored_samples(e)], group_size=2)


def _agent_rollout() -> Rollout:
    # One prompt, two episodes; the agent logged tries 2 and 1, and "turns" 5 on the first only
    # (a name rayless's own agent/turns already has). Scored by the agent itself: the scores
    # carry the same logs, which must not come back as reward/ metrics.
    logs = [{"tries": 2.0, "turns": 5.0}, {"tries": 1.0}]
    sb = _samples(7, 2, logs=logs)
    e = _entry(7, sb, {"tries": [2.0, 1.0], "turns": [5.0, NAN]}, server=AGENT_SCORER)
    return Rollout(scored_samples(e), group_size=2)


def test_means_by_hand():
    assert extra_log_metrics(_reward_function_rollout().samples) == {
        "reward/math/has_answer": 0.75,  # (1 + 0 + 1 + 1) / 4
        "reward/func:a.py": 0.75,  # (0.5 + 1.0) / 2: a name under its prefix stays as it is
        "reward/format": 1.0,  # 1 / 1: the NaN sample did not log it
    }
    assert extra_log_metrics(_agent_rollout().samples, taken={"agent/turns"}) == {
        "agent/tries": 1.5,  # (2 + 1) / 2
        "agent/extra/turns": 5.0,  # rayless's agent/turns is kept; the agent's is logged beside it
    }
    assert extra_log_metrics([]) == {}


class FakeWandb:
    """Stands in for ``learner.runtime.wandb_sink.WandbSink``: the records it was given."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def test_every_sink_gets_the_means(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    controller = SimpleNamespace(
        counters={"failed_episodes": 0},
        ledger=SimpleNamespace(counters={"reissued": 0, "duplicates": 0}),
        pool=SimpleNamespace(counters={"died": 0}, alive=lambda role: []),
    )
    wandb = FakeWandb()
    sink = MetricsWriter(tmp_path / "metrics.jsonl", tmp_path / "tb", wandb=wandb)
    timings = {"generate_s": 1.0, "train_s": 1.0, "step_s": 2.0, "eta_s": 0.0, "total_steps": 2}
    for step, rollout in ((1, _reward_function_rollout()), (2, _agent_rollout())):
        # as Driver.report writes a step: the trainer's metrics, then the data path's
        sink.write(step, {"rollout/reward": 1.0, **run_metrics(controller, StepBatch(rollout), len(rollout), timings)})
    sink.close()

    want = {
        1: {"reward/math/has_answer": 0.75, "reward/func:a.py": 0.75, "reward/format": 1.0},
        2: {"agent/tries": 1.5, "agent/extra/turns": 5.0, "agent/turns": 2.0},
    }
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {k: r[k] for k in want[r["step"]]} == want[r["step"]]
    assert not any(k.startswith("reward/") for k in records[1])  # the agent's logs, once, as agent/
    assert [{k: w[k] for k in want[w["step"]]} for w in wandb.records] == [want[1], want[2]]
    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    for step, metrics in want.items():
        for k, v in metrics.items():
            (event,) = tb.Scalars(k)
            assert event.step == step and math.isclose(event.value, v, rel_tol=1e-6), k


@pytest.mark.parametrize("length", [1, 3])
def test_a_log_of_the_wrong_length_is_left_out_not_a_crash(length):
    """A reward service's extra_logs list that does not match its rows (a bug there) is not
    read at all: the other names still are."""
    e = _entry(0, _samples(0, 2), {"ok": [1.0, 0.0], "bad": [1.0] * length})
    assert extra_log_metrics(scored_samples(e)) == {"reward/ok": 0.5}
