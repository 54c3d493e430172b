"""Hand-computed checks of learner/algorithms/kl.py: estimators, KL-in-reward, controllers."""

import math

import pytest
import torch

from learner.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_kl,
    kl_penalized_rewards,
    last_token_index,
)

LN2 = math.log(2.0)

# Two tokens. Token 0: pi = 0.5, pi_ref = 0.25; token 1: pi = 0.25, pi_ref = 0.5.
# With r = pi_ref / pi (Schulman's ratio for KL[pi || pi_ref] sampled from pi):
#   token 0: r = 1/2, log r = -ln2     token 1: r = 2, log r = +ln2
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]])
REF = torch.tensor([[math.log(0.25), math.log(0.5)]])


def test_k1_is_minus_log_r():
    # k1 = -log r:  token 0: +ln2 = 0.6931;  token 1: -ln2 = -0.6931 (k1 can be negative)
    torch.testing.assert_close(compute_kl(LOGP, REF, estimator="k1"), torch.tensor([[LN2, -LN2]]))


def test_k2_is_half_log_r_squared():
    # k2 = (log r)^2 / 2 = ln2^2 / 2 = 0.4805 / 2 = 0.2402 for both tokens
    torch.testing.assert_close(compute_kl(LOGP, REF, estimator="k2"), torch.tensor([[LN2**2 / 2, LN2**2 / 2]]))


def test_k3_is_r_minus_1_minus_log_r():
    # k3 = (r - 1) - log r:
    #   token 0: (0.5 - 1) - (-ln2) = -0.5 + 0.6931 = 0.1931
    #   token 1: (2 - 1) - ln2      =  1 - 0.6931   = 0.3069
    torch.testing.assert_close(compute_kl(LOGP, REF, estimator="k3"), torch.tensor([[LN2 - 0.5, 1 - LN2]]))


def test_estimators_registry_and_identical_policies():
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    x = torch.randn(2, 3)
    for name in KL_ESTIMATORS:  # pi == pi_ref: every estimator is exactly 0
        assert torch.equal(compute_kl(x, x, estimator=name), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="unknown KL estimator"):
        compute_kl(x, x, estimator="k4")


def test_mask_zeroes_padding_even_if_garbage():
    # token 1 is padding and its log-prob is -inf (garbage): result is exactly 0 there, no NaN
    logp = torch.tensor([[math.log(0.5), -math.inf]])
    out = compute_kl(logp, REF, torch.tensor([[1, 0]]), estimator="k3")
    torch.testing.assert_close(out, torch.tensor([[LN2 - 0.5, 0.0]]))


def test_clamp_is_symmetric():
    # k1 = [+0.6931, -0.6931] clamped to [-0.5, 0.5] -> [0.5, -0.5]
    torch.testing.assert_close(compute_kl(LOGP, REF, estimator="k1", clamp=0.5), torch.tensor([[0.5, -0.5]]))


def test_single_token():
    out = compute_kl(LOGP[:, :1], REF[:, :1], torch.ones(1, 1), estimator="k1")
    torch.testing.assert_close(out, torch.tensor([[LN2]]))


def test_last_token_index():
    # rows: last valid at 1; no valid token (-1); a hole in the middle, last valid at 2
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert last_token_index(mask).tolist() == [1, -1, 2]


def test_kl_penalized_rewards_by_hand():
    # R_t = -beta * kl_t + r * [t == last valid], beta = 0.5
    # row 0 (mask 1 1 0): [-0.05, -0.10 + 1.0, 0]      = [-0.05, 0.90, 0.0]
    # row 1 (mask 1 1 1): [-0.20, -0.25, -0.30 + 2.0]  = [-0.20, -0.25, 1.70]
    rewards = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = kl_penalized_rewards(rewards, kl, mask, kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.90, 0.0], [-0.20, -0.25, 1.70]]))


def test_kl_penalized_rewards_negative_coef_is_zero_and_empty_row():
    # beta < 0 counts as 0 (OpenRLHF): only the scalar reward at the last token remains.
    # row 1 has no valid token: it stays all zero (its reward has nowhere to go).
    out = kl_penalized_rewards(torch.tensor([1.0, 5.0]), torch.ones(2, 2), torch.tensor([[1, 1], [0, 0]]), kl_coef=-1.0)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))


def test_kl_penalized_rewards_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"rewards must be \(B,\)"):
        kl_penalized_rewards(torch.ones(3), torch.zeros(2, 2), torch.ones(2, 2), 0.1)


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05


def test_adaptive_controller_by_hand():
    # beta = 0.1, target 6, horizon 10000
    ctl = AdaptiveKLController(0.1, kl_target=6.0, horizon=10000)
    # KL 6.6: e = 6.6/6 - 1 = 0.1 (inside the clip); n = 5000: beta *= 1 + 0.1 * 0.5 = 1.05 -> 0.105
    ctl.update(6.6, 5000)
    assert ctl.value == pytest.approx(0.105)
    # KL 9: e = 0.5 clipped to 0.2; n = 1000: beta *= 1 + 0.2 * 0.1 = 1.02 -> 0.1071
    ctl.update(9.0, 1000)
    assert ctl.value == pytest.approx(0.105 * 1.02)
    # KL 3: e = -0.5 clipped to -0.2; beta *= 0.98
    ctl.update(3.0, 1000)
    assert ctl.value == pytest.approx(0.105 * 1.02 * 0.98)


def test_adaptive_controller_rejects_bad_target():
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, kl_target=0.0, horizon=10)
