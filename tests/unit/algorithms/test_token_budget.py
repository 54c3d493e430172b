"""learner/algorithms/token_budget.py: lengths -> micro-batches under a token budget, by hand."""

import random

import pytest

from learner.algorithms.token_budget import micro_batch_cost, token_budget_groups

# Four samples used below: prompts (2, 1, 4, 1), responses (1, 6, 1, 5); p + t = (3, 7, 5, 6).
P4, R4 = [2, 1, 4, 1], [1, 6, 1, 5]


def test_the_cost_is_the_tokens_the_forward_computes():
    # packed: the row's length, 3 + 7 = 10; padded: 2 rows x (longest prompt 2 + longest response 6)
    assert micro_batch_cost(P4, R4, [0, 1], packed=True) == 10
    assert micro_batch_cost(P4, R4, [0, 1], packed=False) == 16
    assert micro_batch_cost(P4, R4, [], packed=False) == 0


def test_packed_groups_by_hand():
    # OpenRLHF's example lengths (5, 3, 7, 2, 6) with a budget of 10 (prompt 1 + response t - 1).
    # 23 tokens need at least 3 groups; longest first, each to the lightest of 3:
    # 7 -> A, 6 -> B, 5 -> C, 3 -> C (8), 2 -> B (8): loads 7, 8, 8, all within 10.
    lengths = [5, 3, 7, 2, 6]
    groups = token_budget_groups([1] * 5, [t - 1 for t in lengths], 10, packed=True)
    assert groups == [[0, 1], [3, 4], [2]]  # heaviest first (8, 8, 7); ties by the first index
    # P4/R4, budget 16: 21 tokens need 2 groups; 7 -> A, 6 -> B, 5 -> B (11), 3 -> A (10).
    assert token_budget_groups(P4, R4, 16, packed=True) == [[2, 3], [0, 1]]


def test_padded_groups_by_hand():
    # Longest first (7: #1, 6: #3, 5: #2, 3: #0), a group taking the next while n x (max p + max t) fits 16:
    # [#1] 7; + #3: 2 x (1 + 6) = 14 fits; + #2: 3 x (4 + 6) = 30 does not -> [#2] 5; + #0: 2 x (4 + 1) = 10.
    assert token_budget_groups(P4, R4, 16, packed=False) == [[1, 3], [0, 2]]


def test_a_sample_over_the_budget_goes_alone_and_is_never_cut():
    # 12 tokens against a budget of 10: alone; the other two (3 + 4 = 7) share one group.
    assert token_budget_groups([1, 1, 1], [11, 2, 3], 10, packed=True) == [[0], [1, 2]]
    assert token_budget_groups([1, 1, 1], [11, 2, 3], 10, packed=False) == [[0], [1, 2]]  # 2 x (1 + 3) = 8


def test_a_count_cuts_the_heaviest_group_until_there_are_that_many():
    # packed, from [[2, 3] 11, [0, 1] 10]: cut [2, 3] (6 | 5) -> 3 groups; then [0, 1] (7 | 3) -> 4;
    # a fifth: every group holds one sample, so an empty one (a stand-in micro-batch)
    assert token_budget_groups(P4, R4, 16, packed=True, count=3) == [[0, 1], [3], [2]]
    assert token_budget_groups(P4, R4, 16, packed=True, count=5) == [[1], [3], [2], [0], []]
    # padded, from [[1, 3] 14, [0, 2] 10]: cut [1, 3] into [1] 7 and [3] 6
    assert token_budget_groups(P4, R4, 16, packed=False, count=3) == [[0, 2], [1], [3]]
    with pytest.raises(ValueError, match="4 samples need 2 micro-batches of 16 tokens, not 1"):
        token_budget_groups(P4, R4, 16, packed=True, count=1)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        token_budget_groups(P4, R4, 0, packed=True)


@pytest.mark.parametrize("packed", [True, False])
def test_every_sample_once_and_every_shared_group_within_the_budget(packed):
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 24)
        p = [rng.randint(1, 40) for _ in range(n)]
        r = [rng.choice([rng.randint(0, 8), rng.randint(50, 300)]) for _ in range(n)]  # very uneven
        budget = rng.randint(30, 600)
        groups = token_budget_groups(p, r, budget, packed=packed)
        more = token_budget_groups(p, r, budget, packed=packed, count=len(groups) + rng.randint(0, 5))
        for gs in (groups, more):
            assert sorted(i for g in gs for i in g) == list(range(n))
            assert all(len(g) == 1 or micro_batch_cost(p, r, g, packed) <= budget for g in gs)
        assert all(more) or n < len(more)  # empty groups only when there are more groups than samples
        assert all(groups) and len(groups) <= n
