"""DAPO dynamic sampling on rank 0: keep groups whose rewards differ, refill from more prompts.

Runs before the rollout is broadcast, on the controller's rank. Test:
``tests/unit/rl/test_dynamic_filtering.py`` (a scripted controller).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from learner.algorithms.shaping import dynamic_filter_mask
from learner.controller.types import PromptItem, Rollout
from learner.rl.config import PPOConfig

log = logging.getLogger("learner")


def filter_reward_range(cfg: PPOConfig) -> tuple[float, float] | None:
    """``--dynamic_filtering_reward_range`` as ``dynamic_filter_mask`` takes it (the config
    admits none or two numbers)."""
    r = cfg.algo.dynamic_filtering_range
    return (r[0], r[1]) if r else None


def filter_and_refill(
    controller: Any, cfg: PPOConfig, rollout: Rollout, more_items: Callable[[int], list[PromptItem]]
) -> tuple[Rollout, dict]:
    """DAPO dynamic sampling on rank 0, before the broadcast: drop groups whose rewards are
    all equal (``learner.algorithms.shaping.dynamic_filter_mask``, on the raw rewards) and collect more
    prompts, a ``--rollout_batch_size`` at a time (``more_items(k)`` gives the next k), until
    that many groups are kept or ``--dynamic_filtering_max_collects`` extra collects are spent.
    Kept groups beyond the batch are dropped. Giving up is a warning: the step trains on what
    was kept (the schedule truncates it to a multiple of --train_batch_size, or skips the step
    when that is less than one train batch)."""
    G, want = cfg.rollout.n_samples_per_prompt, cfg.rollout.batch_size
    reward_range = filter_reward_range(cfg)
    kept: list = []
    seen = filtered = extra = 0

    def absorb(ro) -> None:
        nonlocal seen, filtered
        if not ro.samples:
            return
        keep = dynamic_filter_mask(ro.rewards(), G, reward_range).tolist()  # (groups,)
        seen += len(keep)
        filtered += keep.count(False)
        for g, k in enumerate(keep):
            if k:
                kept.extend(ro.samples[g * G : (g + 1) * G])

    absorb(rollout)
    while len(kept) < want * G and extra < cfg.algo.dynamic_filtering_max_collects:
        items = more_items(want)
        extra += 1
        res = controller.collect(items, timeout_s=cfg.services.generate_timeout_s + cfg.services.score_timeout_s)
        absorb(res.rollout)
    if len(kept) < want * G:
        log.warning(
            "dynamic filtering: %d of %d groups kept after %d extra collect(s) "
            "(--dynamic_filtering_max_collects); training on fewer",
            len(kept) // G,
            want,
            extra,
        )
    kept = kept[: want * G]
    stats = {
        "filter/groups_seen": seen,
        "filter/groups_filtered": filtered,
        "filter/groups_kept": len(kept) // G,
        "filter/extra_collects": extra,
        "filter/kept_frac": (seen - filtered) / max(1, seen),
    }
    log.info(
        "dynamic filtering: %d of %d groups filtered (all rewards equal%s), %d extra collect(s)",
        filtered,
        seen,
        f" or mean outside {reward_range}" if reward_range else "",
        extra,
    )
    return Rollout(kept, G), stats
