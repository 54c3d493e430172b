"""Advantage estimators for PPO / REINFORCE++ / RLOO / GRPO / Dr. GRPO, as pure functions.

Every estimator in ``ADVANTAGE_ESTIMATORS`` has the same keyword signature::

    advantages, returns = ADVANTAGE_ESTIMATORS[name](
        rewards,            # (B,)   scalar reward per sequence (after learner.algorithms.shaping)
        mask,               # (B, T) valid response tokens
        group_size=G,       # samples per prompt; rewards are B // G consecutive groups of G
        values=None,        # (B, T) critic values, "gae" only
        kl=None,            # (B, T) per-token KL (learner.algorithms.kl.compute_kl) for KL-in-reward
        kl_coef=0.0,        # beta for KL-in-reward (controller.value)
        gamma=1.0, lambd=1.0,
        std_norm=True,      # divide by the (global / group) std where the estimator does
        dist_reduce=None,   # sum across data-parallel ranks, for global whitening
    )

The pipeline follows OpenRLHF's ``compute_advantages_and_returns``:

1. group shaping of the scalar rewards (rloo / reinforce_baseline / group_norm / dr_grpo);
2. per-token rewards ``-kl_coef * kl_t`` plus the scalar at the last valid token
   (``learner.algorithms.kl.kl_penalized_rewards``);
3. GAE (``gae``) or discounted returns (the rest); with no KL in the reward and gamma = 1
   this broadcasts the shaped scalar over the response tokens;
4. whitening over the GLOBAL batch for gae / reinforce / reinforce_baseline.

Shape glossary: B sequences (local), G group size, T response tokens, V vocab.

Data parallelism. Group statistics (steps 1) are exact as long as a group is never split
across ranks: keep the G samples of a prompt on one rank. Whitening (step 4) is over every
valid token of every rank: pass ``dist_reduce`` (e.g. ``dist_sum(group)``), a callable that
returns the element-wise SUM of a tensor over ranks; mean and variance are then computed
from all-reduced sums, exactly as if one rank held the whole batch.

Tests: ``pytest tests/unit/algorithms/test_advantages.py tests/unit/rl/test_dp_invariance.py`` (hand-computed values;
2 gloo ranks reproduce the single-rank whitening).

Differences from OpenRLHF:
* masked positions in the middle of a response (tool output in multi-turn) are skipped by
  GAE and the returns recursion (the value/return carries over them) instead of being
  treated as zero-reward steps; for right padding the two are identical;
* estimators that need a group baseline reject G < 2 with a ValueError instead of
  producing NaN (group_norm) or all-zero advantages (the others);
* a gamma != 1 for a group estimator is an error, where OpenRLHF silently resets it to 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from learner.algorithms.kl import kl_penalized_rewards

__all__ = [
    "DistReduce",
    "dist_sum",
    "group_view",
    "masked_whiten",
    "discounted_returns",
    "gae_advantages",
    "ADVANTAGE_ESTIMATORS",
    "compute_advantages",
]

DistReduce = Callable[[torch.Tensor], torch.Tensor]
"""Element-wise SUM of a tensor over data-parallel ranks (identity on one rank)."""

GROUP_NORM_EPS = 1e-9  # OpenRLHF's epsilon in (r - mean) / (std + eps)
WHITEN_VAR_EPS = 1e-8  # OpenRLHF clamps the variance, not the std, at this value


def dist_sum(group=None) -> DistReduce:
    """A ``DistReduce`` over ``group`` with torch.distributed all_reduce(SUM).

    Every rank must call the returned function the same number of times in the same order
    (it is a collective). Returns a new tensor; the argument is not modified.
    """
    import torch.distributed as dist

    def _reduce(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    return _reduce


def group_view(rewards: torch.Tensor, group_size: int, *, min_group: int = 1, estimator: str = "") -> torch.Tensor:
    """Rewards (B,) as (B // G, G): row i is the group of prompt i.

    Raises ValueError if rewards is not 1-D, if G < ``min_group``, or if B % G != 0.
    """
    who = f"{estimator}: " if estimator else ""
    if rewards.dim() != 1:
        raise ValueError(f"{who}rewards must be (B,), got shape {tuple(rewards.shape)}")
    if group_size < min_group:
        raise ValueError(
            f"{who}group_size (samples per prompt) must be >= {min_group} for this estimator, got {group_size}; "
            f"it needs other samples of the same prompt as a baseline"
        )
    B = rewards.shape[0]
    if B % group_size != 0:
        raise ValueError(
            f"{who}batch of {B} rewards is not a whole number of groups of {group_size}; "
            f"rewards must be laid out as consecutive groups of group_size samples per prompt"
        )
    return rewards.reshape(B // group_size, group_size)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    std_norm: bool = True,
    dist_reduce: DistReduce | None = None,
) -> torch.Tensor:
    """Whiten over all valid tokens of the global batch (REINFORCE++, Hu 2025, arXiv:2501.03262).

        N    = sum_ranks sum_{b,t} m_bt
        mu   = sum_ranks sum m_bt x_bt / N
        var  = sum_ranks sum m_bt (x_bt - mu)^2 / N            (population variance)
        out  = (x - mu) / sqrt(max(var, 1e-8))                 (or x - mu if not std_norm)

    Two all-reduces (sum and count, then squared deviations), so the result is exactly the
    single-rank result on the concatenated batch. All-equal inputs give 0, not NaN.

    Args:
        x: (B, T) advantages.
        mask: (B, T) valid tokens.
        std_norm: divide by the std (False = only centre).
        dist_reduce: SUM over data-parallel ranks; None = this rank holds the whole batch.
    Returns:
        (B, T) float32, zero at masked positions.
    """
    m = mask.to(torch.float32)  # (B, T)
    x = x.float()
    stats = torch.stack([(x * m).sum(), m.sum()])  # (2,)
    if dist_reduce is not None:
        stats = dist_reduce(stats)
    total, count = stats[0], stats[1].clamp(min=1.0)
    mean = total / count
    centred = (x - mean) * m  # (B, T)
    if not std_norm:
        return centred
    sq = centred.square().sum()
    if dist_reduce is not None:
        sq = dist_reduce(sq)
    var = sq / count
    return centred * var.clamp(min=WHITEN_VAR_EPS).rsqrt()


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go G_t = sum_{s >= t, s valid} gamma^(#valid tokens in (t, s]) R_s.

    Reverse recursion over valid tokens: G_t = R_t + gamma * G_next, where G_next is the
    return of the next valid token (masked positions are skipped and get 0).

    Args:
        token_rewards: (B, T) per-token rewards (``kl_penalized_rewards``).
        mask: (B, T) valid tokens.
        gamma: discount.
    Returns:
        (B, T) float32.
    """
    m = mask.to(torch.float32)
    r = token_rewards.float() * m
    returns = torch.zeros_like(r)  # (B, T)
    running = torch.zeros(r.shape[0], dtype=torch.float32, device=r.device)  # (B,)
    for t in reversed(range(r.shape[1])):
        new = r[:, t] + gamma * running
        running = m[:, t] * new + (1.0 - m[:, t]) * running
        returns[:, t] = m[:, t] * new
    return returns


def gae_advantages(
    values: torch.Tensor,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

        delta_t = R_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lambd * A_next
        ret_t   = A_t + V_t

    where "next" is the next VALID token (V_next = A_next = 0 after the last one): the
    reverse recursion skips masked positions, so right padding is the episode end.

    Args:
        values: (B, T) critic values V_t at the collection time.
        token_rewards: (B, T) per-token rewards.
        mask: (B, T) valid tokens.
        gamma, lambd: discount and GAE lambda.
    Returns:
        advantages (B, T), returns (B, T); float32, zero at masked positions, no grad.
    """
    m = mask.to(torch.float32)
    v = values.detach().float() * m
    r = token_rewards.detach().float() * m
    B, T = r.shape
    advantages = torch.zeros_like(r)  # (B, T)
    next_value = torch.zeros(B, dtype=torch.float32, device=r.device)  # (B,)
    next_adv = torch.zeros_like(next_value)  # (B,)
    for t in reversed(range(T)):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = delta + gamma * lambd * next_adv
        advantages[:, t] = mt * adv
        next_adv = mt * adv + (1.0 - mt) * next_adv
        next_value = mt * v[:, t] + (1.0 - mt) * next_value
    returns = advantages + v
    return advantages, returns


# --- estimators ----------------------------------------------------------------------------


def _token_returns(scalar: torch.Tensor, mask, kl, kl_coef, gamma) -> torch.Tensor:
    kl = torch.zeros_like(mask, dtype=torch.float32) if kl is None else kl
    token_rewards = kl_penalized_rewards(scalar, kl, mask, kl_coef)  # (B, T)
    return discounted_returns(token_rewards, mask, gamma)


def _require_gamma_one(name: str, gamma: float) -> None:
    if gamma != 1.0:
        raise ValueError(f"{name}: gamma must be 1.0 for a group-baseline estimator, got {gamma}")


def _check_shapes(rewards: torch.Tensor, mask: torch.Tensor) -> None:
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"expected rewards (B,) and mask (B, T), got {tuple(rewards.shape)} and {tuple(mask.shape)}")


@torch.no_grad()
def gae(
    rewards,
    mask,
    *,
    group_size=1,
    values=None,
    kl=None,
    kl_coef=0.0,
    gamma=1.0,
    lambd=1.0,
    std_norm=True,
    dist_reduce=None,
):
    """PPO with a critic: GAE on KL-penalised token rewards, then global whitening.

    A = whiten(GAE(V, -beta*kl + r*[last])), ret = GAE advantages + V (un-whitened).
    Schulman et al. 2017 (PPO, arXiv:1707.06347); Ouyang et al. 2022 (InstructGPT).
    ``values`` is required; ``group_size`` is ignored.
    Shapes: rewards (B,), mask (B, T), values (B, T), kl (B, T) or None -> advantages, returns (B, T).
    """
    _check_shapes(rewards, mask)
    if values is None:
        raise ValueError("gae: values (B, T) from the critic are required")
    kl = torch.zeros_like(mask, dtype=torch.float32) if kl is None else kl
    token_rewards = kl_penalized_rewards(rewards, kl, mask, kl_coef)  # (B, T)
    advantages, returns = gae_advantages(values, token_rewards, mask, gamma, lambd)
    return masked_whiten(advantages, mask, std_norm=std_norm, dist_reduce=dist_reduce), returns


@torch.no_grad()
def reinforce(
    rewards,
    mask,
    *,
    group_size=1,
    values=None,
    kl=None,
    kl_coef=0.0,
    gamma=1.0,
    lambd=1.0,
    std_norm=True,
    dist_reduce=None,
):
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns, globally whitened.

    ret_t = sum_{s>=t} gamma^(s-t) (-beta*kl_s + r*[s last]);  A = whiten_global(ret).
    No critic, no group baseline (``group_size``, ``values``, ``lambd`` ignored).
    Shapes: rewards (B,), mask (B, T), kl (B, T) or None -> advantages, returns (B, T).
    """
    _check_shapes(rewards, mask)
    returns = _token_returns(rewards, mask, kl, kl_coef, gamma)  # (B, T)
    return masked_whiten(returns, mask, std_norm=std_norm, dist_reduce=dist_reduce), returns


@torch.no_grad()
def reinforce_baseline(
    rewards,
    mask,
    *,
    group_size=1,
    values=None,
    kl=None,
    kl_coef=0.0,
    gamma=1.0,
    lambd=1.0,
    std_norm=True,
    dist_reduce=None,
):
    """REINFORCE++-baseline (Hu 2025): subtract the group mean, then whiten globally.

    r'_i = r_i - mean_{j in group(i)} r_j;  ret = returns(-beta*kl + r'*[last]);
    A = whiten_global(ret). Needs G >= 2.
    Shapes: rewards (B,) in groups of G, mask (B, T), kl (B, T) or None -> advantages, returns (B, T).
    """
    _check_shapes(rewards, mask)
    _require_gamma_one("reinforce_baseline", gamma)
    g = group_view(rewards.float(), group_size, min_group=2, estimator="reinforce_baseline")  # (B//G, G)
    shaped = (g - g.mean(dim=1, keepdim=True)).reshape(-1)  # (B,)
    returns = _token_returns(shaped, mask, kl, kl_coef, gamma)
    return masked_whiten(returns, mask, std_norm=std_norm, dist_reduce=dist_reduce), returns


@torch.no_grad()
def rloo(
    rewards,
    mask,
    *,
    group_size=1,
    values=None,
    kl=None,
    kl_coef=0.0,
    gamma=1.0,
    lambd=1.0,
    std_norm=True,
    dist_reduce=None,
):
    """RLOO (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019): leave-one-out baseline.

    r'_i = r_i - (sum_{j in group(i)} r_j - r_i) / (G - 1);  A = ret = returns(-beta*kl + r'*[last]).
    Not whitened (``std_norm``, ``dist_reduce`` ignored). Needs G >= 2.
    Shapes: rewards (B,) in groups of G, mask (B, T), kl (B, T) or None -> advantages, returns (B, T).
    """
    _check_shapes(rewards, mask)
    _require_gamma_one("rloo", gamma)
    g = group_view(rewards.float(), group_size, min_group=2, estimator="rloo")  # (B//G, G)
    G = g.shape[1]
    baseline = (g.sum(dim=1, keepdim=True) - g) / (G - 1)  # (B//G, G)
    returns = _token_returns((g - baseline).reshape(-1), mask, kl, kl_coef, gamma)
    return returns.clone(), returns


def _group_centred(name: str, rewards, mask, group_size, kl, kl_coef, gamma, std_norm):
    _check_shapes(rewards, mask)
    _require_gamma_one(name, gamma)
    g = group_view(rewards.float(), group_size, min_group=2, estimator=name)  # (B//G, G)
    shaped = g - g.mean(dim=1, keepdim=True)
    if std_norm:
        shaped = shaped / (g.std(dim=1, keepdim=True) + GROUP_NORM_EPS)
    returns = _token_returns(shaped.reshape(-1), mask, kl, kl_coef, gamma)  # (B, T)
    return returns.clone(), returns


@torch.no_grad()
def group_norm(
    rewards,
    mask,
    *,
    group_size=1,
    values=None,
    kl=None,
    kl_coef=0.0,
    gamma=1.0,
    lambd=1.0,
    std_norm=True,
    dist_reduce=None,
):
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): group-normalised outcome reward.

    r'_i = (r_i - mean_g) / (std_g + 1e-9), std_g the UNBIASED (G - 1) sample std as in
    OpenRLHF; ``std_norm=False`` keeps only r_i - mean_g (= dr_grpo). A group of equal
    rewards gives 0. A = ret = returns(-beta*kl + r'*[last]); not whitened (``dist_reduce``
    ignored). Needs G >= 2.
    Shapes: rewards (B,) in groups of G, mask (B, T), kl (B, T) or None -> advantages, returns (B, T).
    """
    return _group_centred("group_norm", rewards, mask, group_size, kl, kl_coef, gamma, std_norm)


@torch.no_grad()
def dr_grpo(
    rewards,
    mask,
    *,
    group_size=1,
    values=None,
    kl=None,
    kl_coef=0.0,
    gamma=1.0,
    lambd=1.0,
    std_norm=True,
    dist_reduce=None,
):
    """Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): GRPO without the std division.

    r'_i = r_i - mean_g;  A = ret = returns(-beta*kl + r'*[last]). ``std_norm`` is ignored
    (there is no std here). Pair it with aggregation "seq_mean_token_sum_norm". Needs G >= 2.
    Shapes: rewards (B,) in groups of G, mask (B, T), kl (B, T) or None -> advantages, returns (B, T).
    """
    return _group_centred("dr_grpo", rewards, mask, group_size, kl, kl_coef, gamma, False)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": gae,
    "reinforce": reinforce,
    "reinforce_baseline": reinforce_baseline,
    "rloo": rloo,
    "group_norm": group_norm,
    "dr_grpo": dr_grpo,
}


def compute_advantages(estimator: str, rewards: torch.Tensor, mask: torch.Tensor, **kwargs):
    """``ADVANTAGE_ESTIMATORS[estimator](rewards, mask, **kwargs)`` with a clear unknown-name error.

    Returns:
        advantages (B, T), returns (B, T): float32, zero at masked positions, no grad.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[estimator](rewards, mask, **kwargs)
