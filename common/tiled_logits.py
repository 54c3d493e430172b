"""Token log-probs and entropy of a causal LM computed in tiles of rows, so that the (rows x V)
logits never exist whole, neither in forward nor in backward.

Why: at long responses and large vocabularies (SmolLM2: 49k, Qwen: 152k) the logits of the
response positions, and their gradient, are the largest tensors of a training step: 8 sequences
of 16k tokens with a 152k vocabulary are 80 GB of fp32 logits, most of which only ever feed a
log-softmax that keeps one number per token. Here the head sees one tile of ``tile_tokens`` rows
at a time.

How, in two parts:

* ``head_inputs`` runs the model's own forward (a DeepSpeed engine, a peft model, ZeRO-3's
  gathering hooks, gradient checkpointing: all as they are) with a forward pre-hook on the output
  head that keeps the head's input (the final hidden states of the columns ``logits_to_keep``
  picked) and hands the head zero rows of it, so the model's own projection costs nothing;
* ``token_logprobs`` projects tiles of those rows through the head (the module: ZeRO-3 gathers its
  weight when it is called) and computes each tile's log-probs (and entropy) in fp32. When autograd
  records, each tile runs under ``torch.utils.checkpoint`` (non-reentrant): forward keeps only the
  tile's hidden rows, backward recomputes the tile's logits, takes their gradient and drops them
  before the next tile's (autograd runs the tiles' backward one after another). The head weight's
  gradient is summed over the tiles by autograd before it reaches the parameter's one
  ``AccumulateGrad``, so gradient hooks (DeepSpeed's ZeRO-1/2 reduction, ZeRO-3's partitioning)
  fire once per backward, as untiled.

The cost is one more pass of the head per tile in backward (the recompute): measured by
``bench/long_context.py`` (docs/long-context.md). The numbers are those of the untiled path to
fp32 rounding (``tests/unit/common/test_tiled_logits.py``).

What DeepSpeed 0.19's ``deepspeed.runtime.sequence_parallel.ulysses_sp`` offers and why it is not
used here (docs/long-context.md says more): ``TiledFusedLogitsLoss`` returns one reduced scalar
loss and runs the tiles' backward inside its forward, so the head's weight gradient is made before
the caller's loss scaling (DeepSpeed's 1/accumulation, our world x accumulation factor) and its
backward rescales only the hidden states' gradient; the RL losses need per-token log-probs (ratio,
KL, clipping, metrics), not a scalar. ``sequence_tiled_compute`` returns per-tile outputs but views
the incoming gradient as the input's shape (it is built for the MLP, whose output is shaped as its
input), so a (rows,) output of (rows, H) input does not fit; both toggle ``ds_grad_is_ready`` per
shard because they call backward per shard, which the checkpoint here does not need.

Models whose forward changes the logits after the head (soft-capping, a logit scale) or that cannot
project selected columns (no ``logits_to_keep``) are not tiled: ``untileable_reason`` says why and
the callers keep the whole-logits path for them.

Torch only: shared by the learner and the reward service's reference model.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["ENTROPY", "tile_bounds", "untileable_reason", "head_inputs", "token_logprobs"]

# What token_logprobs computes of the entropy: nothing, with its gradient (in the loss), or as a
# metric only (no graph, computed in forward and not again in the backward's recompute).
ENTROPY = ("none", "grad", "metric")

# Config fields of transformers models whose forward changes the logits after the head; a tiled
# path that skipped them would compute other numbers (Gemma 2/3's soft-capping, Cohere's scale,
# Granite's divisor).
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def tile_bounds(rows: int, tile_tokens: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each tile of ``rows`` rows: ``tile_tokens`` each, the last the rest;
    one tile of everything when ``tile_tokens <= 0`` (tiling off); none for zero rows."""
    if rows <= 0:
        return []
    step = rows if tile_tokens <= 0 else tile_tokens
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


@functools.cache
def _takes_logits_to_keep(forward: Callable[..., Any]) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


def untileable_reason(hf_model: torch.nn.Module) -> str | None:
    """Why the tiled path cannot reproduce this HF causal LM's logits, or None when it can.

    ``hf_model``: the transformers model itself (unwrapped from DeepSpeed and peft)."""
    if not _takes_logits_to_keep(type(hf_model).forward):
        return f"{type(hf_model).__name__}.forward takes no logits_to_keep (it would project every column)"
    head = hf_model.get_output_embeddings()
    if not isinstance(head, torch.nn.Module):
        return f"{type(hf_model).__name__} has no output embeddings module (get_output_embeddings)"
    if any(hasattr(p, "ds_id") for p in head.parameters()):
        # ZeRO-3 partitions the head: each tile's call would all-gather its weight (a collective,
        # and ranks hold different numbers of tiles), and a tile recomputed in backward finds the
        # weight released (seen with LoRA's frozen head: "Recomputed values ... different metadata").
        return "ZeRO-3 partitions its output head (a tile per gather would differ between ranks)"
    config = getattr(hf_model, "config", None)
    for name in _LOGIT_POSTPROCESSING:
        value = getattr(config, name, None)
        if value not in (None, 0, 1, 0.0, 1.0):
            return f"its config's {name}={value} changes the logits after the head"
    return None


def head_inputs(model: Callable[..., Any], head: torch.nn.Module, **forward_kwargs: Any) -> torch.Tensor:
    """The output head's input in ``model(**forward_kwargs)``: (N, C, H), C the columns that
    ``logits_to_keep`` (in ``forward_kwargs``) selects; the head itself is handed zero of them.

    ``model``: what the trainer calls (a DeepSpeed engine, a peft model, an HF model); ``head``:
    its HF model's ``get_output_embeddings()``. The model must call the head exactly once."""
    captured: list[torch.Tensor] = []

    def keep_and_skip(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        captured.append(hidden)
        return (hidden[..., :0, :], *args[1:])  # the model's own projection: no rows

    handle = head.register_forward_pre_hook(keep_and_skip)
    try:
        model(**forward_kwargs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(
            f"the model called its output head {len(captured)} times in one forward; the tiled log-probs "
            "(--ds.logits_tile_tokens) need exactly one call (set --ds.logits_tile_tokens 0 for this model)"
        )
    return captured[0]


def _entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v per row of (n, V) fp32 ``z``; ``lse`` (n, 1)."""
    p = torch.exp(z - lse)
    # A -inf logit (masked vocabulary entry) has p = 0 and contributes 0, not 0 * -inf = NaN.
    z_finite = torch.where(p > 0, z, torch.zeros_like(z))
    return lse.squeeze(-1) - (p * z_finite).sum(dim=-1)


class _Tile:
    """One tile's computation: head -> fp32 logits / tau -> log-prob of the label (and entropy).

    Called once in forward and, under a checkpoint, once more in backward to recompute what the
    gradient needs; a metric entropy is computed on the first call only (it has no gradient)."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], inv_tau: float, entropy: str) -> None:
        self.head = head
        self.inv_tau = inv_tau
        self.entropy = entropy
        self.calls = 0

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls += 1
        z = self.head(hidden).float()  # (n, V); fp32 even for a bf16 model (bf16 logsumexp is too coarse)
        if self.inv_tau != 1.0:
            z = z * self.inv_tau
        lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (n, 1)
        lp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse.squeeze(-1)  # (n,)
        ent = None
        if self.entropy == "grad":
            ent = _entropy(z, lse)
        elif self.entropy == "metric" and self.calls == 1:
            with torch.no_grad():  # in place: one (n, V) buffer beside the logits
                pz = torch.sub(z, lse).exp_().mul_(z)  # p_v z_v; a -inf logit gives 0 * -inf = NaN, read as 0
                ent = lse.squeeze(-1) - pz.nan_to_num_(nan=0.0).sum(dim=-1)
        return lp, ent


def token_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    tile_tokens: int = 256,
    entropy: str = "none",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(h) / tau)[y] per row, and the entropy of softmax(head(h) / tau), tile by tile.

    Args:
        head: the output head (the module, so that ZeRO-3 gathers its weight per call).
        hidden: (R, H) hidden states, row r the one that predicts ``labels[r]``.
        labels: (R,) token ids.
        temperature: tau, the sampling temperature.
        tile_tokens: rows per tile (<= 0: one tile of all rows, the whole logits at once).
        entropy: one of ``ENTROPY``: "grad" in the loss, "metric" for logging (detached).
    Returns:
        ``(log_probs (R,), entropy (R,) or None)``, float32.
    """
    if entropy not in ENTROPY:
        raise ValueError(f"entropy={entropy!r}: one of {', '.join(ENTROPY)}")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden (R, H) and labels (R,) expected, got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    labels = labels.long()
    record = torch.is_grad_enabled()
    lps: list[torch.Tensor] = []
    ents: list[torch.Tensor] = []
    for start, stop in tile_bounds(hidden.shape[0], tile_tokens):
        tile = _Tile(head, 1.0 / temperature, entropy)
        h, y = hidden[start:stop], labels[start:stop]
        # Under autograd only the tile's hidden rows are kept; its logits are made again in backward.
        lp, ent = checkpoint(tile, h, y, use_reentrant=False) if record else tile(h, y)
        lps.append(lp)
        if ent is not None:
            ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if entropy != "none" else None)
    return torch.cat(lps), (torch.cat(ents) if entropy != "none" else None)
