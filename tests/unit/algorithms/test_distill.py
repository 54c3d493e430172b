"""learner.algorithms.distill: every formula on hand-computed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms.distill import (
    centered,
    generalized_jsd,
    renormalized_topk,
    sampled_reverse_kl,
    sampled_token_advantage,
    topk_divergence,
)

# Two distributions over 2 ids used below, with their divergences worked out by hand:
#   p (teacher) = [0.5, 0.5],  q (student) = [0.75, 0.25]
#   KL[q || p] = 0.75 ln(0.75/0.5) + 0.25 ln(0.25/0.5) = 0.75 ln 1.5 - 0.25 ln 2
#   KL[p || q] = 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.5 ln 2 - 0.5 ln 1.5
#   beta = 0.5: M = [0.625, 0.375]
#     KL[p || M] = 0.5 ln 0.8 + 0.5 ln(4/3),  KL[q || M] = 0.75 ln 1.2 + 0.25 ln(2/3)
REVERSE = 0.75 * math.log(1.5) - 0.25 * math.log(2)  # 0.130812
FORWARD = 0.5 * math.log(2) - 0.5 * math.log(1.5)  # 0.143841
JSD_HALF = 0.5 * (0.5 * math.log(0.8) + 0.5 * math.log(4 / 3)) + 0.5 * (0.75 * math.log(1.2) + 0.25 * math.log(2 / 3))
P = torch.tensor([0.5, 0.5]).log()
Q = torch.tensor([0.75, 0.25]).log()


def test_sampled_reverse_kl_and_advantage_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, -1.0]])
    tlp = torch.tensor([[-1.5, -1.0, float("-inf")], [-0.25, -4.0, float("nan")]])  # padding holds garbage
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # (-1) - (-1.5) = 0.5; (-2) - (-1) = -1; (-0.25) - (-0.25) = 0; (-3) - (-4) = 1; padding 0
    want = torch.tensor([[0.5, -1.0, 0.0], [0.0, 1.0, 0.0]])
    torch.testing.assert_close(sampled_reverse_kl(lp, tlp, mask), want)
    adv = sampled_token_advantage(lp.requires_grad_(), tlp, mask)
    torch.testing.assert_close(adv, -want)
    assert not adv.requires_grad  # an advantage: no gradient flows through it


def test_centered_subtracts_the_mean_over_trained_tokens():
    d = torch.tensor([[0.5, -1.0, 0.0], [0.0, 1.0, -1.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # mean over the 5 trained tokens: (0.5 - 1 + 0 + 1 - 1.5) / 5 = -0.2
    want = torch.tensor([[0.7, -0.8, 0.0], [0.2, 1.2, -1.3]])
    torch.testing.assert_close(centered(d, mask), want)
    empty = torch.zeros(1, 2)
    torch.testing.assert_close(centered(empty, torch.zeros(1, 2)), empty)  # no token: nothing to centre


def test_a_constant_baseline_keeps_the_expected_gradient():
    # sum_y pi(y) (d(y) - c) grad log pi(y) = sum_y pi(y) d(y) grad log pi(y) for any constant c
    logits = torch.tensor([0.3, -0.2, 1.0], requires_grad=True)
    mu = torch.tensor([0.2, 0.5, 0.3])
    logp = logits.log_softmax(-1)
    d = sampled_token_advantage(logp[None], mu.log()[None])[0]
    grads = []
    for c in (0.0, 0.7):
        (g,) = torch.autograd.grad((logp.exp().detach() * (d - c) * logp).sum(), logits, retain_graph=True)
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1])


def test_sampled_estimator_is_the_exact_reverse_kl_in_expectation():
    # Toy next-token distributions: pi = [1/2, 1/4, 1/4], mu = [1/4, 1/4, 1/2].
    # KL[pi || mu] = 1/2 ln 2 + 1/4 ln 1 + 1/4 ln(1/2) = 1/4 ln 2.
    pi = torch.tensor([0.5, 0.25, 0.25])
    mu = torch.tensor([0.25, 0.25, 0.5])
    exact = 0.25 * math.log(2)
    per_token = sampled_reverse_kl(pi.log()[None], mu.log()[None])[0]  # the estimate for each y
    # the expectation over y ~ pi, by enumeration: exactly the KL
    assert float((pi * per_token).sum()) == pytest.approx(exact, abs=1e-7)
    # and by sampling: 200,000 draws, standard error ~ 0.0016
    g = torch.Generator().manual_seed(0)
    y = torch.multinomial(pi, 200_000, replacement=True, generator=g)
    est = sampled_reverse_kl(pi.log()[y][None], mu.log()[y][None]).mean()
    assert float(est) == pytest.approx(exact, abs=0.006)


def test_sampled_advantage_policy_gradient_is_minus_the_reverse_kl_gradient():
    # E_{y ~ pi}[d(y) grad log pi(y)] = -grad KL[pi || mu] (the score function has mean 0).
    logits = torch.tensor([0.3, -0.2, 1.0], requires_grad=True)
    mu = torch.tensor([0.2, 0.5, 0.3])
    logp = logits.log_softmax(-1)
    kl = (logp.exp() * (logp - mu.log())).sum()
    (grad_kl,) = torch.autograd.grad(kl, logits, retain_graph=True)
    d = sampled_token_advantage(logp[None], mu.log()[None])[0]  # (3,) detached
    surrogate = (logp.exp().detach() * d * logp).sum()  # sum_y pi(y) d(y) log pi(y)
    (grad_pg,) = torch.autograd.grad(surrogate, logits)
    torch.testing.assert_close(grad_pg, -grad_kl)


def test_generalized_jsd_by_hand():
    assert float(generalized_jsd(Q, P, 1.0)) == pytest.approx(REVERSE, abs=1e-6)
    assert float(generalized_jsd(Q, P, 0.0)) == pytest.approx(FORWARD, abs=1e-6)
    assert float(generalized_jsd(Q, P, 0.5)) == pytest.approx(JSD_HALF, abs=1e-6)  # 0.033822
    assert float(generalized_jsd(P, P, 0.3)) == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="distill_jsd_beta"):
        generalized_jsd(Q, P, 1.5)


def test_renormalized_topk_by_hand():
    # logits [ln 3, 0] -> [3/4, 1/4]; the same from log-probs shifted by any constant
    torch.testing.assert_close(renormalized_topk(torch.tensor([math.log(3), 0.0])), Q)
    torch.testing.assert_close(renormalized_topk(torch.tensor([math.log(3) - 7, -7.0])), Q)
    # temperature 2: logits [ln 9, 0] / 2 = [ln 3, 0]
    torch.testing.assert_close(renormalized_topk(torch.tensor([math.log(9), 0.0]), 2.0), Q)
    with pytest.raises(ValueError, match="temperature"):
        renormalized_topk(Q, 0.0)


def test_topk_divergence_by_hand():
    # Teacher's top 2 ids have log-probs [ln 0.4, ln 0.4] (renormalised: [1/2, 1/2]); the
    # student's logits at those ids are [ln 3, 0] ([3/4, 1/4]): the divergences above.
    t = torch.tensor([[[math.log(0.4), math.log(0.4)], [0.0, 0.0]]])  # (1, 2, 2); row 2 is padding
    s = torch.tensor([[[math.log(3), 0.0], [5.0, -5.0]]], requires_grad=True)
    mask = torch.tensor([[1, 0]])
    d = topk_divergence(s, t, mask, beta=1.0)
    torch.testing.assert_close(d, torch.tensor([[REVERSE, 0.0]]))
    d0 = topk_divergence(s, t, mask, beta=0.0)
    torch.testing.assert_close(d0, torch.tensor([[FORWARD, 0.0]]))
    d.sum().backward()
    assert s.grad is not None and torch.all(s.grad[0, 1] == 0)  # padding gets no gradient
    # d KL[q || p] / d z_0 = q_0 (log(q_0/p_0) - KL) = 0.75 (ln 1.5 - REVERSE)
    assert float(s.grad[0, 0, 0]) == pytest.approx(0.75 * (math.log(1.5) - REVERSE), abs=1e-6)


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_with_the_whole_vocabulary_is_the_full_divergence(beta, temperature):
    torch.manual_seed(0)
    B, T, V = 2, 3, 11
    z_s = torch.randn(B, T, V) * 2
    teacher_logp = (torch.randn(B, T, V) * 2 / temperature).log_softmax(-1)  # the service's, at tau
    q_full = (z_s / temperature).log_softmax(-1)
    full = generalized_jsd(q_full, teacher_logp, beta)  # (B, T) over the whole vocabulary
    # k = V, in the teacher's order (top-k sorts by its log-probs): the same sums, permuted
    order = teacher_logp.argsort(-1, descending=True)  # (B, T, V)
    got = topk_divergence(z_s.gather(-1, order), teacher_logp.gather(-1, order), beta=beta, temperature=temperature)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
    if beta == 1.0:  # and it is the reverse KL written out
        want = (q_full.exp() * (q_full - teacher_logp)).sum(-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="teacher log-probs"):
        sampled_reverse_kl(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="teacher top-k"):
        topk_divergence(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4))
