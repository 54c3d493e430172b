"""Hand-computed values of the reward-model losses (learner.algorithms.rm_loss)."""

import math

import pytest
import torch

from learner.algorithms.rm_loss import logexp_loss, reward_model_loss, sigmoid_loss


def test_sigmoid_and_logexp_by_hand():
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0])
    # gaps c - r = [1, -1]:  -log sigmoid(1) = log(1 + e^-1) = 0.313262,
    #                        -log sigmoid(-1) = log(1 + e)   = 1.313262; mean 0.813262
    for name in ("sigmoid", "logexp"):
        loss, m = reward_model_loss(chosen, rejected, loss=name)
        assert loss.item() == pytest.approx(0.813262, abs=1e-6)
        assert m["acc"].item() == 0.5 and m["reward_margin"].item() == pytest.approx(0.0)
    loss, _ = reward_model_loss(chosen, rejected)
    loss.backward()
    # d/dc [-log sigmoid(g)] = -sigmoid(-g); /2 for the mean: pair 0 -> -sigmoid(-1)/2 = -0.134471
    assert chosen.grad[0].item() == pytest.approx(-0.134471, abs=1e-6)
    assert chosen.grad[1].item() == pytest.approx(-(1 / (1 + math.exp(-1))) / 2, abs=1e-6)


def test_margin_shifts_the_gap():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    margin = torch.tensor([0.5, 0.0])
    # gaps - margin = [0.5, -1]: log(1 + e^-0.5) = 0.474077 and 1.313262; mean 0.893670
    assert sigmoid_loss(chosen, rejected, margin).mean().item() == pytest.approx(0.893670, abs=1e-6)
    assert logexp_loss(chosen, rejected, margin).mean().item() == pytest.approx(0.893670, abs=1e-6)


def test_logexp_does_not_overflow_and_unknown_loss_is_refused():
    assert logexp_loss(torch.tensor([0.0]), torch.tensor([200.0])).item() == pytest.approx(200.0)
    with pytest.raises(ValueError, match="unknown --loss"):
        reward_model_loss(torch.zeros(1), torch.zeros(1), loss="hinge")
