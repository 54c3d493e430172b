"""The reference model's log-probs with --logits_tile_tokens: the whole logits' numbers on ragged,
left-padded micro-batches (an empty response among them), the head never seeing more than a
tile's rows; a model that changes its logits after the head keeps the whole logits."""

from __future__ import annotations

import torch

from reward_service.ref_model import ReferenceScorer

SHAPES = [(5, 7), (12, 1), (3, 20), (9, 0), (1, 4), (30, 11), (7, 7)]


def test_tiled_reference_logprobs_equal_whole_logits(tiny_model_dir):
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(3, 700, (p,), generator=g), torch.randint(3, 700, (r,), generator=g)) for p, r in SHAPES]
    prompts, responses = [p for p, _ in seqs], [r for _, r in seqs]
    whole = ReferenceScorer.load(str(tiny_model_dir), micro_batch_size=3, temperature=0.7, tile_tokens=0)
    tiled = ReferenceScorer.load(str(tiny_model_dir), micro_batch_size=3, temperature=0.7, tile_tokens=5)
    rows: list[int] = []
    tiled.model.get_output_embeddings().register_forward_hook(lambda m, a, out: rows.append(out.shape[-2]))
    want, got = whole.logprobs(prompts, responses), tiled.logprobs(prompts, responses)
    assert got.shape == want.shape == (sum(r for _, r in SHAPES),)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert max(rows) == 5 and 0 in rows  # tiles of 5; the model's own projection got no rows


def test_a_model_with_soft_capped_logits_is_not_tiled(tiny_model_dir):
    ref = ReferenceScorer.load(str(tiny_model_dir), tile_tokens=5)
    assert ref.tile_tokens == 5
    ref.model.config.final_logit_softcapping = 30.0
    assert ReferenceScorer(ref.model, tile_tokens=5).tile_tokens == 0
