"""The bytes of a weight push: bucket layout and the fan-out sender, whatever the backend.

Shared by the learner (``common/weights/publisher.py``) and the receivers that run inside vLLM's
workers (``rollout_service/weight_receiver_gloo.py``). No vLLM import here: a learner process
that only sends weights should not pay for loading vLLM.

Layout: tensors in update-metadata order, each as its raw bytes in the engine dtype, packed
back to back into uint8 buckets of a little over ``bucket_bytes`` (``bucket_plan``). It is
vLLM's packed NCCL layout, so the same sender feeds vLLM's ``nccl`` workers and our ``gloo``
ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# Smaller than vLLM's 1 GiB NCCL default: on CPU a bucket is a host copy, and two of them are
# alive at once on each side (one on the wire, one being packed or loaded).
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 120.0
# gloo: a tensor this large is broadcast from its own memory rather than copied into a bucket.
DEFAULT_SEGMENT_BYTES = 1024 * 1024
# gloo relay (one group for the fleet): the unit a server receives and passes on to the next one
# while the following piece arrives. Small enough that the chain's fill time (one piece per hop)
# is negligible next to a bucket, large enough that per-message overhead is too.
DEFAULT_RELAY_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ParamMeta:
    """Name / wire dtype / full shape of one tensor (the fields of vLLM's ``ParamMeta``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


# --------------------------------------------------------------------------- wire layout


def bucket_plan(sizes: Iterable[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each bucket, given their sizes in bytes.

    The rule of vLLM's ``pack_tensors`` and ``packed_nccl_broadcast_consumer``: add tensors in
    order until the running total exceeds ``bucket_bytes``; the tensor that crosses the line
    closes its bucket. Both sides compute this from the update metadata alone, so only the
    packed bytes travel. ``tests/unit/common/test_weight_sync.py`` checks both against vLLM's ``pack_tensors``.
    """
    plan: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        cur.append(i)
        total += size
        if total > bucket_bytes:
            plan.append(cur)
            cur, total = [], 0
    if cur:
        plan.append(cur)
    return plan


class Buffers:
    """The sender's two reusable bucket buffers: bucket ``b`` is packed into buffer ``b % 2``
    while bucket ``b - 1`` is on the wire. Kept across pushes: a fresh large host allocation
    pays a page fault per 4 KiB on first touch, every time. (Receivers must not reuse theirs:
    vLLM's layerwise reload holds views of a bucket until the rest of their layer arrives.)"""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._bufs: list[torch.Tensor | None] = [None, None]

    def get(self, b: int, nbytes: int) -> torch.Tensor:
        buf = self._bufs[b % 2]
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[b % 2] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]


def segment_plan(sizes: list[int], segment_bytes: float) -> list[list[int]]:
    """How one bucket goes on the wire: runs of its tensors (positions within the bucket), one
    broadcast each. A tensor of at least ``segment_bytes`` is a run of its own and is sent from
    its own memory; smaller neighbours are packed into one run. The bucket's bytes are the same
    either way; only the number of collectives changes. NCCL (vLLM's consumer) wants one
    broadcast per bucket: ``segment_bytes=inf``. gloo sends big tensors without the packing copy."""
    runs: list[list[int]] = []
    for i, size in enumerate(sizes):
        if size >= segment_bytes:
            runs.append([i])
            runs.append([])
        else:
            if not runs:
                runs.append([])
            runs[-1].append(i)
    return [r for r in runs if r]


def chunk_spans(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the pieces one wire segment is relayed in (both ends cut alike)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return [(o, min(chunk_bytes, nbytes - o)) for o in range(0, nbytes, chunk_bytes)]


def iter_packed(
    pairs: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    buffers: Buffers | None = None,
    segment_bytes: float = float("inf"),
) -> Iterator[list[torch.Tensor]]:
    """The sender's half of ``bucket_plan``: per bucket, the uint8 tensors to broadcast in order
    (``segment_plan``), together the bytes of its tensors back to back (vLLM's ``pack_tensors``
    layout). With ``buffers``, bucket ``b`` packs into buffer ``b % 2``: the caller must be done
    sending bucket ``b - 2`` by then."""
    cur: list[torch.Tensor] = []
    total = 0
    b = 0

    def pack() -> list[torch.Tensor]:
        out = []
        buf = buffers.get(b, total) if buffers is not None and len(cur) > 1 else None
        off = 0
        for run in segment_plan([t.numel() for t in cur], segment_bytes):
            parts = [cur[i] for i in run]
            n = sum(t.numel() for t in parts)
            if n == 0:
                continue  # nothing to send (empty tensors); the receiver skips it too
            if len(parts) == 1:
                out.append(parts[0])  # sent from its own memory: no copy
            elif buf is None:
                out.append(torch.cat(parts))
            else:
                out.append(torch.cat(parts, out=buf[off : off + n]))
            off += n
        return out

    for _name, t in pairs:
        flat = t.contiguous().view(-1).view(torch.uint8)
        cur.append(flat)
        total += flat.numel()
        if total > bucket_bytes:
            yield pack()
            cur, total, b = [], 0, b + 1
    if cur:
        yield pack()


def unpack(
    buf: torch.Tensor, names: list[str], shapes: list[list[int]], dtypes: list[torch.dtype], sizes: list[int]
) -> list[tuple[str, torch.Tensor]]:
    """The receiver's half: views of ``buf`` as the named tensors (a copy only for a tensor whose
    bytes start unaligned for its dtype, which only mixed-dtype pushes produce)."""
    out = []
    for n, shape, dt, part in zip(names, shapes, dtypes, buf.split(sizes), strict=True):
        if part.storage_offset() % dt.itemsize:
            part = part.clone()
        out.append((n, part.view(dt).view(shape)))
    return out


# --------------------------------------------------------------------------- sending


def wait_work(work, what: str) -> None:
    """``work.wait()`` with the group's own timeout (set when it was formed), re-raised with
    ``what`` named: which group, which bucket."""
    try:
        work.wait()
    except Exception as e:  # gloo raises RuntimeError subclasses for everything
        raise RuntimeError(f"{what} failed: {e}") from e


def send_packed(
    pairs: Iterator[tuple[str, torch.Tensor]],
    groups: dict[str, Any],
    bucket_bytes: int,
    on_error=None,
    buffers: Buffers | None = None,
    segment_bytes: float = float("inf"),
) -> dict[str, str]:
    """Broadcasts ``pairs`` (in update-metadata order) bucket by bucket into every group of
    ``groups`` (name -> ``common.weights.base.SendGroup``) and returns {name: error} for groups
    that failed. A failed group is dropped and the rest carry on. The next bucket is packed
    while the current one is on the wire. (For NCCL, ``broadcast`` only enqueues.)"""
    live = dict(groups)
    failed: dict[str, str] = {}
    inflight: list[tuple[str, Any, str]] = []

    def drain() -> None:
        for name, work, what in inflight:
            if name not in live or work is None:
                continue
            try:
                wait_work(work, what)
            except RuntimeError as e:
                failed[name] = str(e)
                live.pop(name, None)
                if on_error is not None:
                    on_error(name, e)
        inflight.clear()

    keep = None  # the bucket on the wire must stay alive until its works complete
    # Packing bucket b (inside the generator) overlaps sending b - 1; b - 2 was drained before
    # b - 1 went out, so its buffer is free to pack into.
    for b, segments in enumerate(iter_packed(pairs, bucket_bytes, buffers, segment_bytes)):
        drain()
        keep = segments
        for name, group in list(live.items()):
            try:
                for seg in segments:
                    inflight.append((name, group.broadcast(seg, src=0), f"sending bucket {b + 1} to {name}"))
            except RuntimeError as e:
                failed[name] = f"sending bucket {b + 1} to {name} failed: {e}"
                live.pop(name)
    drain()
    del keep
    return failed
