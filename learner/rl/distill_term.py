"""On-policy distillation's part of an RL step: the teacher's log-probs into the advantages.

The reward services with ``--teacher_pretrain`` send the teacher's log-probs of every response
token (``ScoredSample.teacher_logprobs``); with the learner's old log-probs of the same tokens
(its weights before this step: the policy the PPO ratio is taken against) the sampled-token
term ``d_t = -(log pi_old(y_t) - log mu(y_t))`` (``learner.algorithms.distill``), less its mean
over the batch's trained tokens (``--distill_center``, on by default: a constant baseline),
enters:

* with a group or REINFORCE-style estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++ and its
  baseline): ``A_t <- A_t + coef * d_t``, after the estimator's own normalisation, so the task
  advantage's whitening does not rescale the teacher's term; alone (no reward source, rewards 0,
  so A = 0) it is the whole advantage, the published recipe's;
* with ``gae`` (PPO with a critic): in the per-token reward, ``R_t <- R_t + coef * d_t`` beside
  ``-beta kl_t``, so the critic learns its value and GAE spreads it.

``mask`` is the step's loss mask (an agent's action mask): the teacher's log-probs of
environment tokens are never used.

With ``--distill_topk K`` the term is instead a **loss term** (``topk_loss``): the student's
logits at the teacher's K ids from the training forward, GKD's JSD(beta) against the teacher's
renormalised top-k, ``coef * agg(D_t)``, differentiated through the student; the sampled-token
term is then measured (``distill/reverse_kl``) but not added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner.algorithms.distill import centered, sampled_reverse_kl, sampled_token_advantage, topk_divergence
from learner.algorithms.losses import AggSpec, masked_mean
from learner.controller.types import Rollout


@dataclass
class DistillTerm:
    advantage: torch.Tensor  # (N, T) d_t, zero where masked
    reverse_kl: torch.Tensor  # (N, T) log pi_old - log mu, zero where masked
    coef: float
    in_reward: bool  # gae: d_t goes in the token reward; otherwise it is added to the advantages

    @classmethod
    def of(
        cls,
        rollout: Rollout,
        teacher_lp: torch.Tensor,
        old_lp: torch.Tensor,
        mask: torch.Tensor,
        *,
        coef: float,
        in_reward: bool,
        center: bool = False,
    ) -> DistillTerm:
        """``teacher_lp``, ``old_lp``, ``mask``: (N, T). Raises RuntimeError when a sample came
        without the teacher's log-probs (a reward service without --teacher_pretrain scored it)."""
        missing = [s for s in rollout.samples if s.teacher_logprobs is None]
        if missing:
            raise RuntimeError(
                f"{len(missing)} of {len(rollout)} samples came without teacher log-probs (e.g. prompt "
                f"{missing[0].prompt_id}): on-policy distillation needs every reward service started with "
                "--teacher_pretrain"
            )
        d = sampled_token_advantage(old_lp, teacher_lp, mask)  # (N, T)
        return cls(
            advantage=centered(d, mask) if center else d,
            reverse_kl=sampled_reverse_kl(old_lp, teacher_lp, mask),
            coef=coef,
            in_reward=in_reward,
        )

    def token_penalty(self, kl: torch.Tensor | None, kl_coef: float) -> tuple[torch.Tensor, float]:
        """(penalty, 1.0) for the estimator's ``kl``/``kl_coef``: ``kl_coef kl_t - coef d_t``, so
        that its token reward ``-penalty_t`` carries ``+coef d_t`` (gae)."""
        base = kl * max(kl_coef, 0.0) if kl is not None else torch.zeros_like(self.advantage)
        return base - self.coef * self.advantage, 1.0

    def add_to(self, advantages: torch.Tensor) -> torch.Tensor:
        return advantages + self.coef * self.advantage

    def metrics(self, mask: torch.Tensor) -> dict[str, float]:
        """``distill/reverse_kl``: the mean per token of log pi_old - log mu over the trained tokens
        (the sampled estimate of KL[pi || mu] per position); ``distill/reverse_kl_seq``: its sum per
        sample, averaged; ``distill/advantage_abs``: the mean |coef d_t|."""
        return {
            "distill/reverse_kl": float(masked_mean(self.reverse_kl, mask)),
            "distill/reverse_kl_seq": float(self.reverse_kl.sum(-1).mean()),
            "distill/advantage_abs": float(masked_mean((self.coef * self.advantage).abs(), mask)),
        }


def topk_loss(
    student_topk_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    agg: AggSpec,
    *,
    coef: float,
    beta: float,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Top-k distillation's loss term: ``coef * agg(topk_divergence(...))`` over the trained tokens.

    Args:
        student_topk_logits: (B, T, K) the student's raw logits at the teacher's ids (with grad).
        teacher_topk_logprobs: (B, T, K) the teacher's log-probs there.
        mask: (B, T) the loss mask; agg: the step's aggregation (global counts).
    Returns:
        loss, metrics: ``topk_divergence`` (local masked mean), ``topk_loss``.
    """
    div = topk_divergence(student_topk_logits, teacher_topk_logprobs, mask, beta=beta, temperature=temperature)
    loss = coef * agg(div, mask)
    return loss, {"topk_divergence": masked_mean(div.detach(), mask), "topk_loss": loss.detach()}
