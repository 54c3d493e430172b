"""Evaluation during RL (learner.rl.evaluation): the metrics computed by hand on a few samples,
the steps that evaluate, the best-checkpoint metric and its history. Evaluation through the
services between the steps of both schedules: tests/unit/rl/test_async_schedule.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from common.protocol import SamplingParams
from learner.controller.types import CollectResult, PromptItem, Rollout, ScoredSample
from learner.rl.evaluation import (
    EvalHistory,
    Evaluator,
    best_metric_key,
    eval_due,
    eval_metrics,
    metric_name,
    scores_in,
)


def _s(reward: float, length: int = 2, finish: str = "stop", version: int = 0) -> ScoredSample:
    return ScoredSample(0, 0, [1], torch.full((length,), 5), torch.zeros(length), None, reward, finish, version)


def test_metrics_per_source_and_overall_by_hand():
    """Two sources, n = 2, threshold 0.5.
    math:  p0 rewards (1, 0), p1 (0, 0)             -> pass@1 1/4, pass@2 1/2, reward 1/4
    code:  p2 rewards (1, 1), lengths 3 and 5, one cut at the length limit
                                                     -> pass@1 1, pass@2 1, length 4, truncated 1/2
    all:   6 samples, 3 pass                          -> accuracy 1/2, pass@2 2/3 (2 of 3 prompts)"""
    groups = [
        ("math", [_s(1.0), _s(0.0)]),
        ("math", [_s(0.0), _s(0.0)]),
        ("code", [_s(1.0, 3), _s(1.0, 5, "length")]),
    ]
    m = eval_metrics(groups, threshold=0.5, failed_groups=1)
    assert m["eval/math/pass@1"] == 0.25 and m["eval/math/pass@2"] == 0.5 and m["eval/math/reward"] == 0.25
    assert m["eval/math/response_length"] == 2.0 and m["eval/math/truncated_frac"] == 0.0
    assert m["eval/math/prompts"] == 2.0
    assert m["eval/code/pass@1"] == 1.0 and m["eval/code/pass@2"] == 1.0
    assert m["eval/code/response_length"] == 4.0 and m["eval/code/truncated_frac"] == 0.5
    assert m["eval/accuracy"] == 0.5 and m["eval/pass@2"] == pytest.approx(2 / 3)
    assert m["eval/reward"] == pytest.approx(3 / 6) and m["eval/response_length"] == pytest.approx(16 / 6)
    assert m["eval/truncated_frac"] == pytest.approx(1 / 6) and m["eval/prompts"] == 3.0
    assert m["eval/failed_groups"] == 1.0
    assert "eval/pass@1" not in m  # the overall pass@1 is eval/accuracy


def test_a_reward_at_the_threshold_does_not_pass_and_one_sample_has_no_pass_at_n():
    m = eval_metrics([("default", [_s(0.5)]), ("default", [_s(0.7)])], threshold=0.5)
    assert m["eval/default/pass@1"] == 0.5 and m["eval/accuracy"] == 0.5
    assert [k for k in m if "pass@" in k] == ["eval/default/pass@1"]  # n = 1: no pass@n


def test_no_sample_at_all_is_nan_accuracy_not_an_error():
    m = eval_metrics([], threshold=0.5, failed_groups=3)
    assert math.isnan(m["eval/accuracy"]) and m["eval/prompts"] == 0.0 and m["eval/failed_groups"] == 3.0


def test_which_steps_evaluate():
    assert [s for s in range(13) if eval_due(s, 12, 5)] == [0, 5, 10, 12]
    assert [s for s in range(13) if eval_due(s, 12, -1)] == [0, 12]
    assert [s for s in range(11) if eval_due(s, 10, 5)] == [0, 5, 10]


def test_source_names_are_safe_metric_keys():
    assert metric_name("OpenRLHF/gsm8k test") == "OpenRLHF_gsm8k_test" and metric_name("///") == "default"


def test_best_metric_key_defaults_reads_openrlhf_names_and_can_be_off():
    assert best_metric_key("") == "eval/accuracy"
    assert best_metric_key("eval_default_pass1") == "eval/default/pass@1"
    assert best_metric_key("eval_math500_pass4") == "eval/math500/pass@4"
    assert best_metric_key("eval/code/reward") == "eval/code/reward"
    assert best_metric_key("none") is None


def test_history_keeps_scores_by_step_through_a_checkpoint_and_refuses_a_key_no_evaluation_has():
    h = EvalHistory("eval/accuracy")
    h.record(0, {"eval/accuracy": 0.1})
    h.record(5, {"eval/accuracy": float("nan")})  # nothing scored: not a score
    h.record(10, {"eval/accuracy": 0.4})
    state = {"driver": {"eval": h.state_dict()}}
    assert scores_in(state) == {0: 0.1, 10: 0.4}
    again = EvalHistory("eval/accuracy")
    again.load_state_dict(h.state_dict())
    assert again.scores == {0: 0.1, 10: 0.4}
    other = EvalHistory("eval/reward")
    other.load_state_dict(h.state_dict())  # another metric's scores rank nothing here
    assert other.scores == {}
    with pytest.raises(ValueError, match=r"--best_metric_key eval/typo: .*'eval/accuracy'"):
        EvalHistory("eval/typo").record(0, {"eval/accuracy": 0.1})


def test_evaluator_measures_a_collect_by_its_groups_sources_and_seeds_each_prompt_the_same_every_time():
    items = [PromptItem(tokens=[1], source="a"), PromptItem(tokens=[2], source="b")]
    ev = Evaluator(items, SamplingParams(n=2), threshold=0.5, seed=7)
    again = Evaluator(items, SamplingParams(n=2), threshold=0.5, seed=7)
    assert [it.seed for it in ev.items] == [it.seed for it in again.items] and ev.items[0].seed != ev.items[1].seed
    assert Evaluator(items, SamplingParams(n=2), threshold=0.5).items[0].seed is None
    entries = [SimpleNamespace(payload=it) for it in ev.items]
    samples = [_s(1.0, version=3), _s(0.0, version=3), _s(0.0, version=3), _s(0.0, version=3)]
    m = ev.measure(CollectResult(Rollout(samples, 2), entries))
    assert m["eval/a/pass@1"] == 0.5 and m["eval/b/pass@1"] == 0.0 and m["eval/accuracy"] == 0.25
    assert m["eval/policy_version"] == 3.0
    rows = ev.samples(CollectResult(Rollout(samples, 2), entries), lambda ids: [f"t{len(x)}" for x in ids], k=1)
    assert rows == [
        {
            "split": "eval",
            "source": "a",
            "prompt": "t1",
            "response": "t2",
            "reward": 1.0,
            "finish_reason": "stop",
            "policy_version": 3,
        }
    ]
