"""Sequence packing: variable-length samples laid end to end in one row, and back.

A packed row concatenates samples with no padding between them; its position ids restart
at 0 for every sample. That restart is what transformers reads as a sample boundary when the
forward gets ``position_ids`` and NO attention mask (and no KV cache): SDPA and eager
attention get a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``),
flash-attention gets per-sample ``cu_seqlens``. Attention never crosses samples, and every
sample sees the positions it would see alone, so a packed forward equals the per-sample
forwards (``tests/unit/rl/test_packing.py`` and ``tests/unit/supervised/test_sft_data.py``).

Pure index arithmetic on torch tensors, shared by SFT (``learner.supervised.sft_data``) and
the RL learner (``learner.rl.experience``). It lives beside the formulas because it imports
only torch.

Shape glossary: B samples, L = sum of their lengths (the packed row), T the longest
response, K = sum of the response lengths (the tokens that carry a log-prob).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["packed_row", "response_logit_index", "unpack_to_padded"]


def packed_row(seqs: Sequence[Sequence[int] | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and position ids of one packed row.

    Args:
        seqs: B token-id sequences (each non-empty): lists or 1-D integer tensors.
    Returns:
        ``(input_ids (1, L), position_ids (1, L))``, int64; position ids run 0 .. len - 1 within
        each sequence.
    """
    parts = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)  # (L,)
    pos = torch.cat([torch.arange(len(s), dtype=torch.long) for s in seqs]) if seqs else ids  # (L,)
    return ids.unsqueeze(0), pos.unsqueeze(0)


def response_logit_index(prompt_lens: Sequence[int], response_lens: Sequence[int]) -> torch.Tensor:
    """(K,) columns of a packed row of ``prompt + response`` samples whose logits predict the
    response tokens, in order (sample 0's tokens first).

    Sample i starts at column o_i = sum_{j<i} (p_j + t_j); its response token t (0-based) is
    predicted by the logits at column o_i + p_i - 1 + t (the token before it). Each prompt
    must be non-empty: the first response token needs a token before it.
    """
    cols, start = [], 0
    for p, t in zip(prompt_lens, response_lens, strict=True):
        if p < 1:
            raise ValueError("a packed sample needs a non-empty prompt: its first response token has no predictor")
        cols.append(torch.arange(start + p - 1, start + p - 1 + t, dtype=torch.long))
        start += p + t
    return torch.cat(cols) if cols else torch.zeros(0, dtype=torch.long)


def unpack_to_padded(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token values of a packed row back in the padded layout.

    Args:
        flat: (K,) values, sample 0's tokens first (the order of ``response_logit_index``).
        mask: (B, T) bool, True at the K valid positions; row i's valid positions in order.
    Returns:
        (B, T) with ``flat`` at the True positions (row-major) and 0 elsewhere; differentiable
        with respect to ``flat``.
    """
    if int(mask.sum()) != flat.shape[0]:
        raise ValueError(f"{flat.shape[0]} packed values for a mask of {int(mask.sum())} valid positions")
    return flat.new_zeros(mask.shape).masked_scatter(mask, flat)
