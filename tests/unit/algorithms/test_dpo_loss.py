"""Hand-computed values of DPO, cDPO, IPO and the NLL term (learner.algorithms.dpo_loss)."""

import pytest
import torch

from learner.algorithms.dpo_loss import dpo_loss

# One pair: policy log-probs chosen -1, rejected -3; reference -2 and -2.
# h = (pc - rc) - (pr - rr) = (-1 + 2) - (-3 + 2) = 1 - (-1) = 2.
PC, PR, RC, RR = (torch.tensor([v]) for v in (-1.0, -3.0, -2.0, -2.0))


def test_dpo_by_hand():
    loss, m = dpo_loss(PC, PR, RC, RR, beta=0.5)
    # -log sigmoid(beta h) = -log sigmoid(1) = log(1 + e^-1) = 0.313262
    assert loss.item() == pytest.approx(0.313262, abs=1e-6)
    # implicit rewards beta (pc - rc) = 0.5, beta (pr - rr) = -0.5
    assert m["chosen_reward"].item() == pytest.approx(0.5) and m["rejected_reward"].item() == pytest.approx(-0.5)
    assert m["reward_margin"].item() == pytest.approx(1.0) and m["acc"].item() == 1.0


def test_cdpo_by_hand():
    loss, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1)
    # 0.9 * log(1 + e^-1) + 0.1 * log(1 + e) = 0.9 * 0.313262 + 0.1 * 1.313262 = 0.413262
    assert loss.item() == pytest.approx(0.413262, abs=1e-6)


def test_ipo_by_hand():
    # (h - 1 / (2 tau))^2: tau 0.5 -> (2 - 1)^2 = 1; tau 0.25 -> (2 - 2)^2 = 0
    assert dpo_loss(PC, PR, RC, RR, beta=0.5, ipo=True)[0].item() == pytest.approx(1.0)
    assert dpo_loss(PC, PR, RC, RR, beta=0.25, ipo=True)[0].item() == pytest.approx(0.0)


def test_nll_term_and_gradient_reaches_only_the_policy():
    pc = PC.clone().requires_grad_(True)
    rc = RC.clone().requires_grad_(True)
    loss, m = dpo_loss(pc, PR, rc, RR, beta=0.5, nll_loss_coef=0.5, chosen_tokens=torch.tensor([4]))
    # nll = -pc / n = 1 / 4 = 0.25; loss = 0.313262 + 0.5 * 0.25 = 0.438262
    assert m["nll"].item() == pytest.approx(0.25) and loss.item() == pytest.approx(0.438262, abs=1e-6)
    loss.backward()
    # d/dpc: -beta sigmoid(-beta h) - coef / n = -0.5 * 0.268941 - 0.125 = -0.259471
    assert pc.grad.item() == pytest.approx(-0.259471, abs=1e-6)
    assert rc.grad is None  # the reference is detached


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(PC, PR, RC, RR, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="chosen_tokens"):
        dpo_loss(PC, PR, RC, RR, beta=0.1, nll_loss_coef=1.0)
