"""Hand-computed checks of learner/algorithms/advantages.py and learner/algorithms/shaping.py."""

import math

import pytest
import torch

from learner.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages,
    group_view,
    masked_whiten,
)
from learner.algorithms.shaping import clip_rewards, dynamic_filter_mask, overlong_penalty, stop_properly_penalty

close = torch.testing.assert_close


# --- building blocks -----------------------------------------------------------------------


def test_discounted_returns_by_hand():
    # gamma = 0.5, rewards 1 2 3 | pad:
    #   G2 = 3;  G1 = 2 + 0.5 * 3 = 3.5;  G0 = 1 + 0.5 * 3.5 = 2.75;  pad -> 0
    out = discounted_returns(torch.tensor([[1.0, 2.0, 3.0, 9.0]]), torch.tensor([[1, 1, 1, 0]]), 0.5)
    close(out, torch.tensor([[2.75, 3.5, 3.0, 0.0]]))


def test_discounted_returns_skips_masked_middle_token():
    # mask 1 0 1 (e.g. a tool-output token in the middle), reward 99 on it is ignored:
    #   G2 = 4;  G1 = 0 (masked);  G0 = 1 + 0.5 * G2 = 3  (the masked step is not a step)
    out = discounted_returns(torch.tensor([[1.0, 99.0, 4.0]]), torch.tensor([[1, 0, 1]]), 0.5)
    close(out, torch.tensor([[3.0, 0.0, 4.0]]))


def test_gae_by_hand():
    # gamma 0.9, lambda 0.8, V = [1, 2 | pad], R = [0.5, 1.0 | pad]
    #   t=1 (last): delta = 1.0 + 0.9 * 0 - 2.0 = -1.0;  A1 = -1.0
    #   t=0: delta = 0.5 + 0.9 * 2.0 - 1.0 = 1.3;  A0 = 1.3 + 0.9 * 0.8 * (-1.0) = 0.58
    #   returns = A + V = [1.58, 1.0, 0]
    # The padding value 1e6 must not leak into the last valid token's bootstrap.
    values = torch.tensor([[1.0, 2.0, 1e6]])
    rewards = torch.tensor([[0.5, 1.0, 7.0]])
    adv, ret = gae_advantages(values, rewards, torch.tensor([[1, 1, 0]]), gamma=0.9, lambd=0.8)
    close(adv, torch.tensor([[0.58, -1.0, 0.0]]))
    close(ret, torch.tensor([[1.58, 1.0, 0.0]]))


def test_gae_lambda_one_gamma_one_is_return_minus_value():
    # lambda = gamma = 1: A_t = sum_{s>=t} R_s - V_t.  R = [0, 0, 1], V = [0.2, 0.5, 0.9]
    #   A = [1 - 0.2, 1 - 0.5, 1 - 0.9] = [0.8, 0.5, 0.1]; returns = [1, 1, 1]
    adv, ret = gae_advantages(
        torch.tensor([[0.2, 0.5, 0.9]]), torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), 1.0, 1.0
    )
    close(adv, torch.tensor([[0.8, 0.5, 0.1]]))
    close(ret, torch.ones(1, 3))


def test_masked_whiten_by_hand():
    # valid values 1 2 3 4: mean 2.5, deviations -1.5 -0.5 0.5 1.5,
    # population var = (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25, std = 1.1180
    # whitened = [-1.3416, -0.4472, 0.4472, 1.3416]; padding stays 0 whatever it held
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    s = math.sqrt(1.25)
    close(masked_whiten(x, mask), torch.tensor([[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0]]))
    close(masked_whiten(x, mask, std_norm=False), torch.tensor([[-1.5, -0.5, 0.5], [1.5, 0.0, 0.0]]))


def test_masked_whiten_constant_input_is_zero_not_nan():
    # var = 0 is clamped to 1e-8 and (x - mean) = 0, so the result is exactly 0
    out = masked_whiten(torch.full((2, 3), 0.7), torch.ones(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


def test_group_view_errors():
    with pytest.raises(ValueError, match="not a whole number of groups of 2"):
        group_view(torch.ones(5), 2)
    with pytest.raises(ValueError, match="group_size .* must be >= 2"):
        group_view(torch.ones(4), 1, min_group=2)
    with pytest.raises(ValueError, match=r"rewards must be \(B,\)"):
        group_view(torch.ones(2, 2), 2)


# --- estimators ----------------------------------------------------------------------------


def test_reinforce_by_hand():
    # rewards [1, 0], mask [[1, 1], [1, 0]], no KL, gamma 1
    #   token rewards [[0, 1], [0, pad]] -> returns [[1, 1], [0, 0]]
    #   whitening over the 3 valid tokens {1, 1, 0}: mean 2/3, var = (1/9 + 1/9 + 4/9) / 3 = 2/9,
    #   std = sqrt(2)/3: A = (1/3) / (sqrt(2)/3) = 0.7071, (-2/3) / (sqrt(2)/3) = -1.4142
    adv, ret = compute_advantages("reinforce", torch.tensor([1.0, 0.0]), torch.tensor([[1, 1], [1, 0]]))
    r2 = math.sqrt(2.0)
    close(adv, torch.tensor([[1 / r2, 1 / r2], [-r2, 0.0]]))
    close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_reinforce_with_kl_in_reward_and_discount():
    # r = 1, kl = [1, 2], beta = 0.1: token rewards [-0.1, -0.2 + 1] = [-0.1, 0.8]
    #   gamma 1:   returns [0.7, 0.8]; mean 0.75, std 0.05 -> A = [-1, 1]
    #   gamma 0.5: returns [-0.1 + 0.5 * 0.8, 0.8] = [0.3, 0.8]
    kw = dict(kl=torch.tensor([[1.0, 2.0]]), kl_coef=0.1)
    adv, ret = compute_advantages("reinforce", torch.tensor([1.0]), torch.ones(1, 2), **kw)
    close(ret, torch.tensor([[0.7, 0.8]]))
    close(adv, torch.tensor([[-1.0, 1.0]]), atol=1e-4, rtol=1e-4)
    _, ret = compute_advantages("reinforce", torch.tensor([1.0]), torch.ones(1, 2), gamma=0.5, **kw)
    close(ret, torch.tensor([[0.3, 0.8]]))


def test_reinforce_baseline_by_hand():
    # G = 2: groups [1, 0] and [2, 2]; group means 0.5 and 2 -> shaped [0.5, -0.5, 0, 0]
    # mask rows: 2, 2, 1, 2 tokens -> returns (gamma 1) rows [.5 .5], [-.5 -.5], [0 pad], [0 0]
    # 7 valid tokens, mean 0, var = 4 * 0.25 / 7 = 1/7 -> A = +-0.5 * sqrt(7) = +-1.3229
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]])
    adv, _ = compute_advantages("reinforce_baseline", torch.tensor([1.0, 0.0, 2.0, 2.0]), mask, group_size=2)
    a = 0.5 * math.sqrt(7.0)
    close(adv, torch.tensor([[a, a], [-a, -a], [0.0, 0.0], [0.0, 0.0]]))


def test_rloo_by_hand():
    # one group of G = 4, r = [1, 0, 0, 4], sum 5; baseline_i = (5 - r_i) / 3 = [4/3, 5/3, 5/3, 1/3]
    # A = r - baseline = [-1/3, -5/3, -5/3, 11/3], broadcast over each row's valid tokens
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv, ret = compute_advantages("rloo", torch.tensor([1.0, 0.0, 0.0, 4.0]), mask, group_size=4)
    expect = torch.tensor([-1 / 3, -5 / 3, -5 / 3, 11 / 3]).unsqueeze(1) * mask
    close(adv, expect)
    close(ret, expect)


def test_group_norm_by_hand_and_identical_group():
    # G = 3. Group [1, 2, 3]: mean 2, unbiased std = sqrt((1 + 0 + 1) / 2) = 1 -> A = [-1, 0, 1]
    # Group [5, 5, 5]: std 0 -> (0) / (0 + 1e-9) = 0, no NaN
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    mask = torch.ones(6, 2)
    adv, ret = compute_advantages("group_norm", rewards, mask, group_size=3)
    expect = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]).unsqueeze(1).expand(6, 2)
    close(adv, expect)
    close(ret, expect)
    assert not torch.isnan(adv).any()


def test_group_norm_without_std_and_dr_grpo():
    # group [0, 4, 8]: mean 4 -> r - mean = [-4, 0, 4] (std would be 4: GRPO gives [-1, 0, 1])
    rewards, mask = torch.tensor([0.0, 4.0, 8.0]), torch.ones(3, 1)
    adv, _ = compute_advantages("group_norm", rewards, mask, group_size=3, std_norm=False)
    close(adv, torch.tensor([[-4.0], [0.0], [4.0]]))
    adv, _ = compute_advantages("dr_grpo", rewards, mask, group_size=3)
    close(adv, torch.tensor([[-4.0], [0.0], [4.0]]))
    adv, _ = compute_advantages("group_norm", rewards, mask, group_size=3)
    close(adv, torch.tensor([[-1.0], [0.0], [1.0]]))


def test_group_estimator_with_kl_in_reward():
    # group_norm then KL-in-reward: group [0, 2] -> mean 1, unbiased std sqrt(2) -> [-0.7071, 0.7071]
    # row 0 kl = [1, 1], beta 0.5: token rewards [-0.5, -0.5 - 0.7071]; returns [-1.7071, -1.2071]
    # row 1 kl = 0: returns [0.7071, 0.7071]
    s = 1 / math.sqrt(2.0)
    adv, _ = compute_advantages(
        "group_norm",
        torch.tensor([0.0, 2.0]),
        torch.ones(2, 2),
        group_size=2,
        kl=torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
        kl_coef=0.5,
    )
    close(adv, torch.tensor([[-1.0 - s, -0.5 - s], [s, s]]))


def test_gae_estimator_whitens_globally():
    # single row, V = 0, rewards at the last token: R = [0, 1], gamma = lambda = 1
    #   GAE = [1, 1] (returns [1, 1]); whitening a constant gives 0 -> advantages [0, 0]
    adv, ret = compute_advantages("gae", torch.tensor([1.0]), torch.ones(1, 2), values=torch.zeros(1, 2))
    close(ret, torch.ones(1, 2))
    close(adv, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", torch.tensor([1.0]), torch.ones(1, 2))


def test_single_token_responses():
    # T = 1: every estimator puts the shaped reward on the only token
    # group_norm on [0, 1]: mean 0.5, unbiased std 0.7071 -> [-0.7071, 0.7071]
    adv, _ = compute_advantages("group_norm", torch.tensor([0.0, 1.0]), torch.ones(2, 1), group_size=2)
    close(adv, torch.tensor([[-1 / math.sqrt(2.0)], [1 / math.sqrt(2.0)]]))


def test_padding_is_ignored():
    # Adding right padding (with garbage kl and values there) changes nothing on valid tokens
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    short_mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    long_mask = torch.cat([short_mask, torch.zeros(4, 2, dtype=torch.long)], dim=1)
    kl_short = torch.rand(4, 2)
    kl_long = torch.cat([kl_short, torch.full((4, 2), 1e6)], dim=1)
    v_short = torch.rand(4, 2)
    v_long = torch.cat([v_short, torch.full((4, 2), -1e6)], dim=1)
    for name in ADVANTAGE_ESTIMATORS:
        a, r = compute_advantages(name, rewards, short_mask, group_size=2, values=v_short, kl=kl_short, kl_coef=0.1)
        a2, r2 = compute_advantages(name, rewards, long_mask, group_size=2, values=v_long, kl=kl_long, kl_coef=0.1)
        close(a2[:, :2], a, msg=name)
        close(r2[:, :2], r, msg=name)
        assert torch.equal(a2[:, 2:], torch.zeros(4, 2)), name


@pytest.mark.parametrize("name", ["rloo", "group_norm", "dr_grpo", "reinforce_baseline"])
def test_group_estimators_reject_group_of_one(name):
    with pytest.raises(ValueError, match=rf"{name}: group_size .* must be >= 2"):
        compute_advantages(name, torch.tensor([1.0, 0.0]), torch.ones(2, 1), group_size=1)


@pytest.mark.parametrize("name", ["rloo", "group_norm", "dr_grpo", "reinforce_baseline"])
def test_group_estimators_reject_partial_group(name):
    with pytest.raises(ValueError, match="not a whole number of groups of 2"):
        compute_advantages(name, torch.ones(5), torch.ones(5, 1), group_size=2)


@pytest.mark.parametrize("name", ["rloo", "group_norm", "dr_grpo", "reinforce_baseline"])
def test_group_estimators_reject_discount(name):
    with pytest.raises(ValueError, match="gamma must be 1.0"):
        compute_advantages(name, torch.ones(4), torch.ones(4, 1), group_size=2, gamma=0.9)


def test_registry_has_uniform_signature():
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"}
    kwargs = dict(
        group_size=2,
        values=torch.zeros(4, 3),
        kl=torch.zeros(4, 3),
        kl_coef=0.0,
        gamma=1.0,
        lambd=1.0,
        std_norm=True,
        dist_reduce=None,
    )
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        adv, ret = fn(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.ones(4, 3), **kwargs)
        assert adv.shape == ret.shape == (4, 3), name
        assert not adv.requires_grad
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo", torch.ones(2), torch.ones(2, 1))


# --- shaping -------------------------------------------------------------------------------


def test_clip_rewards():
    close(clip_rewards(torch.tensor([-3.0, 0.5, 7.0]), -1.0, 1.0), torch.tensor([-1.0, 0.5, 1.0]))
    with pytest.raises(ValueError):
        clip_rewards(torch.zeros(1), 1.0, -1.0)


def test_overlong_penalty_by_hand():
    # max_len 10, buffer 4 -> expected length 6. lengths 5 6 8 10 12:
    #   exceed = [0, 0, 2, 4, min(6, 4) = 4] -> penalty = exceed / 4 * factor
    #   factor 1: [0, 0, 0.5, 1, 1] -> rewards 1 - penalty = [1, 1, 0.5, 0, 0]
    #   factor 2: [1, 1, 0, -1, -1]
    lengths = torch.tensor([5, 6, 8, 10, 12])
    close(overlong_penalty(torch.ones(5), lengths, 10, 4), torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0]))
    close(overlong_penalty(torch.ones(5), lengths, 10, 4, factor=2.0), torch.tensor([1.0, 1.0, 0.0, -1.0, -1.0]))
    with pytest.raises(ValueError):
        overlong_penalty(torch.ones(1), lengths[:1], 10, 11)


def test_stop_properly_penalty():
    rewards = torch.tensor([1.0, 1.0, -0.5])
    truncated = torch.tensor([False, True, True])
    # coef 0.5 scales truncated rewards: [1, 0.5, -0.25]
    close(stop_properly_penalty(rewards, truncated, 0.5), torch.tensor([1.0, 0.5, -0.25]))
    # coef -0.5 overrides truncated rewards with -0.5: [1, -0.5, -0.5]
    close(stop_properly_penalty(rewards, truncated, -0.5), torch.tensor([1.0, -0.5, -0.5]))
    with pytest.raises(ValueError):
        stop_properly_penalty(rewards, truncated, 1.5)


def test_dynamic_filter_mask():
    # G = 2 groups: [1, 1] all equal -> drop; [0, 1] -> keep; [0, 0] -> drop
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert dynamic_filter_mask(rewards, 2).tolist() == [False, True, False]
    # continuous rewards: [0.3, 0.3] equal -> drop; [0.2, 0.9] -> keep
    assert dynamic_filter_mask(torch.tensor([0.3, 0.3, 0.2, 0.9]), 2).tolist() == [False, True]
    # reward_range (0, 1) on the group mean: [0.2, 0.9] mean 0.55 keep; [1, 3] mean 2 drop
    assert dynamic_filter_mask(torch.tensor([0.2, 0.9, 1.0, 3.0]), 2, reward_range=(0.0, 1.0)).tolist() == [True, False]
    # a group of one is trivially all-equal
    assert dynamic_filter_mask(torch.tensor([1.0, 0.0]), 1).tolist() == [False, False]
    with pytest.raises(ValueError, match="not a whole number of groups"):
        dynamic_filter_mask(torch.ones(3), 2)
