"""Reading a trained engine's parameters whole, for tests that compare weights."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from common.weights.source import unwrap


def full_named_parameters(model: Any, *, names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for each parameter of an engine (or module), gathering
    ZeRO-3 shards one at a time.

    A COLLECTIVE under ZeRO-3: every rank must iterate the same names in the same order, or the
    gather hangs. Each tensor is only valid until the next one is requested (it is the live,
    gathered parameter; clone it to keep it). Tied parameters appear once."""
    import deepspeed

    wanted = set(names) if names is not None else None
    for name, p in unwrap(model).named_parameters():
        if wanted is not None and name not in wanted:
            continue
        with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
            yield name, p.detach()
