"""Hand-computed SFT loss, and the split-across-ranks invariance of its aggregation."""

import math

import pytest
import torch

from learner.algorithms.sft_loss import IGNORE_INDEX, sft_loss


def test_sft_loss_by_hand():
    # V = 2. Position 0: logits [0, ln 3] -> p(1) = 3/4, label 1: -log(3/4) = 0.287682.
    # Position 1: ignored (a prompt token). Position 2: logits [0, 0], label 0: log 2 = 0.693147.
    logits = torch.tensor([[[0.0, math.log(3)], [5.0, -5.0], [0.0, 0.0]]])
    labels = torch.tensor([[1, IGNORE_INDEX, 0]])
    loss, m = sft_loss(logits, labels, global_tokens=4)  # 2 more tokens live on another rank
    assert loss.item() == pytest.approx((0.287682 + 0.693147) / 4, abs=1e-6)
    assert m["nll"].item() == pytest.approx((0.287682 + 0.693147) / 2, abs=1e-6)
    assert m["tokens"].item() == 2
    with pytest.raises(ValueError):
        sft_loss(logits, labels, global_tokens=0)


def test_shares_of_two_simulated_ranks_sum_to_the_whole_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (4, 5))
    labels[0, :3] = IGNORE_INDEX  # uneven response lengths across the two halves
    labels[3, 1:] = IGNORE_INDEX
    total = int((labels != IGNORE_INDEX).sum())
    whole, _ = sft_loss(logits, labels, global_tokens=total)
    (g_whole,) = torch.autograd.grad(whole, logits)
    parts = [sft_loss(logits[i : i + 2], labels[i : i + 2], global_tokens=total)[0] for i in (0, 2)]
    (g_parts,) = torch.autograd.grad(sum(parts), logits)
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(g_parts, g_whole, atol=1e-7)
