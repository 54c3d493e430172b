"""RL losses as pure functions: tensors in, ``(loss, metrics)`` out.

Each loss is written as a per-token loss (B, T) followed by ONE aggregation step,
``aggregate`` / ``AggSpec``, which divides by counts over the GLOBAL batch (every
micro-batch of the optimizer step on every data-parallel rank). A rank's loss is therefore
its share of the global loss: the shares of all ranks and micro-batches SUM to the loss of
the whole batch, and so do their gradients. Consequences for the trainer:

* build the spec once per optimizer step:
  ``AggSpec.from_masks(step_masks, mode, dist_reduce=dist_sum(), max_len=...)``;
* DDP / DeepSpeed AVERAGE gradients over ranks (and DeepSpeed also divides by the gradient
  accumulation steps), so multiply the loss by ``dp_world_size * grad_accum_steps`` before
  ``backward`` (or turn those divisions off) to get the sum of shares.

Shape glossary::

    B  sequences in the (local micro-)batch
    G  group size (samples per prompt)
    T  response tokens (right-padded; ``mask`` marks valid tokens)
    V  vocabulary size

Metrics are detached 0-dim tensors (no host sync until the caller asks), computed as LOCAL
masked means over this micro-batch's valid tokens; reduce them across ranks for logging.

Tests: ``pytest tests/unit/algorithms/test_losses.py tests/unit/rl/test_dp_invariance.py`` (hand-computed losses and
gradients; 2 gloo ranks x 2 micro-batches reproduce the whole-batch loss and gradients).

Differences from OpenRLHF's ``PolicyLoss`` / ``ValueLoss``: aggregation uses global counts
(OpenRLHF: per-micro-batch mean); the policy log-ratio is clamped to [-20, 20] before exp
(as verl does) and zeroed at padding so garbage log-probs there cannot produce NaN grads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch.utils.checkpoint import checkpoint

from learner.algorithms.kl import compute_kl

__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "count_tokens_and_seqs",
    "AggSpec",
    "masked_mean",
    "log_probs_from_logits",
    "entropy_from_logits",
    "POLICY_LOSSES",
    "IS_CORRECTIONS",
    "policy_loss",
    "value_loss",
    "kl_loss",
    "entropy_bonus",
]

Metrics = dict[str, torch.Tensor]
Number: TypeAlias = int | float | torch.Tensor
LOG_RATIO_CLAMP = 20.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) / max(sum(m), 1) over all elements; x, mask broadcastable, e.g. (B, T)."""
    m = mask.bool()
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


# --- aggregation ---------------------------------------------------------------------------


def _masked(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where(), not multiply: inf/NaN at padding would survive 0 * inf.
    return torch.where(mask.bool(), per_token, torch.zeros_like(per_token))


def _token_mean(per_token, mask, global_tokens, global_seqs, max_len):
    # sum_{b,t} m l / N_tokens(global)
    return _masked(per_token, mask).sum() / _positive(global_tokens, "global_tokens", "token_mean")


def _seq_mean_token_mean(per_token, mask, global_tokens, global_seqs, max_len):
    # sum_b [ sum_t m l / n_b ] / N_seqs(global); a row with n_b = 0 contributes 0
    n = mask.bool().sum(dim=-1).clamp(min=1)  # (B,)
    per_seq = _masked(per_token, mask).sum(dim=-1) / n  # (B,)
    return per_seq.sum() / _positive(global_seqs, "global_seqs", "seq_mean_token_mean")


def _seq_mean_token_sum(per_token, mask, global_tokens, global_seqs, max_len):
    # sum_b sum_t m l / N_seqs(global)
    return _masked(per_token, mask).sum() / _positive(global_seqs, "global_seqs", "seq_mean_token_sum")


def _seq_mean_token_sum_norm(per_token, mask, global_tokens, global_seqs, max_len):
    # sum_b sum_t m l / (N_seqs(global) * max_len)   (Dr. GRPO's constant normaliser)
    if max_len is None or max_len <= 0:
        raise ValueError("aggregation 'seq_mean_token_sum_norm' needs max_len > 0 (the generation limit)")
    denom = _positive(global_seqs, "global_seqs", "seq_mean_token_sum_norm") * max_len
    return _masked(per_token, mask).sum() / denom


def _positive(count: Number | None, name: str, mode: str):
    if count is None:
        raise ValueError(
            f"aggregation {mode!r} needs {name}: the count over the whole optimizer-step batch on all "
            f"data-parallel ranks (see AggSpec.from_masks / count_tokens_and_seqs)"
        )
    # An empty global batch gives a zero loss that still has a graph, not 0/0.
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    return max(count, 1)


AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """This rank's share of the global loss; shares over ranks/micro-batches sum to it.

        token_mean               sum_{b,t} m_bt l_bt / N_tok
        seq_mean_token_mean      sum_b (sum_t m_bt l_bt / n_b) / N_seq       (n_b = sum_t m_bt)
        seq_mean_token_sum       sum_{b,t} m_bt l_bt / N_seq
        seq_mean_token_sum_norm  sum_{b,t} m_bt l_bt / (N_seq * max_len)     (Dr. GRPO)

    N_tok / N_seq are the GLOBAL numbers of valid tokens / of sequences with at least one
    valid token. token_mean is DAPO's token-level loss (arXiv:2503.14476); seq_mean_token_mean
    is the GRPO paper's; seq_mean_token_sum_norm is Dr. GRPO's (arXiv:2503.20783).

    Args:
        per_token: (B, T) per-token loss.
        mask: (B, T) valid tokens.
        mode: key of ``AGGREGATIONS``.
        global_tokens: N_tok (token_mean).
        global_seqs: N_seq (seq_* modes).
        max_len: generation limit (seq_mean_token_sum_norm).
    Returns:
        0-dim tensor.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; choose one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[mode](per_token, mask, global_tokens, global_seqs, max_len)


def count_tokens_and_seqs(
    masks: torch.Tensor | Iterable[torch.Tensor],
    dist_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[float, float]:
    """(N_tok, N_seq) over the given masks (B_i, T_i), summed over ranks by ``dist_reduce``.

    Pass every micro-batch mask of the optimizer step. ``dist_reduce`` must return the SUM
    over data-parallel ranks (``learner.algorithms.advantages.dist_sum()``); it is a collective, so
    every rank calls this together. Host sync: returns Python floats.
    """
    masks = [masks] if isinstance(masks, torch.Tensor) else list(masks)
    # Count on the masks' device: an NCCL all-reduce needs a CUDA tensor.
    device = masks[0].device if masks else torch.device("cpu")
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for m in masks:
        m = m.bool()
        counts += torch.stack([m.sum(), (m.sum(dim=-1) > 0).sum()]).to(device=device, dtype=torch.float64)
    if dist_reduce is not None:
        counts = dist_reduce(counts)
    return float(counts[0]), float(counts[1])


@dataclass(frozen=True)
class AggSpec:
    """How a per-token loss becomes this rank's scalar share: mode plus the global counts."""

    mode: str = "token_mean"
    global_tokens: float | None = None
    global_seqs: float | None = None
    max_len: int | None = None

    @classmethod
    def from_masks(cls, masks, mode: str = "token_mean", *, max_len: int | None = None, dist_reduce=None):
        """Spec whose counts come from ``masks`` (all micro-batches of the step, summed over ranks)."""
        tokens, seqs = count_tokens_and_seqs(masks, dist_reduce)
        return cls(mode, tokens, seqs, max_len)

    def __call__(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return aggregate(
            per_token,
            mask,
            self.mode,
            global_tokens=self.global_tokens,
            global_seqs=self.global_seqs,
            max_len=self.max_len,
        )


# --- log-probs and entropy from logits -----------------------------------------------------


def _chunked_rows(
    fn, logits: torch.Tensor, *extra: torch.Tensor, chunk_size: int, always_recompute: bool = False
) -> torch.Tensor:
    """Apply ``fn(rows (..., V), *extra rows (...)) -> (...)`` to blocks of about ``chunk_size``
    rows of (..., V) logits; returns float32 of the leading shape.

    Blocks are views: whole sequences of a (B, T, V) tensor at a time, or pieces of one sequence
    when T is longer than ``chunk_size``, so logits that are a slice of the model's output (the
    response positions, ``[:, :T]``: not contiguous) are never copied whole to be flattened.

    Under autograd, logits that are not float32 have each block checkpointed: only the input
    view is kept and the float32 work (softmax etc.) is recomputed block by block in backward,
    so peak extra memory is one block, not a float32 copy of the whole (B, T, V) tensor.
    float32 logits need no copy (``fn`` works on views and saves only what autograd needs),
    and recomputing would cost backward a second pass over every block -- unless ``fn`` keeps
    (n, V) intermediates for its backward (``always_recompute``: the entropy's softmax).
    """
    lead = logits.shape[:-1]
    if logits.dim() != 3:  # (N, V) or deeper: as (1, N, V)
        flat = logits.reshape(1, -1, logits.shape[-1])
        out = _chunked_rows(
            fn, flat, *[e.reshape(1, -1) for e in extra], chunk_size=chunk_size, always_recompute=always_recompute
        )
        return out.reshape(lead)
    B, T = lead
    if B == 0 or T == 0:
        return logits.new_zeros(lead, dtype=torch.float32)
    recompute = (always_recompute or logits.dtype != torch.float32) and torch.is_grad_enabled() and logits.requires_grad

    def run(*args: torch.Tensor) -> torch.Tensor:
        return checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args)

    if T <= chunk_size:  # whole sequences, chunk_size // T of them per block
        step = max(1, chunk_size // T)
        return torch.cat([run(logits[b : b + step], *[e[b : b + step] for e in extra]) for b in range(0, B, step)])
    rows = [
        torch.cat(
            [
                run(logits[b, t : t + chunk_size], *[e[b, t : t + chunk_size] for e in extra])
                for t in range(0, T, chunk_size)
            ]
        )
        for b in range(B)
    ]
    return torch.stack(rows)


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """log softmax(z / tau)[y] = z_y / tau - logsumexp(z / tau), without a (B, T, V) log_softmax.

    Computed in float32 per chunk of ``chunk_size`` rows (bf16 logsumexp is too coarse).
    ``logits`` is not modified (OpenRLHF divides in place). ``logits[:, t]`` must already be
    the prediction for ``labels[:, t]`` (shift before calling).

    Args:
        logits: (B, T, V).
        labels: (B, T) token ids.
        temperature: tau, the sampling temperature used by the rollout engine.
        chunk_size: rows of (B*T) per chunk.
    Returns:
        (B, T) float32.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without V")
    inv_tau = 1.0 / temperature

    def fn(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = z.float()  # (n, V); a view when already float32
        if inv_tau != 1.0:
            z = z * inv_tau
        return z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)

    return _chunked_rows(fn, logits, labels.long(), chunk_size=chunk_size)


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of softmax(z / tau): H = logsumexp(z) - sum_v softmax(z)_v z_v  (z already / tau).

    Chunked and checkpointed like ``log_probs_from_logits``; -inf logits are allowed.

    Args:
        logits: (B, T, V).
        temperature: tau.
        chunk_size: rows of (B*T) per chunk.
    Returns:
        (B, T) float32.
    """
    inv_tau = 1.0 / temperature

    def fn(z: torch.Tensor) -> torch.Tensor:
        z = z.float()  # (n, V); a view when already float32
        if inv_tau != 1.0:
            z = z * inv_tau
        lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (n, 1)
        if not torch.is_grad_enabled():  # a metric: in place, one (n, V) buffer
            pz = torch.sub(z, lse).exp_().mul_(z)  # p_v z_v
            # A -inf logit (masked vocab entry) has p = 0 and contributes 0, not 0 * -inf = NaN.
            return lse.squeeze(-1) - pz.nan_to_num_(nan=0.0).sum(dim=-1)
        p = torch.exp(z - lse)
        # As above; replace z before the product so that backward never multiplies by inf either.
        z_finite = torch.where(p > 0, z, torch.zeros_like(z))
        return lse.squeeze(-1) - (p * z_finite).sum(dim=-1)

    return _chunked_rows(fn, logits, chunk_size=chunk_size, always_recompute=True)


# --- policy losses -------------------------------------------------------------------------


def _clipped_surrogate(ratio, advantages, eps_clip_low, eps_clip_high, dual_clip):
    """-min(rA, clip(r, 1-el, 1+eh) A), and for A < 0 with dual clip: min(that, -c A)."""
    surr1 = ratio * advantages  # (B, T)
    surr2 = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high) * advantages
    loss = -torch.min(surr1, surr2)
    if dual_clip is not None:
        # Ye et al. 2020 (arXiv:1912.09729): bound the loss of a negative advantage by -c*A.
        loss = torch.where(advantages < 0, torch.min(loss, -dual_clip * advantages), loss)
    return loss


def ppo_per_token(log_ratio, advantages, mask, *, eps_clip_low, eps_clip_high, dual_clip):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), per token.

        r_t = exp(log pi(y_t) - log pi_old(y_t))
        l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)

    eps_low != eps_high is DAPO's clip-higher. With ``dual_clip`` c > 1 (Ye et al. 2020),
    l_t = min(l_t, -c A_t) for A_t < 0.

    Args:
        log_ratio: (B, T) log pi - log pi_old (0 at padding).
        advantages: (B, T).
        mask: (B, T) valid tokens (unused: the ratio is already per token).
    Returns:
        per-token loss (B, T), ratio (B, T).
    """
    ratio = log_ratio.exp()  # (B, T)
    return _clipped_surrogate(ratio, advantages, eps_clip_low, eps_clip_high, dual_clip), ratio


def gspo_per_token(log_ratio, advantages, mask, *, eps_clip_low, eps_clip_high, dual_clip):
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): one length-normalised ratio per sequence.

        s_b = exp( sum_t m_bt (log pi - log pi_old)_bt / n_b )      (geometric mean of r_bt)
        l_bt = -min(s_b A_bt, clip(s_b, 1 - eps_low, 1 + eps_high) A_bt)

    The gradient flows through s_b into every token of the sequence. Use it with
    aggregation "seq_mean_token_mean" (enforced by ``policy_loss``) and small eps (the paper
    uses 3e-4 / 4e-4).

    Args:
        log_ratio: (B, T) log pi - log pi_old (0 at padding).
        advantages: (B, T), usually constant along T.
        mask: (B, T) valid tokens.
    Returns:
        per-token loss (B, T), ratio s_b broadcast to (B, T).
    """
    m = mask.to(log_ratio.dtype)
    seq_log_ratio = (log_ratio * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)  # (B,)
    ratio = seq_log_ratio.exp().unsqueeze(-1).expand_as(log_ratio)  # (B, T)
    return _clipped_surrogate(ratio, advantages, eps_clip_low, eps_clip_high, dual_clip), ratio


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "ppo": ppo_per_token,
    "gspo": gspo_per_token,
}
# Aggregation a policy loss requires (OpenRLHF forces sequence-level loss for GSPO).
REQUIRED_AGGREGATION = {"gspo": "seq_mean_token_mean"}


# --- importance-sampling correction for rollout (vLLM) vs learner mismatch --------------------


def tis_weights(is_ratio, mask, *, low, high):
    """Truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): w_t = min(rho_t, high); ``low`` unused.

    Args: is_ratio (B, T) rho_t = pi_old_learner / pi_rollout; mask (B, T).
    Returns: weights (B, T), fraction of valid tokens truncated.
    """
    return is_ratio.clamp(max=high), masked_mean((is_ratio > high).float(), mask)


def icepop_weights(is_ratio, mask, *, low, high):
    """IcePop (Ling Team 2025, Ring-1T): w_t = rho_t if low <= rho_t <= high else 0.

    Args: is_ratio (B, T); mask (B, T).
    Returns: weights (B, T), fraction of valid tokens masked out.
    """
    keep = (is_ratio >= low) & (is_ratio <= high)
    return torch.where(keep, is_ratio, torch.zeros_like(is_ratio)), masked_mean((~keep).float(), mask)


def seq_mask_tis_weights(is_ratio, mask, *, low, high):
    """Sequence-masked IS (OpenRLHF "seq-mask-tis"): w_bt = rho_bt if the sequence's
    geometric-mean ratio exp(mean_t log rho_bt) is in [low, high], else 0.

    Args: is_ratio (B, T); mask (B, T).
    Returns: weights (B, T), fraction of sequences masked out.
    """
    m = mask.to(torch.float32)
    seq = (torch.log(is_ratio.clamp(min=1e-30)) * m).sum(-1) / m.sum(-1).clamp(min=1)  # (B,)
    seq_ratio = seq.exp()
    keep = (seq_ratio >= low) & (seq_ratio <= high)  # (B,)
    return torch.where(keep.unsqueeze(-1), is_ratio, torch.zeros_like(is_ratio)), 1.0 - keep.float().mean()


IS_CORRECTIONS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "tis": tis_weights,
    "icepop": icepop_weights,
    "seq_mask_tis": seq_mask_tis_weights,
}


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    agg: AggSpec,
    *,
    loss_type: str = "ppo",
    eps_clip: float = 0.2,
    eps_clip_low: float | None = None,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    is_correction: str | None = None,
    is_low: float = 0.5,
    is_high: float = 2.0,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped policy-gradient loss, optionally importance-corrected for the rollout engine.

        l_t  = POLICY_LOSSES[loss_type](log pi - log pi_old, A)_t           (PPO / GSPO)
        l_t <- w_t * l_t,  w_t = IS_CORRECTIONS[is_correction](rho_t),
                           rho_t = exp(log pi_old(y_t) - log pi_rollout(y_t)), no grad
        loss = agg(l)

    pi_old is the learner's log-prob at experience time; pi_rollout is what vLLM reported
    while sampling. The two differ by kernels/precision, and in async mode by staleness.

    Args:
        log_probs: (B, T) current policy log-probs (with grad).
        old_log_probs: (B, T) learner log-probs at experience time.
        advantages: (B, T).
        mask: (B, T) valid response tokens.
        agg: aggregation spec with global counts.
        loss_type: key of ``POLICY_LOSSES``.
        eps_clip: symmetric clip; eps_clip_low / eps_clip_high override each side.
        dual_clip: c > 1, or None.
        rollout_log_probs: (B, T) sampling log-probs from vLLM (needed with is_correction).
        is_correction: key of ``IS_CORRECTIONS``, or None.
        is_low, is_high: IS bounds (tis uses only is_high as its cap).
    Returns:
        loss (0-dim), metrics: policy_loss, clip_frac, clip_frac_low, clip_frac_high,
        dual_clip_frac, ppo_kl, approx_kl, ratio_mean, ratio_max, ratio_min, and with
        is_correction: vllm_kl, is_weight_mean, is_filter_frac.
    """
    if loss_type not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {loss_type!r}; choose one of {sorted(POLICY_LOSSES)}")
    required = REQUIRED_AGGREGATION.get(loss_type)
    if required is not None and agg.mode != required:
        raise ValueError(
            f"policy loss {loss_type!r} is a sequence-level objective: use aggregation {required!r}, got {agg.mode!r}"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    el = eps_clip if eps_clip_low is None else eps_clip_low
    eh = eps_clip if eps_clip_high is None else eps_clip_high

    valid = mask.bool()
    log_ratio = log_probs.float() - old_log_probs.float()  # (B, T)
    log_ratio = torch.where(valid, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(log_ratio))
    adv = torch.where(valid, advantages.float(), torch.zeros_like(log_ratio))  # (B, T)
    per_token, ratio = POLICY_LOSSES[loss_type](
        log_ratio, adv, mask, eps_clip_low=el, eps_clip_high=eh, dual_clip=dual_clip
    )

    metrics: Metrics = {}
    if is_correction is not None:
        if is_correction not in IS_CORRECTIONS:
            raise ValueError(f"unknown IS correction {is_correction!r}; choose one of {sorted(IS_CORRECTIONS)}")
        if rollout_log_probs is None:
            raise ValueError(f"is_correction={is_correction!r} needs rollout_log_probs from the rollout engine")
        with torch.no_grad():
            is_log = (old_log_probs.float() - rollout_log_probs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            is_ratio = torch.where(valid, is_log.exp(), torch.ones_like(is_log))  # (B, T)
            weights, filtered = IS_CORRECTIONS[is_correction](is_ratio, mask, low=is_low, high=is_high)
        per_token = per_token * weights
        metrics["vllm_kl"] = masked_mean(rollout_log_probs.float() - old_log_probs.float(), mask).detach()
        metrics["is_weight_mean"] = masked_mean(weights, mask)
        metrics["is_filter_frac"] = filtered.detach()

    loss = agg(per_token, mask)

    with torch.no_grad():
        r = ratio.detach()
        low_clip = (adv < 0) & (r < 1.0 - el)
        high_clip = (adv > 0) & (r > 1.0 + eh)
        metrics.update(
            policy_loss=masked_mean(per_token.detach(), mask),
            clip_frac=masked_mean((low_clip | high_clip).float(), mask),
            clip_frac_low=masked_mean(low_clip.float(), mask),
            clip_frac_high=masked_mean(high_clip.float(), mask),
            dual_clip_frac=masked_mean(((adv < 0) & (r > dual_clip)).float(), mask)
            if dual_clip is not None
            else torch.zeros(()),
            # KL[pi_old || pi] from tokens sampled by pi_old: k1 (OpenRLHF's ppo_kl) and k3.
            ppo_kl=masked_mean(-log_ratio.detach(), mask),
            approx_kl=masked_mean(torch.expm1(log_ratio.detach()) - log_ratio.detach(), mask),
            ratio_mean=masked_mean(r, mask),
            # ratios are > 0, so 0 is a neutral fill for max; min of nothing valid reads 0.
            ratio_max=torch.where(valid, r, torch.zeros_like(r)).max(),
            ratio_min=torch.where(valid, r, torch.full_like(r, torch.inf)).min().nan_to_num(posinf=0.0),
        )
    return loss, metrics


# --- critic, KL and entropy terms ----------------------------------------------------------


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    agg: AggSpec,
    *,
    value_clip: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO critic loss with optional value clipping (OpenRLHF ``ValueLoss``).

        V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
        l_t    = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)      (0.5 (V - R)^2 unclipped)

    Args:
        values: (B, T) current critic values (with grad).
        old_values: (B, T) values at experience time.
        returns: (B, T) targets (GAE returns).
        mask: (B, T) valid tokens.
        agg: aggregation spec.
        value_clip: clip range, or None.
    Returns:
        loss, metrics: value_loss, value_clip_frac, values_mean, returns_mean.
    """
    v, R = values.float(), returns.float()
    per_token = (v - R).square()  # (B, T)
    if value_clip is not None:
        v_old = old_values.float()
        v_clipped = v_old + (v - v_old).clamp(-value_clip, value_clip)
        per_token = torch.max(per_token, (v_clipped - R).square())
    per_token = 0.5 * per_token
    loss = agg(per_token, mask)
    with torch.no_grad():
        clip_frac = (
            masked_mean(((v - old_values.float()).abs() > value_clip).float(), mask)
            if value_clip is not None
            else torch.zeros(())
        )
        metrics = {
            "value_loss": masked_mean(per_token.detach(), mask),
            "value_clip_frac": clip_frac,
            "values_mean": masked_mean(v.detach(), mask),
            "returns_mean": masked_mean(R, mask),
        }
    return loss, metrics


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    agg: AggSpec,
    *,
    kl_coef: float,
    estimator: str = "k3",
    clamp: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-to-reference as a loss term (GRPO, Shao et al. 2024; OpenRLHF ``use_kl_loss``).

        loss = kl_coef * agg(KL_ESTIMATORS[estimator](log pi, log pi_ref))

    Args:
        log_probs: (B, T) current policy log-probs (with grad).
        ref_log_probs: (B, T) reference log-probs.
        mask: (B, T) valid tokens.
        agg: aggregation spec.
        kl_coef: beta (e.g. a KL controller's value).
        estimator: "k1" | "k2" | "k3".
        clamp: optional symmetric bound per token.
    Returns:
        loss, metrics: kl (unscaled local masked mean), kl_loss.
    """
    kl = compute_kl(log_probs, ref_log_probs, mask, estimator=estimator, clamp=clamp)  # (B, T)
    loss = kl_coef * agg(kl, mask)
    return loss, {"kl": masked_mean(kl.detach(), mask), "kl_loss": loss.detach()}


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    agg: AggSpec,
    *,
    coef: float,
) -> tuple[torch.Tensor, Metrics]:
    """Entropy bonus as a loss to add: loss = -coef * agg(H) (maximises entropy for coef > 0).

    Args:
        entropy: (B, T) from ``entropy_from_logits`` (with grad).
        mask: (B, T) valid tokens.
        agg: aggregation spec.
        coef: entropy coefficient.
    Returns:
        loss, metrics: entropy (local masked mean).
    """
    loss = -coef * agg(entropy.float(), mask)
    return loss, {"entropy": masked_mean(entropy.detach().float(), mask)}
