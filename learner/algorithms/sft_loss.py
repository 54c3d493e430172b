"""The SFT loss as a pure function: next-token NLL on response tokens only.

Shape glossary::

    B  rows in the micro-batch (one row per sample, or ONE packed row of several samples)
    T  tokens per row
    V  vocabulary size

Labels arrive already shifted (``labels[:, t]`` is the token that ``logits[:, t]`` predicts)
and hold ``IGNORE_INDEX`` wherever no loss is taken: prompt tokens, padding, and the last
position of each sample (whose "next token" would be the next packed sample's first).
Shifting per sample in the collator, rather than once per row here, is what lets the same
loss serve padded and packed rows.

Aggregation takes the token count of the whole optimizer step over all ranks
(``global_tokens``), so every response token weighs the same however tokens fall into
micro-batches and ranks (OpenRLHF averages per micro-batch, which over-weights tokens of
short micro-batches). DeepSpeed averages gradients over ranks and accumulation steps, so
the trainer multiplies this loss by ``world_size * grad_accum`` (see ``learner.algorithms.losses``).
"""

from __future__ import annotations

import torch

from learner.algorithms.losses import log_probs_from_logits

IGNORE_INDEX = -100


def sft_loss(
    logits: torch.Tensor, labels: torch.Tensor, *, global_tokens: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sum_t -log p(labels_t) [labels_t != IGNORE] / global_tokens``.

    Args:
        logits: (B, T, V) next-token logits.
        labels: (B, T) target ids, ``IGNORE_INDEX`` where no loss is taken.
        global_tokens: response tokens in the whole optimizer step on all ranks (> 0).
    Returns:
        the loss (this micro-batch's share) and metrics: ``nll`` (local mean over its
        response tokens) and ``tokens`` (its response-token count), detached.
    """
    mask = labels != IGNORE_INDEX  # (B, T)
    logp = log_probs_from_logits(logits, labels.masked_fill(~mask, 0))  # (B, T) float32
    return sft_loss_of_logprobs(logp, labels, global_tokens=global_tokens)


def sft_loss_of_logprobs(
    logp: torch.Tensor, labels: torch.Tensor, *, global_tokens: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sft_loss`` from the labels' log-probs (B, T) (float32; any value where a label is
    ``IGNORE_INDEX``), as the tiled path (``--ds.logits_tile_tokens``) gives them without logits."""
    if global_tokens <= 0:
        raise ValueError(f"global_tokens must be > 0, got {global_tokens}")
    mask = labels != IGNORE_INDEX  # (B, T)
    nll_sum = -torch.where(mask, logp, torch.zeros_like(logp)).sum()
    n = mask.sum()
    metrics = {"nll": (nll_sum / n.clamp(min=1)).detach(), "tokens": n.detach().float()}
    return nll_sum / global_tokens, metrics
