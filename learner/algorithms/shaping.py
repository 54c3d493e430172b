"""Rollout shaping on scalar rewards, before the advantage estimators (pure functions).

Order used by the trainer (as in OpenRLHF's length penalties + reward processing):
``overlong_penalty`` and ``stop_properly_penalty`` on the raw rewards, then ``clip_rewards``,
then an estimator from ``learner.algorithms.advantages``. ``dynamic_filter_mask`` decides which prompt
groups are kept at all (DAPO dynamic sampling).

Shape glossary: B sequences, G group size (B // G consecutive groups), T response tokens.

Tests: ``pytest tests/unit/algorithms/test_advantages.py`` (the shaping section).

Difference from OpenRLHF: OpenRLHF applies ``reward_clip_range`` inside ``compute_reward``,
i.e. after group normalisation; here clipping is a separate step on the raw scalar reward,
which is where the range of a reward model's score is meaningful. For PPO (no group step)
the two orders agree.
"""

from __future__ import annotations

import torch

from learner.algorithms.advantages import group_view

__all__ = ["clip_rewards", "overlong_penalty", "stop_properly_penalty", "dynamic_filter_mask"]


def clip_rewards(rewards: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """r' = min(max(r, low), high).

    Args:
        rewards: (B,) scalar rewards.
        low, high: the range, low <= high.
    Returns:
        (B,) new tensor.
    """
    if low > high:
        raise ValueError(f"reward clip range must have low <= high, got ({low}, {high})")
    return rewards.clamp(min=low, max=high)


def overlong_penalty(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    max_len: int,
    buffer_len: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

    With L_exp = max_len - buffer_len and the response length L:

        r' = r - factor * min(max(L - L_exp, 0), buffer_len) / buffer_len

    i.e. no penalty up to L_exp, then linear down to -factor at max_len and beyond.

    Args:
        rewards: (B,) scalar rewards.
        response_lengths: (B,) number of generated tokens.
        max_len: the generation limit (max_new_tokens).
        buffer_len: overlong buffer, 0 < buffer_len <= max_len.
        factor: the penalty at max_len.
    Returns:
        (B,) new tensor.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    expected = max_len - buffer_len
    exceed = (response_lengths.to(torch.float32) - expected).clamp(min=0.0, max=float(buffer_len))  # (B,)
    return rewards.float() - factor * exceed / buffer_len


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """ProRL stop-properly penalty (Liu et al. 2025, arXiv:2505.24864), OpenRLHF semantics.

    For a sample that stopped because it hit the length limit (vLLM finish_reason "length"):

        r' = coef * r      if 0 <= coef <= 1   (scale the reward down)
        r' = coef          if coef < 0         (override with a fixed negative reward)

    Samples that stopped properly are unchanged.

    Args:
        rewards: (B,) scalar rewards.
        truncated: (B,) bool, True where finish_reason == "length".
        coef: in [0, 1], or negative.
    Returns:
        (B,) new tensor.
    """
    if coef > 1:
        raise ValueError(f"stop_properly_penalty coef must be in [0, 1] or negative, got {coef}")
    r = rewards.float()
    penalised = torch.full_like(r, coef) if coef < 0 else r * coef  # (B,)
    return torch.where(truncated.bool(), penalised, r)


def dynamic_filter_mask(
    rewards: torch.Tensor,
    group_size: int,
    reward_range: tuple[float, float] | None = None,
) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al. 2025): keep groups whose rewards are not all equal.

    A group whose G rewards are identical has zero group-normalised advantage everywhere,
    so it carries no gradient. keep_g = max_j r_gj > min_j r_gj, and, when
    ``reward_range = (lo, hi)`` is given, also lo < mean_j r_gj < hi (OpenRLHF's extra
    range check, which removes all-correct / all-wrong groups of binary rewards).

    Args:
        rewards: (B,) scalar rewards, consecutive groups of G.
        group_size: G (>= 1; a group of one is never kept: it is trivially all-equal).
        reward_range: optional open interval for the group mean.
    Returns:
        (B // G,) bool, True = keep the group. Use ``.repeat_interleave(G)`` for a (B,) mask.
    """
    g = group_view(rewards, group_size, estimator="dynamic_filter_mask")  # (B//G, G)
    keep = g.amax(dim=1) > g.amin(dim=1)  # (B//G,)
    if reward_range is not None:
        lo, hi = reward_range
        mean = g.float().mean(dim=1)
        keep = keep & (mean > lo) & (mean < hi)
    return keep
