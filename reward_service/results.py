"""What one reward source returns for a batch, and the checks on what user code hands back.

A reward function or remote reward server answers in OpenRLHF's shapes: a sequence of N
numbers (list, tensor, array), or a dict ``{"rewards": (N,), "scores": (N,) optional,
"extra_logs": {name: (N,) or scalar} optional}``. ``from_raw`` turns that into a
``SourceResult`` and decides what failed:

- not a sequence / dict without ``rewards`` / wrong length / wrong shape -> every sample of
  the call fails, with the reason;
- a non-finite reward (or score) -> that sample fails;
- a malformed ``extra_logs`` entry is dropped with a warning: logs never fail a sample.

A failed sample's reward is NaN, so a consumer that ignores ``failed`` cannot silently
train on a made-up number.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

NAN = float("nan")


@dataclass
class SourceResult:
    rewards: list[float]  # (N,) NaN where failed
    failed: list[str | None]  # (N,) reason, None = ok
    scores: list[float] | None = None  # (N,) when the source gave scores
    extra_logs: dict[str, list[float]] = field(default_factory=dict)  # name -> (N,)

    @classmethod
    def all_failed(cls, n: int, reason: str) -> SourceResult:
        return cls(rewards=[NAN] * n, failed=[reason] * n)

    @classmethod
    def concat(cls, parts: list[SourceResult]) -> SourceResult:
        """Joins the results of consecutive slices of one batch (e.g. one per worker or URL)."""
        out = cls(rewards=[], failed=[])
        n_so_far = 0
        with_scores = any(p.scores is not None for p in parts)
        scores: list[float] = []
        for p in parts:
            n = len(p.rewards)
            out.rewards += p.rewards
            out.failed += p.failed
            scores += p.scores if p.scores is not None else [NAN] * n
            for k, v in p.extra_logs.items():
                out.extra_logs.setdefault(k, [NAN] * n_so_far).extend(v)
            for v in out.extra_logs.values():  # keys a slice lacked
                v.extend([NAN] * (n_so_far + n - len(v)))
            n_so_far += n
        out.scores = scores if with_scores else None
        return out


def _vector(x: Any, n: int, what: str) -> list[float] | str:
    """The ``n`` values, or (a str) why ``x`` is not ``n`` numbers. Accepts a bare number when n == 1."""
    if isinstance(x, (int, float)) and n == 1:
        return [float(x)]
    if not isinstance(x, (list, tuple)):
        return f"{what} must be a sequence of {n} numbers, got {type(x).__name__}"
    if len(x) != n:
        return f"{what} has {len(x)} entries for {n} samples"
    out = []
    for i, v in enumerate(x):
        if isinstance(v, bool):
            v = float(v)
        if not isinstance(v, (int, float)):
            return f"{what}[{i}] is {type(v).__name__}, expected a number (is the result 2-D?)"
        out.append(float(v))
    return out


def from_raw(raw: Any, n: int, source: str) -> SourceResult:
    """Validates a user function's or remote server's answer for ``n`` samples."""
    scores_raw, logs_raw = None, None
    if isinstance(raw, dict):
        if "rewards" not in raw:
            return SourceResult.all_failed(n, f"{source} returned a dict without 'rewards' (keys: {sorted(raw)[:8]})")
        rewards_raw, scores_raw, logs_raw = raw["rewards"], raw.get("scores"), raw.get("extra_logs")
    else:
        rewards_raw = raw
    rewards = _vector(rewards_raw, n, "rewards")
    if isinstance(rewards, str):
        return SourceResult.all_failed(n, f"{source}: {rewards}")
    scores: list[float] | None = None
    if scores_raw is not None:
        checked = _vector(scores_raw, n, "scores")
        if isinstance(checked, str):
            return SourceResult.all_failed(n, f"{source}: {checked}")
        scores = checked
    failed: list[str | None] = [None] * n
    for i in range(n):
        if not math.isfinite(rewards[i]):
            failed[i] = f"{source} returned a non-finite reward ({rewards[i]})"
        elif scores is not None and not math.isfinite(scores[i]):
            failed[i] = f"{source} returned a non-finite score ({scores[i]})"
        if failed[i]:
            rewards[i] = NAN
    return SourceResult(rewards=rewards, failed=failed, scores=scores, extra_logs=_logs(logs_raw, n, source))


def _logs(raw: Any, n: int, source: str) -> dict[str, list[float]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        log.warning("%s: extra_logs must be a dict, got %s; dropped", source, type(raw).__name__)
        return {}
    out: dict[str, list[float]] = {}
    for k, v in raw.items():
        if isinstance(v, (int, float)):  # one number for the batch: logged for every sample
            out[str(k)] = [float(v)] * n
            continue
        vals = _vector(v, n, f"extra_logs[{k!r}]")
        if isinstance(vals, str):
            log.warning("%s: %s; dropped", source, vals)
            continue
        out[str(k)] = vals
    return out
