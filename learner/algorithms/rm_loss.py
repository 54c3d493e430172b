"""Pairwise reward-model losses (Bradley-Terry) as pure functions, keyed by ``--loss``.

Shape glossary: ``B`` preference pairs. Every argument is (B,); the loss is the mean over
the micro-batch's pairs (micro-batches hold equally many pairs, so the mean of micro-batch
means is the mean of the optimizer step's pairs).

- ``sigmoid`` (InstructGPT, Ouyang et al. 2022, eq. 1):
  ``-log sigmoid(r_c - r_r - m)``;
- ``logexp``: ``log(1 + exp(r_r - r_c + m))``, the same function written as in OpenRLHF's
  ``LogExpLoss``; kept so ``--loss logexp`` scripts port. Computed as ``softplus`` here, so
  both names give bit-identical, overflow-free values.

``m`` is an optional per-pair margin (Llama 2, Touvron et al. 2023, eq. 2: a larger
required gap for more clearly preferred pairs), from the dataset's ``--margin_key`` column
with ``--margin_loss``; None means 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Metrics = dict[str, torch.Tensor]


def _gap(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None) -> torch.Tensor:
    gap = chosen.float() - rejected.float()  # (B,)
    return gap - margin.float() if margin is not None else gap


def sigmoid_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) per-pair ``-log sigmoid(chosen - rejected - margin)``."""
    return -F.logsigmoid(_gap(chosen, rejected, margin))


def logexp_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) per-pair ``log(1 + exp(rejected - chosen + margin))``."""
    return F.softplus(-_gap(chosen, rejected, margin))


RM_LOSSES: dict[str, Callable[..., torch.Tensor]] = {"sigmoid": sigmoid_loss, "logexp": logexp_loss}


def reward_model_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, *, loss: str = "sigmoid", margin: torch.Tensor | None = None
) -> tuple[torch.Tensor, Metrics]:
    """Mean pairwise loss and metrics (detached): ``acc`` (share of pairs with chosen >
    rejected), ``chosen_reward``, ``rejected_reward``, ``reward_margin`` (means)."""
    if loss not in RM_LOSSES:
        raise ValueError(f"unknown --loss {loss!r}; choose from {sorted(RM_LOSSES)}")
    per_pair = RM_LOSSES[loss](chosen, rejected, margin)  # (B,)
    c, r = chosen.detach().float(), rejected.detach().float()
    metrics = {
        "acc": (c > r).float().mean(),
        "chosen_reward": c.mean(),
        "rejected_reward": r.mean(),
        "reward_margin": (c - r).mean(),
    }
    return per_pair.mean(), metrics
