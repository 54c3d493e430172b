"""Direct preference losses as pure functions: DPO, cDPO (label smoothing), IPO, plus the
optional NLL term on the chosen response.

Shape glossary: ``B`` preference pairs. Inputs are SUMMED response log-probabilities per
sequence, (B,) each: ``pc``/``pr`` under the policy for chosen/rejected, ``rc``/``rr`` under
the frozen reference. With ``h = (pc - rc) - (pr - rr)`` (the log-ratio gap):

- DPO (Rafailov et al. 2023, eq. 7): ``-log sigmoid(beta h)``;
- cDPO (``label_smoothing`` = eps, the chance a label is flipped; Mitchell 2023):
  ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``; eps = 0 is DPO;
- IPO (Azar et al. 2023, eq. 17): ``(h - 1 / (2 beta))^2``; here ``beta`` is the paper's
  tau. Like OpenRLHF we use summed (not length-averaged) log-probs, so h grows with length.

Implicit rewards (logged): ``beta (pc - rc)`` and ``beta (pr - rr)``; their difference is the
margin, and accuracy is the share of pairs where it is positive.

NLL term (``--nll_loss_coef`` c, as in RPO, Pang et al. 2024): ``c * mean_b(-pc_b / n_b)``
with ``n_b`` the chosen response's token count: the per-token NLL of the chosen response.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Metrics = dict[str, torch.Tensor]


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    ipo: bool = False,
    nll_loss_coef: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Mean preference loss over the (B,) pairs, and detached metrics.

    Args:
        policy_chosen, policy_rejected, ref_chosen, ref_rejected: (B,) summed log-probs.
        beta: DPO's beta (IPO's tau).
        label_smoothing: cDPO's eps in [0, 0.5); ignored with ``ipo``.
        ipo: use the IPO loss.
        nll_loss_coef: weight of the chosen-response NLL (needs ``chosen_tokens``).
        chosen_tokens: (B,) response-token counts of the chosen sequences.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    pc, pr = policy_chosen.float(), policy_rejected.float()
    rc, rr = ref_chosen.float().detach(), ref_rejected.float().detach()
    h = (pc - rc) - (pr - rr)  # (B,)
    if ipo:
        per_pair = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        per_pair = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    loss = per_pair.mean()
    metrics: Metrics = {}
    if nll_loss_coef > 0:
        if chosen_tokens is None:
            raise ValueError("nll_loss_coef > 0 needs chosen_tokens")
        nll = (-pc / chosen_tokens.float().clamp(min=1)).mean()
        loss = loss + nll_loss_coef * nll
        metrics["nll"] = nll.detach()
    chosen_reward, rejected_reward = beta * (pc - rc).detach(), beta * (pr - rr).detach()
    metrics.update(
        preference_loss=per_pair.mean().detach(),
        chosen_reward=chosen_reward.mean(),
        rejected_reward=rejected_reward.mean(),
        reward_margin=(chosen_reward - rejected_reward).mean(),
        acc=(chosen_reward > rejected_reward).float().mean(),
    )
    return loss, metrics
