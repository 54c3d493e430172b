"""Hand-computed checks of learner/algorithms/losses.py (in the style of torchtune's PPO loss tests)."""

import math

import pytest
import torch

from learner.algorithms.losses import (
    AGGREGATIONS,
    IS_CORRECTIONS,
    POLICY_LOSSES,
    AggSpec,
    aggregate,
    count_tokens_and_seqs,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    log_probs_from_logits,
    policy_loss,
    value_loss,
)

close = torch.testing.assert_close
LN = math.log


def local_agg(mask, mode="token_mean", max_len=None):
    """Spec for a batch that is the whole global batch (one rank, one micro-batch)."""
    return AggSpec.from_masks(mask, mode, max_len=max_len)


# --- aggregation ---------------------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # valid: 1 2 | 4


def test_token_mean_uses_the_global_count():
    # (1 + 2 + 4) / 3 = 7/3 when this is the whole batch ...
    close(aggregate(PER_TOKEN, MASK, "token_mean", global_tokens=3), torch.tensor(7 / 3))
    # ... and 7/6 when other ranks hold 3 more tokens: this rank's share of the global mean
    close(aggregate(PER_TOKEN, MASK, "token_mean", global_tokens=6), torch.tensor(7 / 6))


def test_sequence_modes_by_hand():
    # seq_mean_token_mean: ((1 + 2) / 2 + 4 / 1) / 2 = (1.5 + 4) / 2 = 2.75
    close(aggregate(PER_TOKEN, MASK, "seq_mean_token_mean", global_seqs=2), torch.tensor(2.75))
    # seq_mean_token_sum: ((1 + 2) + 4) / 2 = 3.5
    close(aggregate(PER_TOKEN, MASK, "seq_mean_token_sum", global_seqs=2), torch.tensor(3.5))
    # seq_mean_token_sum_norm (Dr. GRPO), max_len 4: 7 / (2 * 4) = 0.875
    close(aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", global_seqs=2, max_len=4), torch.tensor(0.875))


def test_aggregation_ignores_garbage_padding_and_empty_rows():
    # inf / NaN at padding and a row with no valid token: still 7/3 and 2.75, no NaN
    x = torch.tensor([[1.0, 2.0, math.inf], [4.0, math.nan, 0.0], [math.nan, math.nan, math.nan]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    close(aggregate(x, m, "token_mean", global_tokens=3), torch.tensor(7 / 3))
    close(aggregate(x, m, "seq_mean_token_mean", global_seqs=2), torch.tensor(2.75))


def test_aggregation_requires_explicit_counts():
    with pytest.raises(ValueError, match="needs global_tokens"):
        aggregate(PER_TOKEN, MASK, "token_mean")
    with pytest.raises(ValueError, match="needs global_seqs"):
        aggregate(PER_TOKEN, MASK, "seq_mean_token_mean")
    with pytest.raises(ValueError, match="max_len"):
        aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", global_seqs=2)
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(PER_TOKEN, MASK, "mean", global_tokens=1)
    assert set(AGGREGATIONS) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"}


def test_empty_global_batch_gives_zero_with_graph():
    x = torch.ones(1, 2, requires_grad=True)
    out = aggregate(x, torch.zeros(1, 2), "token_mean", global_tokens=0)
    assert out.item() == 0.0 and out.requires_grad


def test_count_tokens_and_seqs_over_microbatches():
    # micro-batch 1: 2 tokens in 1 non-empty row (+ one empty row); micro-batch 2: 1 token, 1 row
    assert count_tokens_and_seqs([torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 0]])]) == (3.0, 2.0)
    spec = AggSpec.from_masks(MASK, "seq_mean_token_mean")
    assert (spec.global_tokens, spec.global_seqs) == (3.0, 2.0)
    close(spec(PER_TOKEN, MASK), torch.tensor(2.75))


# --- log-probs and entropy -----------------------------------------------------------------


def test_log_probs_by_hand():
    # logits [1, 2, 3], label 2: logsumexp = 3 + ln(1 + e^-1 + e^-2) = 3 + ln 1.5032 = 3.4076
    #   log p = 3 - 3.4076 = -0.4076
    # temperature 2: z = [0.5, 1, 1.5]: log p = -ln(1 + e^-0.5 + e^-1) = -ln 1.9744 = -0.6802
    logits = torch.tensor([[[1.0, 2.0, 3.0]]])
    label = torch.tensor([[2]])
    close(log_probs_from_logits(logits, label), torch.tensor([[-LN(1 + math.exp(-1) + math.exp(-2))]]))
    close(
        log_probs_from_logits(logits, label, temperature=2.0),
        torch.tensor([[-LN(1 + math.exp(-0.5) + math.exp(-1))]]),
    )
    assert torch.equal(logits, torch.tensor([[[1.0, 2.0, 3.0]]]))  # not divided in place


def test_log_probs_match_log_softmax_gather_chunked_with_grad():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 3))
    ref = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    out = log_probs_from_logits(logits, labels, temperature=0.7, chunk_size=4)  # 6 rows -> chunks 4 + 2
    close(out, ref)
    w = torch.randn(2, 3)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), logits)
    (g_out,) = torch.autograd.grad((out * w).sum(), logits)
    close(g_out, g_ref)


def test_log_probs_bf16_is_computed_in_float32():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 50).to(torch.bfloat16)
    labels = torch.randint(0, 50, (1, 4))
    out = log_probs_from_logits(logits, labels)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert out.dtype == torch.float32
    close(out, ref)


def test_entropy_by_hand():
    # uniform over 4: H = ln 4 = 1.3863
    # p = [0.5, 0.25, 0.25] (logits = log p): H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2 = 1.0397
    # (the -inf logit is a masked vocab entry: p = 0, contributes nothing, and no NaN grad)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [LN(0.5), LN(0.25), LN(0.25), -math.inf]]], requires_grad=True)
    out = entropy_from_logits(logits)
    close(out, torch.tensor([[LN(4), 1.5 * LN(2)]]))
    (grad,) = torch.autograd.grad(out.sum(), logits)
    assert torch.isfinite(grad).all()


def test_entropy_as_a_metric_without_grad_by_hand():
    """The no-grad path (the logged metric, computed in place) gives the same hand values, the
    masked -inf entry contributing 0 rather than NaN, at temperature 1 and 2."""
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [LN(0.5), LN(0.25), LN(0.25), -math.inf]]])
    with torch.no_grad():
        close(entropy_from_logits(logits), torch.tensor([[LN(4), 1.5 * LN(2)]]))
        # tau = 2 on [ln .5, ln .25, ln .25]: p ~ [.5^.5, .25^.5, .25^.5] = [.7071, .5, .5] / 1.7071
        q = torch.tensor([0.5**0.5, 0.5, 0.5]) / (0.5**0.5 + 1.0)
        close(entropy_from_logits(logits[:, 1:], temperature=2.0), -(q * q.log()).sum().reshape(1, 1))
    assert torch.equal(logits[0, 1, :3], torch.tensor([LN(0.5), LN(0.25), LN(0.25)])), "not changed in place"


def test_log_probs_and_entropy_of_bf16_logits_keep_their_grads_through_the_checkpoint():
    torch.manual_seed(2)
    base = torch.randn(2, 3, 11)
    labels = torch.randint(0, 11, (2, 3))
    for fn in (
        lambda z: log_probs_from_logits(z, labels, chunk_size=4),
        lambda z: entropy_from_logits(z, chunk_size=4),
    ):
        z16 = base.to(torch.bfloat16).requires_grad_()
        z32 = base.to(torch.bfloat16).float().requires_grad_()
        (g16,) = torch.autograd.grad(fn(z16).sum(), z16)
        (g32,) = torch.autograd.grad(fn(z32).sum(), z32)
        close(g16.float(), g32, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("chunk_size", [1, 2, 7, 1024])  # pieces of a sequence, one, several, all
def test_chunks_of_a_sliced_logits_view_match_the_whole_with_grad(chunk_size):
    """The trainer passes ``out.logits[:, :T]`` (the response positions: a view, not contiguous);
    blocks of whole sequences or of pieces of one give the unchunked values and gradients."""
    torch.manual_seed(3)
    full = torch.randn(3, 6, 9, requires_grad=True)
    logits = full[:, :5]  # (3, 5, 9), as logits_to_keep = T + 1 then [:, :T]
    labels = torch.randint(0, 9, (3, 5))
    ref_lp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    lp = log_probs_from_logits(logits, labels, chunk_size=chunk_size)
    h = entropy_from_logits(logits, chunk_size=chunk_size)
    close(lp, ref_lp)
    close(h, ref_h)
    w = torch.randn(3, 5)
    (g_ref,) = torch.autograd.grad((ref_lp * w + ref_h).sum(), full)
    (g,) = torch.autograd.grad((lp * w + h).sum(), full)
    close(g, g_ref)


def test_entropy_matches_naive_chunked_with_grad():
    torch.manual_seed(1)
    logits = torch.randn(3, 2, 5, requires_grad=True)
    p = torch.softmax(logits, -1)
    ref = -(p * torch.log_softmax(logits, -1)).sum(-1)
    out = entropy_from_logits(logits, chunk_size=4)
    close(out, ref)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    (g_out,) = torch.autograd.grad(out.sum(), logits)
    close(g_out, g_ref)


# --- policy loss ---------------------------------------------------------------------------

# Four tokens, eps = 0.2:
#   t0: r = 1.5, A = +1: surr1 = 1.5, surr2 = 1.2 -> min 1.2, loss -1.2  (clipped high, no grad)
#   t1: r = 0.5, A = +1: surr1 = 0.5, surr2 = 0.8 -> min 0.5, loss -0.5  (grad -r A = -0.5)
#   t2: r = 1.5, A = -1: surr1 = -1.5, surr2 = -1.2 -> min -1.5, loss 1.5  (grad -r A = 1.5)
#   t3: r = 0.5, A = -1: surr1 = -0.5, surr2 = -0.8 -> min -0.8, loss 0.8 (clipped low, no grad)
#   token mean = (-1.2 - 0.5 + 1.5 + 0.8) / 4 = 0.6 / 4 = 0.15
RATIOS = [1.5, 0.5, 1.5, 0.5]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]])


def _logps(ratios, old=None):
    old = torch.full((1, len(ratios)), -1.0) if old is None else old
    new = (old + torch.tensor([[LN(r) for r in ratios]])).requires_grad_(True)
    return new, old


def test_ppo_clipped_loss_by_hand():
    new, old = _logps(RATIOS)
    mask = torch.ones(1, 4)
    loss, m = policy_loss(new, old, ADV, mask, local_agg(mask), eps_clip=0.2)
    close(loss, torch.tensor(0.15))
    (grad,) = torch.autograd.grad(loss, new)
    # d loss / d log pi_t = -r_t A_t / 4 where unclipped: [0, -0.5/4, 1.5/4, 0]
    close(grad, torch.tensor([[0.0, -0.125, 0.375, 0.0]]))
    close(m["policy_loss"], torch.tensor(0.15))
    close(m["clip_frac"], torch.tensor(0.5))  # t0 and t3
    close(m["clip_frac_low"], torch.tensor(0.25))
    close(m["clip_frac_high"], torch.tensor(0.25))
    close(m["ratio_mean"], torch.tensor(1.0))  # (1.5 + 0.5 + 1.5 + 0.5) / 4
    close(m["ratio_max"], torch.tensor(1.5))
    close(m["ratio_min"], torch.tensor(0.5))
    # ppo_kl = mean(-log r) = -(2 ln 1.5 + 2 ln 0.5) / 4 = -0.5 ln 0.75 = 0.1438
    close(m["ppo_kl"], torch.tensor(-0.5 * LN(0.75)))
    # approx_kl = mean((r - 1) - log r); sum(r - 1) = 0 here, so it equals ppo_kl
    close(m["approx_kl"], torch.tensor(-0.5 * LN(0.75)))
    assert all(not v.requires_grad for v in m.values())


def test_clip_higher_asymmetric():
    # eps_low 0.2, eps_high 0.6: t0 clip(1.5, 0.8, 1.6) = 1.5 -> loss -1.5 (no longer clipped)
    #   mean = (-1.5 - 0.5 + 1.5 + 0.8) / 4 = 0.3 / 4 = 0.075; only t3 clipped
    new, old = _logps(RATIOS)
    mask = torch.ones(1, 4)
    loss, m = policy_loss(new, old, ADV, mask, local_agg(mask), eps_clip_low=0.2, eps_clip_high=0.6)
    close(loss, torch.tensor(0.075))
    close(m["clip_frac"], torch.tensor(0.25))
    close(m["clip_frac_high"], torch.tensor(0.0))


def test_dual_clip_bounds_negative_advantages():
    # c = 3, eps 0.2:
    #   r = 5, A = -1: PPO loss = -min(-5, -1.2) = 5 -> dual: min(5, -c A = 3) = 3 (grad 0)
    #   r = 2, A = -1: PPO loss = 2 < 3 -> unchanged (grad -r A = 2)
    #   r = 5, A = +1: PPO loss = -min(5, 1.2) = -1.2 (dual clip never touches A > 0)
    #   mean = (3 + 2 - 1.2) / 3 = 1.2667
    new, old = _logps([5.0, 2.0, 5.0])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, m = policy_loss(new, old, adv, mask, local_agg(mask), dual_clip=3.0)
    close(loss, torch.tensor(3.8 / 3))
    (grad,) = torch.autograd.grad(loss, new)
    close(grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    close(m["dual_clip_frac"], torch.tensor(1 / 3))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(new, old, adv, mask, local_agg(mask), dual_clip=1.0)


def test_gspo_sequence_ratio_by_hand():
    # row 0: token log-ratios [ln 4, ln 1] -> s = exp((ln 4 + 0) / 2) = 2, A = +1
    #        surr1 = 2, surr2 = clip(2, 0.8, 1.2) = 1.2 -> loss -1.2 per token; clipped, no grad
    # row 1: one valid token (then padding), log-ratio ln 0.9 -> s = 0.9, A = +1: loss -0.9
    # seq_mean_token_mean over 2 sequences: (-1.2 - 0.9) / 2 = -1.05
    # grad on row 1's token: d(-s)/d log pi = -s / n_1 = -0.9, / 2 sequences = -0.45
    old = torch.zeros(2, 2)
    new = torch.tensor([[LN(4.0), 0.0], [LN(0.9), 123.0]], requires_grad=True)  # 123 = padding garbage
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.ones(2, 2)
    loss, m = policy_loss(new, old, adv, mask, local_agg(mask, "seq_mean_token_mean"), loss_type="gspo")
    close(loss, torch.tensor(-1.05))
    (grad,) = torch.autograd.grad(loss, new)
    close(grad, torch.tensor([[0.0, 0.0], [-0.45, 0.0]]))
    # ratio metrics are over valid tokens: s broadcast = [2, 2, 0.9] -> mean 4.9 / 3
    close(m["ratio_mean"], torch.tensor(4.9 / 3))
    with pytest.raises(ValueError, match="sequence-level objective"):
        policy_loss(new, old, adv, mask, local_agg(mask, "token_mean"), loss_type="gspo")


def test_gspo_gradient_spreads_over_the_sequence():
    # s = exp(mean log r) = 1.1 (inside the clip), n = 2 tokens, A = 1, one sequence:
    # loss = -s; d loss / d log pi_t = -s / 2 = -0.55 for both tokens
    new = torch.full((1, 2), LN(1.1), requires_grad=True)
    mask = torch.ones(1, 2)
    loss, _ = policy_loss(
        new, torch.zeros(1, 2), torch.ones(1, 2), mask, local_agg(mask, "seq_mean_token_mean"), loss_type="gspo"
    )
    (grad,) = torch.autograd.grad(loss, new)
    close(grad, torch.tensor([[-0.55, -0.55]]))


def test_tis_caps_the_importance_weight():
    # new == old (r = 1), A = 1: per-token loss -1. rho = pi_old / pi_rollout = [0.5, 1, 3]
    # tis, cap 2: w = [0.5, 1, 2] -> losses [-0.5, -1, -2], mean -3.5 / 3 = -1.1667
    # grads = w * (-r A) / 3 = [-0.5, -1, -2] / 3 (the weight itself carries no grad)
    # vllm_kl = mean(log pi_rollout - log pi_old) = -(ln 0.5 + 0 + ln 3) / 3 = -ln(1.5) / 3
    old = torch.zeros(1, 3)
    new = old.clone().requires_grad_(True)
    rollout = -torch.tensor([[LN(0.5), 0.0, LN(3.0)]])
    mask = torch.ones(1, 3)
    loss, m = policy_loss(
        new, old, torch.ones(1, 3), mask, local_agg(mask), rollout_log_probs=rollout, is_correction="tis", is_high=2.0
    )
    close(loss, torch.tensor(-3.5 / 3))
    (grad,) = torch.autograd.grad(loss, new)
    close(grad, torch.tensor([[-0.5, -1.0, -2.0]]) / 3)
    close(m["is_filter_frac"], torch.tensor(1 / 3))  # one weight truncated
    close(m["is_weight_mean"], torch.tensor(3.5 / 3))
    close(m["vllm_kl"], torch.tensor(-LN(1.5) / 3))


def test_icepop_masks_tokens_outside_the_band():
    # same tokens, band [0.6, 2.5]: rho 0.5 and 3 are outside -> weight 0; rho 1 -> 1
    # losses [0, -1, 0], mean -1/3; two of three tokens filtered
    old = torch.zeros(1, 3)
    new = old.clone().requires_grad_(True)
    rollout = -torch.tensor([[LN(0.5), 0.0, LN(3.0)]])
    mask = torch.ones(1, 3)
    loss, m = policy_loss(
        new,
        old,
        torch.ones(1, 3),
        mask,
        local_agg(mask),
        rollout_log_probs=rollout,
        is_correction="icepop",
        is_low=0.6,
        is_high=2.5,
    )
    close(loss, torch.tensor(-1 / 3))
    close(m["is_filter_frac"], torch.tensor(2 / 3))


def test_seq_mask_tis_drops_whole_sequences():
    # row 0: rho [0.5, 2] -> geometric mean 1, kept, weights [0.5, 2]
    # row 1: rho [3, 3]   -> geometric mean 3 > 2, dropped, weights 0
    # losses (r = 1, A = 1): [-0.5, -2, 0, 0] -> token mean -2.5 / 4 = -0.625
    old = torch.zeros(2, 2)
    rollout = -torch.tensor([[LN(0.5), LN(2.0)], [LN(3.0), LN(3.0)]])
    mask = torch.ones(2, 2)
    loss, m = policy_loss(
        old.clone().requires_grad_(True),
        old,
        torch.ones(2, 2),
        mask,
        local_agg(mask),
        rollout_log_probs=rollout,
        is_correction="seq_mask_tis",
        is_low=0.5,
        is_high=2.0,
    )
    close(loss, torch.tensor(-0.625))
    close(m["is_filter_frac"], torch.tensor(0.5))


def test_policy_loss_argument_errors():
    x = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        policy_loss(x, x, x, mask, local_agg(mask), is_correction="tis")
    with pytest.raises(ValueError, match="unknown IS correction"):
        policy_loss(x, x, x, mask, local_agg(mask), is_correction="is", rollout_log_probs=x)
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss(x, x, x, mask, local_agg(mask), loss_type="trpo")
    assert set(POLICY_LOSSES) == {"ppo", "gspo"}
    assert set(IS_CORRECTIONS) == {"tis", "icepop", "seq_mask_tis"}


def test_every_registered_variant_is_reachable_from_its_flag():
    # A registry entry no --choice names is dead code (seq_mask_tis was, once).
    from common.config import leaves
    from learner.rl.config import PPOConfig

    choices = {leaf.path: set(leaf.meta["choices"] or ()) for leaf in leaves(PPOConfig)}
    assert choices["algo.advantage.is_correction"] == set(IS_CORRECTIONS) | {"", "none", "auto"}
    assert choices["actor.policy_loss_type"] == set(POLICY_LOSSES)


def test_policy_loss_padding_garbage_is_ignored():
    # the same 2 valid tokens, with and without a padded column holding -inf / NaN log-probs
    old = torch.tensor([[-1.0, -2.0]])
    new = torch.tensor([[-0.8, -2.5]], requires_grad=True)
    adv = torch.tensor([[0.7, -0.3]])
    m1 = torch.ones(1, 2)
    l1, _ = policy_loss(new, old, adv, m1, local_agg(m1))
    new_p = torch.cat([new, torch.tensor([[-math.inf]])], dim=1)
    old_p = torch.cat([old, torch.tensor([[math.nan]])], dim=1)
    adv_p = torch.cat([adv, torch.tensor([[math.inf]])], dim=1)
    m2 = torch.tensor([[1, 1, 0]])
    l2, m = policy_loss(new_p, old_p, adv_p, m2, local_agg(m2))
    close(l2, l1)
    (g,) = torch.autograd.grad(l2, new)
    assert torch.isfinite(g).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_policy_loss_single_token():
    # one token, r = 1, A = 2: loss = -2
    x = torch.zeros(1, 1, requires_grad=True)
    mask = torch.ones(1, 1)
    loss, _ = policy_loss(x, x.detach(), torch.tensor([[2.0]]), mask, local_agg(mask))
    close(loss, torch.tensor(-2.0))


# --- value, KL, entropy --------------------------------------------------------------------


def test_value_loss_clipped_by_hand():
    # V_old = 1.5, returns R = 2, clip 0.2 -> V_clip = 1.5 + clip(V - 1.5, -0.2, 0.2)
    #   t0: V = 1: V_clip = 1.3: max((1-2)^2, (1.3-2)^2) = max(1, 0.49) = 1    -> 0.5
    #   t1: V = 2: V_clip = 1.7: max((2-2)^2, (1.7-2)^2) = max(0, 0.09) = 0.09 -> 0.045 (clipped branch)
    #   t2: V = 3: V_clip = 1.7: max((3-2)^2, 0.09) = 1                        -> 0.5
    #   mean = 1.045 / 3 = 0.34833
    # grads: t0: (V - R) / 3 = -1/3; t1: clipped branch is flat -> 0; t2: +1/3
    values = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    old = torch.full((1, 3), 1.5)
    returns = torch.full((1, 3), 2.0)
    mask = torch.ones(1, 3)
    loss, m = value_loss(values, old, returns, mask, local_agg(mask), value_clip=0.2)
    close(loss, torch.tensor(1.045 / 3))
    (grad,) = torch.autograd.grad(loss, values)
    close(grad, torch.tensor([[-1 / 3, 0.0, 1 / 3]]))
    close(m["value_clip_frac"], torch.tensor(1.0))  # |V - V_old| = 0.5, 0.5, 1.5 all > 0.2
    # unclipped: 0.5 * (1 + 0 + 1) / 3 = 1/3
    loss, _ = value_loss(values, old, returns, mask, local_agg(mask))
    close(loss, torch.tensor(1 / 3))


def test_value_loss_ignores_padding():
    values = torch.tensor([[1.0, 1e6]])
    mask = torch.tensor([[1, 0]])
    loss, _ = value_loss(values, values, torch.tensor([[3.0, 0.0]]), mask, local_agg(mask), value_clip=0.2)
    close(loss, torch.tensor(2.0))  # 0.5 * (1 - 3)^2 = 2


def test_kl_loss_by_hand():
    # k3 on (pi, pi_ref) = (0.5, 0.25) and (0.25, 0.5): [ln2 - 0.5, 1 - ln2], mean = 0.5 / 2 = 0.25
    # loss = 0.1 * 0.25 = 0.025
    logp = torch.tensor([[LN(0.5), LN(0.25)]], requires_grad=True)
    ref = torch.tensor([[LN(0.25), LN(0.5)]])
    mask = torch.ones(1, 2)
    loss, m = kl_loss(logp, ref, mask, local_agg(mask), kl_coef=0.1, estimator="k3")
    close(loss, torch.tensor(0.025))
    close(m["kl"], torch.tensor(0.25))
    # d k3 / d log pi = 1 - r with r = pi_ref / pi: [1 - 0.5, 1 - 2] = [0.5, -1]; * 0.1 / 2
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, torch.tensor([[0.025, -0.05]]))


def test_entropy_bonus_by_hand():
    # valid entropies 1 and 2 (9 is padding): token mean 1.5; loss = -0.01 * 1.5 = -0.015
    ent = torch.tensor([[1.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = entropy_bonus(ent, mask, local_agg(mask), coef=0.01)
    close(loss, torch.tensor(-0.015))
    close(m["entropy"], torch.tensor(1.5))
