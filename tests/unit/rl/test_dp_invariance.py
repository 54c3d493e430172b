"""Data-parallel invariance of the losses and of the global whitening.

One global batch of 4 sequences with very uneven lengths (5, 4 | 1, 2 valid tokens) is
split over 2 gloo ranks (2 sequences each), and each rank further splits its share into 2
micro-batches of 1 sequence (gradient accumulation). With ``AggSpec`` counts summed over
the whole step on all ranks, the sum over ranks of the accumulated losses and of the
gradients (all-reduce SUM) must equal the loss and gradients of the whole batch on 1 rank,
for token-mean and sequence-mean aggregation. A per-rank mean (local counts) would not:
the test checks that too, so it cannot pass by accident.

Whitening for REINFORCE++ with ``dist_reduce`` must give, on each rank's shard, exactly the
values whitening the whole batch gives.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.algorithms.advantages import compute_advantages, dist_sum, masked_whiten
from learner.algorithms.losses import (
    AggSpec,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    log_probs_from_logits,
    policy_loss,
)

WORLD = 2
B, T, V, H = 4, 5, 7, 3
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def _batch():
    g = torch.Generator().manual_seed(1234)
    lengths = torch.tensor([5, 4, 1, 2])  # rank 0 holds 9 tokens, rank 1 holds 3
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (B, T)
    return {
        "x": torch.randn(B, T, H, generator=g),
        "labels": torch.randint(0, V, (B, T), generator=g),
        "old": -torch.rand(B, T, generator=g) * 3,
        "ref": -torch.rand(B, T, generator=g) * 3,
        "adv": torch.randn(B, T, generator=g),
        "mask": mask,
        "rewards": torch.randn(B, generator=g),
    }


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(H, V)


def _step_loss(model, batch, rows, agg):
    """Policy + KL + entropy terms for the sequences ``rows`` (one micro-batch)."""
    logits = model(batch["x"][rows])  # (b, T, V)
    logp = log_probs_from_logits(logits, batch["labels"][rows])
    mask = batch["mask"][rows]
    loss, _ = policy_loss(logp, batch["old"][rows], batch["adv"][rows], mask, agg, eps_clip=0.2)
    kl, _ = kl_loss(logp, batch["ref"][rows], mask, agg, kl_coef=0.05, estimator="k3")
    ent, _ = entropy_bonus(entropy_from_logits(logits), mask, agg, coef=0.01)
    return loss + kl + ent


def _whole_batch(mode, batch):
    model = _model()
    agg = AggSpec.from_masks(batch["mask"], mode, max_len=T)
    loss = _step_loss(model, batch, slice(0, B), agg)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _worker(rank: int, port: int) -> None:
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    try:
        torch.set_num_threads(1)
        reduce = dist_sum()
        batch = _batch()
        shard = slice(rank * (B // WORLD), (rank + 1) * (B // WORLD))
        micro = [slice(i, i + 1) for i in range(shard.start, shard.stop)]  # 2 micro-batches of 1 sequence

        for mode in MODES:
            model = _model()
            # counts over every micro-batch of the step, summed over ranks
            agg = AggSpec.from_masks([batch["mask"][m] for m in micro], mode, max_len=T, dist_reduce=reduce)
            local = torch.zeros(())
            for m in micro:
                loss = _step_loss(model, batch, m, agg)
                loss.backward()  # gradients accumulate over micro-batches
                local += loss.detach()
            total = reduce(local)
            grads = [reduce(p.grad) for p in model.parameters()]

            ref_loss, ref_grads = _whole_batch(mode, batch)
            torch.testing.assert_close(total, ref_loss, msg=f"{mode}: loss")
            for g, r in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(g, r, msg=f"{mode}: gradient")

            # Teeth: averaging per-rank means (local counts) is NOT the global loss here.
            naive = _step_loss(_model(), batch, shard, AggSpec.from_masks(batch["mask"][shard], mode, max_len=T))
            naive_mean = reduce(naive.detach()) / WORLD
            if mode == "token_mean":
                assert not torch.allclose(naive_mean, ref_loss), "uneven shards should break a per-rank token mean"

        # Global whitening (REINFORCE++): the shard's result equals the whole batch's, sliced.
        returns = batch["adv"]  # any (B, T) values
        whole = masked_whiten(returns, batch["mask"])
        mine = masked_whiten(returns[shard], batch["mask"][shard], dist_reduce=reduce)
        torch.testing.assert_close(mine, whole[shard], msg="masked_whiten")
        local_only = masked_whiten(returns[shard], batch["mask"][shard])
        assert not torch.allclose(local_only, whole[shard]), "per-rank whitening should differ"

        for name in ["reinforce", "reinforce_baseline", "gae"]:
            kw = dict(group_size=2, values=batch["old"], kl=batch["ref"].abs(), kl_coef=0.1)
            adv_whole, _ = compute_advantages(name, batch["rewards"], batch["mask"], **kw)
            kw_shard = {k: (v[shard] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
            adv_mine, _ = compute_advantages(
                name, batch["rewards"][shard], batch["mask"][shard], dist_reduce=reduce, **kw_shard
            )
            torch.testing.assert_close(adv_mine, adv_whole[shard], msg=name)
        # Leave together: a rank tearing its group down while the peer still uses it can abort
        # in gloo's teardown (SIGABRT, seen once under CI load).
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_gloo_ranks_match_one_rank():
    # The rendezvous store lives in this process on a port the OS picks (port 0) and holds
    # for the whole test: no window in which another process can take a "free" port, and
    # no rank tears the store down under its peer at exit.
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    # spawn (not fork): a clean interpreter per rank, as torchrun would give
    mp.spawn(_worker, args=(store.port,), nprocs=WORLD, join=True)
