"""The reward service's token budget (``--max_tokens_per_gpu``): micro-batches by padded tokens.

The grouping by hand, then the reference model's log-probs and the reward model's rewards with a
budget equal those without one (and those of one sequence at a time) on the tiny model, and the
flag reaches both scorers.
"""

import pytest
import torch

from helpers.reward_models import build_tiny_rm
from reward_service.batching import chunks, token_budget_chunks
from reward_service.config import parse_config
from reward_service.ref_model import ReferenceScorer
from reward_service.reward_model import RewardModelScorer

# (prompt length, response length): very uneven, with an empty response and a one-token prompt
SHAPES = [(5, 7), (12, 1), (3, 40), (9, 0), (1, 4), (30, 11), (7, 7), (2, 2)]


def _ragged(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 700, (p,), generator=g), torch.randint(3, 700, (r,), generator=g)) for p, r in SHAPES]


def test_chunks_by_hand():
    # Longest first (7: #1, 6: #3, 5: #2, 3: #0); a chunk takes the next while n x its longest fits 12:
    # [#1] (2 x 7 = 14 > 12), [#3, #2] (2 x 6 = 12), [#0] (3 x 6 = 18 > 12).
    assert token_budget_chunks([3, 7, 5, 6], 12) == [[1], [3, 2], [0]]
    assert token_budget_chunks([3, 7, 5, 6], 5) == [[1], [3], [2], [0]]  # each alone; 7 and 6 over the budget
    assert token_budget_chunks([3, 7, 5, 6], 100) == [[1, 3, 2, 0]]
    assert chunks([3, 7, 5, 6], 3) == [[1, 3, 2], [0]]  # no budget: --micro_batch_size sequences
    assert chunks([3, 7, 5, 6], 3, 12) == [[1], [3, 2], [0]]
    with pytest.raises(ValueError, match="budget must be >= 1"):
        token_budget_chunks([3], 0)


def test_ref_logprobs_with_a_budget_equal_those_without(tiny_model_dir):
    seqs = _ragged()
    prompts, responses = [p for p, _ in seqs], [r for _, r in seqs]
    one = ReferenceScorer.load(str(tiny_model_dir), micro_batch_size=1).logprobs(prompts, responses)  # unpadded
    fixed = ReferenceScorer.load(str(tiny_model_dir), micro_batch_size=4).logprobs(prompts, responses)
    # lengths 43, 41, 14, 13, 12, 9, 5, 4 against 60 padded tokens: [43] [41] (two would be 86),
    # [14 13 12 9] (4 x 14 = 56; a fifth 70), [5 4]
    budget = ReferenceScorer.load(str(tiny_model_dir), max_tokens=60)
    assert [len(c) for c in chunks([len(p) + len(r) for p, r in seqs], 8, 60)] == [1, 1, 4, 2]
    got = budget.logprobs(prompts, responses)
    assert got.shape == fixed.shape == (sum(len(r) for r in responses),)
    # equal up to the rounding of different kernel shapes (see test_reward_models), in input order
    assert (got - fixed).abs().max().item() < 1e-5
    assert (got - one).abs().max().item() < 1e-5


def test_rm_rewards_with_a_budget_equal_those_without(tiny_model_dir, tmp_path):
    rm_dir = build_tiny_rm(tiny_model_dir, tmp_path / "rm")
    seqs = [torch.cat(s) for s in _ragged(1) if len(s[1])]
    want = RewardModelScorer.load(str(rm_dir), micro_batch_size=1).rewards(seqs)
    got = RewardModelScorer.load(str(rm_dir), max_tokens=60).rewards(seqs)
    assert (got - want).abs().max().item() < 1e-5


def test_the_flag_reaches_both_scorers(tiny_model_dir, tmp_path, monkeypatch):
    from reward_service import scorer

    rm_dir = build_tiny_rm(tiny_model_dir, tmp_path / "rm")
    cfg = parse_config(
        ["--controller", "tcp://127.0.0.1:1", "--ref_pretrain", str(tiny_model_dir), "--reward_pretrain", str(rm_dir)]
        + ["--max_tokens_per_gpu", "512"]
    )
    s = scorer.Scorer.from_config(cfg)
    try:
        assert s.ref.max_tokens == 512
        (rm_source,) = [src for src in s.sources if isinstance(src, scorer.RMSource)]
        assert rm_source.rm.max_tokens == 512
    finally:
        s.close()
