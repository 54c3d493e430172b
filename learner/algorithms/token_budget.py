"""Token-budget micro-batches: samples grouped so that each group's tokens fit a budget.

OpenRLHF's ``--train.dynamic_batch_enable`` forms micro-batches by a number of tokens
(``--train.max_tokens_per_gpu``, ``--rollout.max_tokens_per_gpu``) instead of a number of
samples: a batch of very uneven lengths then runs few large micro-batches of short samples and
small ones of long samples, where a fixed sample count must be sized for the longest.

The cost of a micro-batch is the tokens the learner's forward computes
(``learner.rl.experience.collate``):

* packed (``--packing_samples``: one row, no padding): ``sum_i (p_i + t_i)``;
* padded (prompts left-padded to the longest prompt, responses right-padded to the longest
  response): ``n * (max_i p_i + max_i t_i)``.

``token_budget_groups`` forms them in two stages:

1. the fewest groups it finds within the budget. A sample whose own cost exceeds the budget
   goes alone (a micro-batch never cuts a sample). Packed: for k = ceil(total / budget),
   k + 1, ..., the longest-first rule (each sample, longest first, to the lightest of k groups;
   Graham's LPT, within 4/3 of the best possible heaviest group) until every group fits, which
   also balances the groups. Padded: longest first, each group taking the next sample while
   its padded cost fits (sorted lengths keep the padding small);
2. with ``count`` (every data-parallel rank must run as many forwards and backwards as the
   others, see ``learner.rl.micro_batches``): the heaviest group of two or more samples is cut
   in two, balanced, until there are ``count``; when every group holds one sample, the rest are
   empty (the caller runs a stand-in micro-batch of weight 0 for each). Cutting a group never
   makes a part cost more than the whole, so the budget still holds.

Groups come heaviest first (an out-of-memory shows on the first micro-batch), each listing its
indices in ascending order. Differs from OpenRLHF (which counts bins first-fit and then
balances a partition into that many, Karmarkar-Karp, without re-checking the budget): here
every group of two or more samples is within the budget, and padded micro-batches are costed
as padded.

Pure Python on lists of ints (no tensors needed); imports nothing of the project.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

__all__ = ["micro_batch_cost", "token_budget_groups"]


def micro_batch_cost(
    prompt_lens: Sequence[int], response_lens: Sequence[int], group: Sequence[int], packed: bool
) -> int:
    """Tokens a forward over the samples ``group`` computes: packed ``sum(p + t)``, padded
    ``n * (max p + max t)``; 0 for an empty group."""
    if not group:
        return 0
    if packed:
        return sum(prompt_lens[i] + response_lens[i] for i in group)
    return len(group) * (max(prompt_lens[i] for i in group) + max(response_lens[i] for i in group))


def token_budget_groups(
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    max_tokens: int,
    *,
    packed: bool,
    count: int | None = None,
) -> list[list[int]]:
    """Indices ``0 .. N-1`` grouped into micro-batches of at most ``max_tokens`` tokens each.

    Args:
        prompt_lens: (N,) prompt tokens of each sample.
        response_lens: (N,) response tokens of each sample.
        max_tokens: the budget of one micro-batch (``micro_batch_cost``), > 0.
        packed: cost as one packed row (True) or as a padded batch (False).
        count: exactly this many groups (some empty when N < count); at least the number the
            budget needs (None: that number). The same on every rank makes the ranks' forward
            counts equal.
    Returns:
        the groups, heaviest first, each ascending; every index in exactly one group.
    """
    if max_tokens < 1:
        raise ValueError(f"a token budget must be >= 1, got {max_tokens}")
    n = len(prompt_lens)
    if len(response_lens) != n:
        raise ValueError(f"{n} prompt lengths for {len(response_lens)} response lengths")

    def cost(group: Sequence[int]) -> int:
        return micro_batch_cost(prompt_lens, response_lens, group, packed)

    def longest_first(group: Sequence[int]) -> list[int]:
        return sorted(group, key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))

    groups = (
        _packed_groups(longest_first(range(n)), cost, max_tokens)
        if packed
        else _padded_groups(longest_first(range(n)), cost, max_tokens)
    )
    if count is not None:
        if count < len(groups):
            raise ValueError(f"{n} samples need {len(groups)} micro-batches of {max_tokens} tokens, not {count}")
        groups = _split_to(groups, count, cost, lambda g: _halve(longest_first(g), cost, packed))
    groups = [sorted(g) for g in groups]
    return sorted(groups, key=lambda g: (-cost(g), g[0] if g else math.inf))


def _packed_groups(order: list[int], cost: Callable[[Sequence[int]], int], budget: int) -> list[list[int]]:
    alone = [[i] for i in order if cost([i]) > budget]
    rest = [i for i in order if cost([i]) <= budget]
    if not rest:
        return alone
    k = max(1, math.ceil(sum(cost([i]) for i in rest) / budget))
    while True:  # k = len(rest) puts every sample alone, which fits: the loop ends
        groups = _lpt(rest, cost, k)
        if all(cost(g) <= budget for g in groups):
            return alone + groups
        k += 1


def _lpt(order: list[int], cost: Callable[[Sequence[int]], int], k: int) -> list[list[int]]:
    """``order`` (longest first) dealt into k groups, each sample to the lightest (ties: the
    lowest group number); packed costs add up, so a group's load is its cost."""
    groups: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, j) for j in range(k)]
    for i in order:
        load, j = heapq.heappop(heap)
        groups[j].append(i)
        heapq.heappush(heap, (load + cost([i]), j))
    return [g for g in groups if g]


def _padded_groups(order: list[int], cost: Callable[[Sequence[int]], int], budget: int) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in order:
        if groups and cost(groups[-1] + [i]) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])  # a group's first sample is taken whatever its cost: it cannot be cut
    return groups


def _halve(order: list[int], cost: Callable[[Sequence[int]], int], packed: bool) -> tuple[list[int], list[int]]:
    """Two non-empty parts of a group (``order``: longest first) whose heavier part is as light
    as the rule finds: packed, longest first to the lighter part; padded, the cut of the sorted
    order that minimises the heavier part."""
    if packed:
        a, b = _lpt(order, cost, 2)
        return a, b
    cut = min(range(1, len(order)), key=lambda c: (max(cost(order[:c]), cost(order[c:])), c))
    return order[:cut], order[cut:]


def _split_to(
    groups: list[list[int]],
    count: int,
    cost: Callable[[Sequence[int]], int],
    halve: Callable[[list[int]], tuple[list[int], list[int]]],
) -> list[list[int]]:
    groups = [list(g) for g in groups]
    while len(groups) < count:
        cuttable = [j for j, g in enumerate(groups) if len(g) >= 2]
        if not cuttable:
            return groups + [[] for _ in range(count - len(groups))]
        j = max(cuttable, key=lambda j: (cost(groups[j]), -j))
        a, b = halve(groups.pop(j))
        groups += [a, b]
    return groups
