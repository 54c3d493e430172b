"""On-policy distillation: a teacher's log-probs on the student's own samples, as pure functions.

The student pi samples y ~ pi; a teacher mu scores the same tokens; the student minimises the
reverse KL  KL[pi || mu] = E_{y ~ pi} sum_t (log pi(y_t | y_<t) - log mu(y_t | y_<t)) on its own
distribution (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD); Thinking Machines, "On-policy distillation", 2025). Two modes:

* **sampled token** (``sampled_token_advantage``): the per-token advantage
  ``d_t = -(log pi(y_t) - log mu(y_t))`` at the sampled token, no discount, no baseline: the
  published recipe's. Its policy-gradient step ``E[d_t grad log pi(y_t)]`` is the gradient of
  ``-KL[pi || mu]`` per position (the score function's mean is 0), and its mean over samples is
  minus the exact reverse KL (``sampled_reverse_kl``: the k1 estimator of KL[pi || mu], unbiased).
* **top-k** (``topk_divergence``): the teacher's k most likely ids at each position with their
  log-probs; the student's logits over the same ids; both renormalised over those k ids (at the
  sampling temperature); a generalised Jensen-Shannon divergence between the two, GKD's JSD(beta)
  with beta = 1 the reverse KL and beta = 0 the forward KL. With k = V it is the exact
  full-vocabulary divergence at that position. A differentiable loss term, unlike the first.

Shape glossary (as ``learner.algorithms.losses``)::

    B  sequences        T  response tokens (right-padded; ``mask`` marks the trained ones)
    K  teacher ids kept per position (``--distill_topk``)

``mask`` is the loss mask (an agent's action mask included): environment tokens get neither an
advantage nor a loss, whatever the teacher said about them.

Tests: ``pytest tests/unit/algorithms/test_distill.py`` (every function on hand-computed tensors;
the sampled-token estimator's mean equals the exact reverse KL on a toy distribution; top-k with
k = V equals the full divergence).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "sampled_reverse_kl",
    "sampled_token_advantage",
    "centered",
    "renormalized_topk",
    "generalized_jsd",
    "topk_divergence",
]


def _zero_masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x
    # where(), not multiply: a -inf teacher log-prob in padding would survive 0 * inf.
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def sampled_reverse_kl(
    log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token estimate of KL[pi || mu] from tokens sampled by pi: ``log pi(y_t) - log mu(y_t)``.

    Unbiased per position: E_{y_t ~ pi}[log pi(y_t) - log mu(y_t)] = KL[pi(.|y_<t) || mu(.|y_<t)].

    Args:
        log_probs: (B, T) student log-probs of the sampled tokens.
        teacher_log_probs: (B, T) teacher log-probs of the same tokens.
        mask: (B, T) 1 for trained tokens; None = all.
    Returns:
        (B, T) float32, 0 where masked.
    """
    if log_probs.shape != teacher_log_probs.shape:
        raise ValueError(
            f"student log-probs {tuple(log_probs.shape)} and teacher log-probs {tuple(teacher_log_probs.shape)} differ"
        )
    return _zero_masked(log_probs.float() - teacher_log_probs.float(), mask)  # (B, T)


def sampled_token_advantage(
    log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The sampled-token distillation advantage ``d_t = -(log pi(y_t) - log mu(y_t))``, no gradient.

    Added, times ``--distill_coef``, to each token's advantage (group estimators) or reward (GAE);
    alone it is the whole advantage. Shapes as ``sampled_reverse_kl``; the result is detached.
    """
    return -sampled_reverse_kl(log_probs.detach(), teacher_log_probs.detach(), mask)


def centered(advantage: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``d_t - mean(d)``, the mean over every trained token of the batch: a constant baseline.

    ``E[c grad log pi(y_t)] = 0``, so subtracting a constant leaves the expected gradient as it
    is, while the sampled one loses the push that a mean of ``d`` far from 0 (a teacher far from
    the student: ``d`` about ``-KL`` on most tokens) gives every sampled token alike -- noise that
    on the tiny model's near-uniform 768-id distributions outweighed the signal (docs/
    distillation.md). Taken over the whole batch (every rank holds it), so the same on every rank.

    Args:
        advantage: (B, T) ``sampled_token_advantage``, zero where masked.
        mask: (B, T) trained tokens.
    Returns:
        (B, T) float32, zero where masked.
    """
    m = mask.bool()
    n = m.sum()
    if not int(n):
        return advantage
    mean = torch.where(m, advantage, torch.zeros_like(advantage)).sum() / n
    return torch.where(m, advantage - mean, torch.zeros_like(advantage))


def renormalized_topk(log_probs_or_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log of a distribution restricted to K ids: ``log_softmax(x / temperature)`` over the last dim.

    Either a model's logits at those ids or its log-probs there (a constant shift, the full
    log-normaliser, cancels). Args: (..., K). Returns (..., K) float32.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return (log_probs_or_logits.float() / temperature).log_softmax(-1)


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalised JSD between teacher P and student Q over the last dim (Agarwal et al. 2024):

        M = beta P + (1 - beta) Q
        JSD(beta) = beta KL[P || M] + (1 - beta) KL[Q || M]        0 < beta < 1

    and its limits, taken as the divergences themselves (the JSD vanishes there): beta = 1 is
    the reverse KL[Q || P] (the student's, what on-policy distillation minimises), beta = 0 the
    forward KL[P || Q]. ``student_logp``, ``teacher_logp``: (..., K) normalised log-probs.
    Returns (...) float32.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"--distill_jsd_beta must be in [0, 1], got {beta}")
    q, p = student_logp.float(), teacher_logp.float()
    if beta == 1.0:
        return (q.exp() * (q - p)).sum(-1)  # KL[Q || P]
    if beta == 0.0:
        return (p.exp() * (p - q)).sum(-1)  # KL[P || Q]
    log_m = torch.logsumexp(torch.stack([p + math.log(beta), q + math.log(1.0 - beta)]), dim=0)  # (..., K)
    kl_pm = (p.exp() * (p - log_m)).sum(-1)
    kl_qm = (q.exp() * (q - log_m)).sum(-1)
    return beta * kl_pm + (1.0 - beta) * kl_qm


def topk_divergence(
    student_topk_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token top-k distillation divergence, both models renormalised over the teacher's K ids.

        q = softmax(z_S[ids] / tau),  p = softmax(log mu[ids])    (the teacher's at the run's tau)
        D_t = JSD(beta)(p || q)                                    (``generalized_jsd``)

    Args:
        student_topk_logits: (B, T, K) the student's logits at the teacher's ids (with grad).
        teacher_topk_logprobs: (B, T, K) the teacher's log-probs of those ids (already at tau:
            the reward service divides its logits by ``--temperature``).
        mask: (B, T) trained tokens; None = all.
        beta: 1 reverse KL, 0 forward KL, else GKD's JSD(beta).
        temperature: tau, the student's sampling temperature.
    Returns:
        (B, T) float32, 0 where masked.
    """
    if student_topk_logits.shape != teacher_topk_logprobs.shape:
        raise ValueError(
            f"student top-k logits {tuple(student_topk_logits.shape)} and teacher top-k log-probs "
            f"{tuple(teacher_topk_logprobs.shape)} differ"
        )
    q = renormalized_topk(student_topk_logits, temperature)  # (B, T, K)
    # The teacher's K log-probs are finite in valid rows; padding rows may hold anything, so
    # they are zeroed before the sums (a NaN there would reach the gradient through where()).
    p_raw = teacher_topk_logprobs.float()
    if mask is not None:
        p_raw = torch.where(mask.bool()[..., None], p_raw, torch.zeros_like(p_raw))
    p = renormalized_topk(p_raw)  # (B, T, K)
    return _zero_masked(generalized_jsd(q, p, beta), mask)  # (B, T)
