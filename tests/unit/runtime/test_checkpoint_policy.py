"""The checkpoint rules (learner.runtime.checkpoint_policy), by hand: which steps are kept, and
which checkpoints a resume refuses."""

from __future__ import annotations

import pytest

from learner.runtime.checkpoint_policy import DEEPSPEED_STATES, not_resumable, retained


def test_the_newest_are_kept_and_the_best_scored_besides():
    steps = [10, 20, 30, 40, 50]
    assert retained(steps, max_num=2) == {40, 50}
    assert retained(steps, max_num=2, scores={20: 0.9, 30: 0.4, 50: 0.1}) == {20, 40, 50}
    assert retained(steps, max_num=2, scores={40: 0.9, 20: 0.1}) == {40, 50}  # the best is among the newest
    assert retained(steps, max_num=9, scores={10: 1.0}) == set(steps)
    # Ties: the earlier checkpoint stays (a later one must do better); unranked steps never win.
    assert retained(steps, max_num=1, scores={10: 0.5, 30: 0.5}) == {10, 50}
    assert retained(steps, max_num=1, scores={99: 1.0}) == {50}  # a score of no checkpoint


def test_max_num_below_one_is_refused():
    with pytest.raises(ValueError, match="--max_ckpt_num must be >= 1"):
        retained([1], max_num=0)


def test_only_a_checkpoint_without_deepspeed_states_is_not_resumable():
    assert not_resumable({DEEPSPEED_STATES: True}) is None and not_resumable({}) is None
    why = not_resumable({DEEPSPEED_STATES: False})
    assert "--disable_ds_ckpt" in why and "--pretrain <checkpoint>/hf" in why
