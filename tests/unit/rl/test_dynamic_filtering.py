"""DAPO dynamic filtering on rank 0 (learner.rl.filtering.filter_and_refill) with a scripted
controller: groups with all-equal rewards are dropped and refilled from more prompts."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from common.config import build
from learner.controller.types import Rollout, ScoredSample
from learner.rl.config import PPOConfig
from learner.rl.filtering import filter_and_refill

G = 2


def _rollout(group_rewards, start_id=0) -> Rollout:
    samples = [
        ScoredSample(start_id + g, j, [1], torch.tensor([2]), torch.zeros(1), None, r)
        for g, rs in enumerate(group_rewards)
        for j, r in enumerate(rs)
    ]
    return Rollout(samples, G)


class ScriptedController:
    """collect() returns the next scripted batch of groups; records what it was asked."""

    def __init__(self, batches) -> None:
        self.batches = list(batches)
        self.asked: list[int] = []

    def collect(self, items, *, timeout_s):
        self.asked.append(len(items))
        return SimpleNamespace(rollout=_rollout(self.batches.pop(0), start_id=100 * len(self.asked)))


def _cfg(**kw) -> PPOConfig:
    base = dict(
        pretrain="m",
        prompt_data="p",
        rollout_batch_size=3,
        n_samples_per_prompt=G,
        train_batch_size=2,
        micro_train_batch_size=1,
        dynamic_filtering=True,
        dynamic_filtering_max_collects=2,
    )
    return build(PPOConfig, **{**base, **kw})


def _more():
    counter = iter(range(10**6))
    return lambda k: [next(counter) for _ in range(k)]


def test_all_equal_groups_are_dropped_and_refilled_in_order():
    first = [[1, 1], [0, 1], [0, 0]]  # keeps group 1 only
    ctl = ScriptedController([[[1, 0], [1, 1], [0.5, 0.2]]])  # refill keeps groups 0 and 2
    ro, stats = filter_and_refill(ctl, _cfg(), _rollout(first), _more())
    assert ctl.asked == [3]  # one extra collect of a whole rollout batch
    assert [s.reward for s in ro.samples] == [0, 1, 1, 0, 0.5, 0.2]
    assert [s.prompt_id for s in ro.samples] == [1, 1, 100, 100, 102, 102]
    assert ro.group_size == G
    assert stats == {
        "filter/groups_seen": 6,
        "filter/groups_filtered": 3,
        "filter/groups_kept": 3,
        "filter/extra_collects": 1,
        "filter/kept_frac": 0.5,
    }


def test_nothing_filtered_means_no_extra_collect():
    ctl = ScriptedController([])
    ro, stats = filter_and_refill(ctl, _cfg(), _rollout([[0, 1], [1, 0], [0.2, 0.3]]), _more())
    assert ctl.asked == [] and len(ro) == 6 and stats["filter/groups_filtered"] == 0


def test_surplus_groups_are_cut_to_the_batch():
    ctl = ScriptedController([[[0, 1], [1, 0], [0, 1]]])
    ro, stats = filter_and_refill(ctl, _cfg(), _rollout([[0, 1], [1, 1], [1, 1]]), _more())
    assert len(ro) == 3 * G and stats["filter/groups_kept"] == 3


def test_gives_up_after_max_collects_with_a_warning(caplog):
    ctl = ScriptedController([[[1, 1]] * 3, [[0, 0]] * 3])
    with caplog.at_level(logging.WARNING):
        ro, stats = filter_and_refill(ctl, _cfg(), _rollout([[0, 1], [1, 1], [1, 1]]), _more())
    assert ctl.asked == [3, 3] and stats["filter/extra_collects"] == 2
    assert len(ro) == G and stats["filter/groups_kept"] == 1
    assert "1 of 3 groups kept after 2 extra collect(s)" in caplog.text


def test_reward_range_drops_groups_whose_mean_is_outside():
    # Mean 1.0 and 0.0 are outside (0, 1) anyway; (0.9, 1.0) has mean 0.95 > 0.9 and goes too.
    cfg = _cfg(dynamic_filtering_reward_range=[0.1, 0.9], dynamic_filtering_max_collects=0)
    ro, stats = filter_and_refill(ScriptedController([]), cfg, _rollout([[0, 1], [0.9, 1.0], [0.0, 0.1]]), _more())
    assert [s.prompt_id for s in ro.samples] == [0, 0]
    assert stats["filter/groups_filtered"] == 2
