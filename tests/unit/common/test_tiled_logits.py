"""Tiled log-probs (common.tiled_logits): the tile arithmetic by hand, and the numbers and
gradients of the whole-logits formulas (learner.algorithms.losses) to fp32 rounding.

The trainer's use of it (PolicyTrainer steps, LoRA, packed and padded rows, action masks):
tests/unit/rl/test_tiled_logprobs.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.tiled_logits import head_inputs, tile_bounds, token_logprobs, untileable_reason
from learner.algorithms.losses import entropy_from_logits, log_probs_from_logits


def test_tile_bounds_by_hand():
    # 10 rows in tiles of 4: rows 0-3, 4-7 and the 2 left, 8-9.
    assert tile_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert tile_bounds(8, 4) == [(0, 4), (4, 8)]
    assert tile_bounds(3, 4) == [(0, 3)]  # a tile larger than the rows: one, of all
    assert tile_bounds(10, 0) == [(0, 10)]  # 0: tiling off, the whole logits at once
    assert tile_bounds(0, 4) == []


def test_one_row_by_hand():
    # Head = identity on H = V = 2. Row 0's logits (0, ln 3): p = (1/4, 3/4), so the label-1
    # log-prob is ln(3/4) and H = -(1/4 ln 1/4 + 3/4 ln 3/4). Row 1 at tau = 2: logits
    # (0, 2 ln 3) / 2 = (0, ln 3), the same distribution, label 0: ln(1/4).
    head = torch.nn.Identity()
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    lp, ent = token_logprobs(head, torch.tensor([[0.0, math.log(3)]]), torch.tensor([1]), entropy="metric")
    assert lp.tolist() == pytest.approx([math.log(0.75)], abs=1e-6)
    assert ent is not None and ent.tolist() == pytest.approx([entropy], abs=1e-6)
    lp, _ = token_logprobs(head, torch.tensor([[0.0, 2 * math.log(3)]]), torch.tensor([0]), temperature=2.0)
    assert lp.tolist() == pytest.approx([math.log(0.25)], abs=1e-6)


@pytest.mark.parametrize("tile", [1, 3, 7, 0])
def test_tiles_give_the_whole_logits_numbers_and_gradients(tile):
    """7 rows, V = 11: tiles of 1, 3 (not dividing 7), 7 and off; a -inf logit in the vocabulary."""
    torch.manual_seed(0)
    head = torch.nn.Linear(5, 11)
    with torch.no_grad():
        head.bias[3] = -math.inf  # a masked vocabulary entry: entropy and grads stay finite
    hidden = torch.randn(7, 5, requires_grad=True)
    labels = torch.randint(0, 11, (7,))
    labels[labels == 3] = 4
    weight = torch.randn(7)

    def grads(lp: torch.Tensor, ent: torch.Tensor) -> list[torch.Tensor]:
        params = [hidden, head.weight, head.bias]
        return list(torch.autograd.grad((lp * weight).sum() + (ent * weight.flip(0)).sum(), params))

    logits = head(hidden)
    want_lp = log_probs_from_logits(logits, labels, temperature=0.7)
    want_ent = entropy_from_logits(logits, temperature=0.7)
    want = grads(want_lp, want_ent)
    lp, ent = token_logprobs(head, hidden, labels, temperature=0.7, tile_tokens=tile, entropy="grad")
    assert ent is not None
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-6)
    _, metric = token_logprobs(head, hidden, labels, temperature=0.7, tile_tokens=tile, entropy="metric")
    assert metric is not None and not metric.requires_grad
    torch.testing.assert_close(metric, want_ent, rtol=0, atol=1e-6)  # in place, the -inf entry read as 0
    for got, exp in zip(grads(lp, ent), want, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, exp, rtol=0, atol=1e-6)


def test_the_head_sees_one_tile_at_a_time_forward_and_backward():
    """The point of tiling: the largest logits the head makes are one tile's, in backward's
    recompute too; a metric entropy is not recomputed (the head runs once per tile for it)."""
    head = torch.nn.Linear(4, 9)
    rows_seen: list[int] = []
    head.register_forward_hook(lambda m, args, out: rows_seen.append(out.shape[0]))
    hidden = torch.randn(10, 4, requires_grad=True)
    lp, ent = token_logprobs(head, hidden, torch.zeros(10, dtype=torch.long), tile_tokens=4, entropy="metric")
    assert rows_seen == [4, 4, 2]
    assert ent is not None and not ent.requires_grad
    lp.sum().backward()
    assert rows_seen == [4, 4, 2, 2, 4, 4]  # backward recomputes each tile, the last one first
    rows_seen.clear()
    with torch.no_grad():  # no graph: no checkpoint, no recompute
        token_logprobs(head, hidden, torch.zeros(10, dtype=torch.long), tile_tokens=4)
    assert rows_seen == [4, 4, 2]


def test_empty_rows_and_bad_arguments():
    head = torch.nn.Linear(4, 9)
    lp, ent = token_logprobs(head, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), entropy="grad")
    assert lp.shape == (0,) and ent is not None and ent.shape == (0,)
    with pytest.raises(ValueError, match="entropy='yes'"):
        token_logprobs(head, torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), entropy="yes")
    with pytest.raises(ValueError, match=r"hidden \(R, H\) and labels \(R,\)"):
        token_logprobs(head, torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long))


def test_head_inputs_captures_the_kept_columns_and_skips_the_projection(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert untileable_reason(model) is None
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    head = model.get_output_embeddings()
    rows: list[int] = []
    head.register_forward_hook(lambda m, args, out: rows.append(out.shape[1]))
    with torch.no_grad():
        hidden = head_inputs(model, head, input_ids=ids, logits_to_keep=3)  # (1, 3, H)
        whole = model(input_ids=ids, logits_to_keep=3).logits
    assert rows == [0, 3]  # the captured forward projected nothing
    torch.testing.assert_close(head(hidden), whole, rtol=0, atol=1e-6)
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping=30.0 changes the logits" in (untileable_reason(model) or "")
