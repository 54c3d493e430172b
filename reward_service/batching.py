"""Ragged token sequences -> padded micro-batches for the reference and reward models.

Samples are sorted by length (longest first, so an out-of-memory shows on the first
micro-batch rather than midway) and cut into micro-batches of ``micro_batch_size``: sorting
keeps the padding in each micro-batch small, which is most of what packing would save,
without packing's need for varlen attention kernels (absent on CPU). With a token budget
(``--max_tokens_per_gpu``, which launch.local passes on from the learner's
``--rollout.max_tokens_per_gpu`` under ``--train.dynamic_batch_enable``) a micro-batch instead
takes sequences, longest first, while its padded size (sequences x the longest) fits the
budget: many short sequences per forward, few long ones. The learner's twin, which also costs
packed rows and evens the count across ranks, is ``learner.algorithms.token_budget``; services
import only ``common/``.

Position ids come from the attention mask (``cumsum - 1``), so a left-padded sequence sees
the same positions as the unpadded one; pad positions get position 0 and are masked out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def length_sorted_chunks(lengths: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Indices into ``lengths``, grouped longest first into chunks of ``micro_batch_size``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]


def token_budget_chunks(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices into ``lengths``, longest first, each chunk as many as fit ``max_tokens`` padded
    tokens (``len(chunk) * longest``); a sequence longer than the budget is a chunk alone."""
    if max_tokens < 1:
        raise ValueError(f"a token budget must be >= 1, got {max_tokens}")
    chunks: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        # longest first: a chunk's first sequence is its longest, so its padded size is len x that
        if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= max_tokens:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def chunks(lengths: Sequence[int], micro_batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """``token_budget_chunks`` with a budget (``max_tokens`` > 0), else ``length_sorted_chunks``."""
    if max_tokens > 0:
        return token_budget_chunks(lengths, max_tokens)
    return length_sorted_chunks(lengths, micro_batch_size)


def pad(
    seqs: Sequence[torch.Tensor], pad_id: int, side: str, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-D int tensors -> ``(input_ids, attention_mask, position_ids)``, each ``(B, T)``.

    ``side`` is "left" (every sequence ends at column T-1) or "right" (every sequence starts
    at column 0).
    """
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    b, t = len(seqs), max((len(s) for s in seqs), default=0)
    ids = torch.full((b, t), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((b, t), dtype=torch.long)  # (B, T)
    for i, s in enumerate(seqs):
        n = len(s)
        if n == 0:
            continue
        cols = slice(t - n, t) if side == "left" else slice(0, n)
        ids[i, cols] = s
        mask[i, cols] = 1
    pos = (mask.cumsum(-1) - 1).clamp_(min=0)  # (B, T)
    return ids.to(device), mask.to(device), pos.to(device)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Column of the last non-pad token of each row of a ``(B, T)`` mask, for either padding side.

    The learner's twin is ``learner.algorithms.kl.last_token_index``; services import only ``common/``,
    so this one stays. They agree on every row with a token; an empty row gives T-1 here, -1 there
    (the same column when used as an index).
    """
    t = mask.shape[1]
    return t - 1 - mask.flip(-1).argmax(-1)  # (B,)
