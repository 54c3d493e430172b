"""KL between the policy and the reference model: per-token estimators, KL-in-reward, controllers.

Pure functions on tensors; no process groups, no models. Used two ways (as in OpenRLHF):

* KL in the reward (PPO, REINFORCE++): ``kl_penalized_rewards`` turns a scalar reward per
  sequence into a per-token reward ``-kl_coef * kl_t``, plus the scalar at the last valid
  token; the advantage estimators in ``learner.algorithms.advantages`` consume that.
* KL as a loss (GRPO, ``use_kl_loss``): ``learner.algorithms.losses.kl_loss`` aggregates ``compute_kl``.

Shape glossary (shared by ``learner.algorithms.losses`` and ``learner.algorithms.advantages``)::

    B  sequences in the (local) batch
    G  group size: samples per prompt; a batch is B // G consecutive groups of G
    T  response tokens (right-padded; ``mask`` marks the valid ones)
    V  vocabulary size

Tests: ``pytest tests/unit/algorithms/test_kl.py`` (every function, numbers derived by hand).

Differences from OpenRLHF's ``compute_approx_kl`` / ``compute_reward``:
masked (padding) positions are zeroed here rather than left for the caller to mask, and the
optional ``clamp`` is symmetric ``[-clamp, clamp]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "KL_ESTIMATORS",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "compute_kl",
    "last_token_index",
    "kl_penalized_rewards",
    "FixedKLController",
    "AdaptiveKLController",
]


# --- per-token estimators ------------------------------------------------------------------
#
# Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.
# We estimate KL[pi || pi_ref] from tokens sampled by pi, so his ratio is
# r = pi_ref(y_t) / pi(y_t), and log r = ref_log_probs - log_probs.


def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k1 = -log r = log pi(y_t) - log pi_ref(y_t). Unbiased, high variance, can be negative.

    Args:
        log_probs: (B, T) log pi(y_t) of the sampled tokens under the policy.
        ref_log_probs: (B, T) log pi_ref(y_t) under the reference model.
    Returns:
        (B, T) float32 estimate.
    """
    return log_probs.float() - ref_log_probs.float()  # (B, T)


def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k2 = (log r)^2 / 2. Biased, low variance, >= 0. Shapes as ``kl_k1``."""
    log_r = ref_log_probs.float() - log_probs.float()  # (B, T)
    return 0.5 * log_r.square()


def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r. Unbiased, low variance, >= 0 (GRPO's KL). Shapes as ``kl_k1``."""
    log_r = ref_log_probs.float() - log_probs.float()  # (B, T)
    return torch.expm1(log_r) - log_r


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def compute_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    estimator: str = "k1",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL[pi || pi_ref] estimate, zero at masked positions.

    kl_t = KL_ESTIMATORS[estimator](log pi(y_t), log pi_ref(y_t)), clamped to
    [-clamp, clamp] when ``clamp`` is given (k3 explodes when pi_ref >> pi).

    Args:
        log_probs: (B, T) policy log-probs of the sampled tokens (may carry grad).
        ref_log_probs: (B, T) reference log-probs of the same tokens.
        mask: (B, T) 1 for valid response tokens, 0 for padding; None = all valid.
        estimator: key of ``KL_ESTIMATORS``.
        clamp: optional symmetric bound on each token's estimate.
    Returns:
        (B, T) float32.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}")
    kl = KL_ESTIMATORS[estimator](log_probs, ref_log_probs)  # (B, T)
    if clamp is not None:
        kl = kl.clamp(min=-clamp, max=clamp)
    if mask is not None:
        # where(), not multiply: inf/NaN in padding would survive 0 * inf.
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid token of each row: max{t : mask[b, t] = 1}.

    Args:
        mask: (B, T) 0/1.
    Returns:
        (B,) long; -1 for a row with no valid token.
    """
    T = mask.shape[1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)  # (B, T)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=1)


def kl_penalized_rewards(
    rewards: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """Per-token reward with the KL penalty (Ziegler et al. 2019; OpenRLHF ``compute_reward``).

        R_t = -kl_coef * kl_t + [t == last valid token] * r

    A negative ``kl_coef`` is treated as 0, as OpenRLHF does. A row with no valid token gets
    all zeros (its scalar reward has no token to sit on).

    Args:
        rewards: (B,) scalar reward per sequence (already shaped / group-normalised).
        kl: (B, T) per-token KL estimate (``compute_kl``); zeros when KL is not in the reward.
        mask: (B, T) valid response tokens.
        kl_coef: beta, e.g. ``controller.value``.
    Returns:
        (B, T) float32, zero at masked positions.
    """
    if rewards.dim() != 1 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must be (B,) with B={mask.shape[0]}, got {tuple(rewards.shape)}")
    valid = mask.bool()
    beta = max(float(kl_coef), 0.0)
    token_rewards = torch.where(valid, -beta * kl.float(), torch.zeros_like(kl, dtype=torch.float32))  # (B, T)
    last = last_token_index(mask)  # (B,)
    has_token = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    token_rewards[rows, last[has_token]] += rewards.float()[has_token]
    return token_rewards


# --- KL coefficient controllers ------------------------------------------------------------


class FixedKLController:
    """Constant KL coefficient: ``value`` never changes."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; same signature as ``AdaptiveKLController.update``."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient, Ziegler et al. 2019 (arXiv:1909.08593), section 2.2.

        e      = clip(KL_current / KL_target - 1, -0.2, 0.2)
        beta  <- beta * (1 + e * n_steps / horizon)

    ``n_steps`` is the number of samples (sequences) the measured KL was averaged over, so
    the coefficient moves by ~e per ``horizon`` samples whatever the batch size.
    """

    def __init__(self, init_kl_coef: float, kl_target: float, horizon: float):
        if kl_target <= 0 or horizon <= 0:
            raise ValueError(f"kl_target and horizon must be > 0, got {kl_target}, {horizon}")
        self.value = float(init_kl_coef)
        self.kl_target = float(kl_target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards the coefficient that would give ``kl_target``.

        Args:
            current_kl: mean per-sequence KL of the last batch (a float, already reduced
                across data-parallel ranks so that every rank computes the same value).
            n_steps: samples in that batch.
        """
        error = min(max(float(current_kl) / self.kl_target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """What a resumed run needs: the coefficient it has drifted to (target and horizon are flags)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
