"""A rank's micro-batches for one pass of the RL learner: a fixed sample count or a token budget.

Every learner pass (the policy's training forward/backward, the old-log-probs pass, the
critic's old values and its training) runs its samples in micro-batches planned here:

* fixed (the default): ``--train.micro_batch_size`` (training) or ``--rollout.micro_batch_size``
  (no-grad passes) samples each, in order;
* token budget (``--train.dynamic_batch_enable``): groups whose tokens fit
  ``--train.max_tokens_per_gpu`` (training) or ``--rollout.max_tokens_per_gpu`` (no-grad
  passes), packed or padded as the pass collates them (``learner.algorithms.token_budget``).

Every rank runs the same number of micro-batches. Under ZeRO-3 each forward gathers the
parameters and each backward reduce-scatters the gradients (ZeRO-2 reduces after every
backward too): collectives, which hang if one rank runs a micro-batch the others do not. A
token budget gives each rank its own count (its slice's lengths), so the count is all-reduced
(MAX) and each rank cuts its groups up to it (``token_budget_groups(count=...)``); a rank with
fewer samples than that gets empty groups, for which the caller runs a stand-in micro-batch
(one of its samples) whose loss is multiplied by 0.

How the optimizer steps at the right boundary with a variable number of micro-batches:
DeepSpeed's ``gradient_accumulation_steps`` is fixed per engine (``--train.batch_size /
(--train.micro_batch_size x ranks)``) and its own counter would step the optimizer after that
many backwards. The trainer plans a train batch's micro-batches first and opens the optimizer
step's window with their number (``learner.runtime.accumulation.OptimizerStep(micro_batches=n)``):
the window sets DeepSpeed's accumulation boundary itself, False before each backward but the
last, True before the last, and calls ``engine.step()`` once after it (DeepSpeed's documented
``set_gradient_accumulation_boundary`` pattern), so the optimizer steps exactly once per train
batch whatever n is. The losses are unchanged: each micro-batch's loss is its share of the
train batch's loss, divided by the GLOBAL token or sequence count of the whole train batch
(``learner.algorithms.losses.AggSpec``), and scaled by ``ranks x gradient_accumulation_steps``
to undo DeepSpeed's fixed division and its mean over ranks; the shares sum to the whole
batch's loss however the samples are grouped, for every ``--loss_agg_mode`` (token_mean divides
by the global tokens, the seq_mean_* modes sum per-sequence terms over the global sequence
count), and so do the gradients (``tests/unit/rl/test_dynamic_batch.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from learner.algorithms.token_budget import token_budget_groups
from learner.controller.types import ScoredSample

__all__ = ["plan_micro_batches"]


def plan_micro_batches(
    samples: Sequence[ScoredSample],
    idx: Sequence[int],
    *,
    size: int,
    max_tokens: int = 0,
    packed: bool = False,
    max_local: int | None = None,
    device: torch.device | str = "cpu",
) -> list[list[int]]:
    """This rank's micro-batches over ``samples[i] for i in idx``: lists of entries of ``idx``.

    ``max_tokens`` 0: chunks of ``size`` in order, as many on every rank as the rank holding
    ``max_local`` samples (default ``len(idx)``) needs; no collective. ``max_tokens`` > 0: a
    token budget (``packed``: costed as one packed row, else as a padded batch), the count the
    same on every rank: an all-reduce, so every rank calls this together. An empty list stands
    for a micro-batch this rank has no sample for (see the module doc).
    """
    idx = list(idx)
    if max_tokens <= 0:
        groups = [idx[m : m + size] for m in range(0, len(idx), size)]
        count = math.ceil((len(idx) if max_local is None else max_local) / size)
        return groups + [[] for _ in range(count - len(groups))]
    prompt_lens = [len(samples[i].prompt) for i in idx]
    response_lens = [len(samples[i].response) for i in idx]
    pos = token_budget_groups(prompt_lens, response_lens, max_tokens, packed=packed)
    count = _max_over_ranks(len(pos), device)
    if count != len(pos):
        pos = token_budget_groups(prompt_lens, response_lens, max_tokens, packed=packed, count=count)
    return [[idx[p] for p in g] for g in pos]


def _max_over_ranks(n: int, device: torch.device | str) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.long, device=device)  # on the rank's device: NCCL reduces CUDA tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
