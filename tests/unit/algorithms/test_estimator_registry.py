"""The estimators' formulas and their properties are one set of names: a new estimator cannot
reach the flag's choices without its formula, nor run without saying what it needs."""

from learner.algorithms.advantages import ADVANTAGE_ESTIMATORS
from learner.algorithms.estimators import ESTIMATORS


def test_every_formula_has_its_properties_and_only_those():
    assert set(ADVANTAGE_ESTIMATORS) == set(ESTIMATORS)


def test_the_flag_offers_exactly_the_registry():
    from common.config import leaves
    from learner.rl.config import PPOConfig

    (leaf,) = [x for x in leaves(PPOConfig) if x.path == "algo.advantage.estimator"]
    assert tuple(leaf.meta["choices"]) == tuple(ESTIMATORS)


def test_group_estimators_need_groups_and_only_gae_a_critic():
    assert [s.name for s in ESTIMATORS.values() if s.needs_critic] == ["gae"]
    assert {s.name for s in ESTIMATORS.values() if s.min_group >= 2} == {
        "reinforce_baseline",
        "rloo",
        "group_norm",
        "dr_grpo",
    }
