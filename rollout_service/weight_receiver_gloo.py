"""The gloo backend's worker half: receives a push inside vLLM's workers, for CPU servers.

vLLM 0.32 moves trainer weights into a running engine through
``vllm.distributed.weight_transfer``: each worker owns a ``WeightTransferEngine`` chosen by
name from ``WeightTransferEngineFactory`` (``weight_transfer_config.backend``), and the engine
exposes init / start / update / finish as collective RPCs. The built-in ``nccl`` engine needs
CUDA. ``GlooWeightTransferEngine`` is a ``gloo`` engine with the same interface and the same wire
layout as ``nccl`` in packed mode:

- it joins the learner's group (``common.weights.gloo.GlooGroup``) as ranks 1..k, the learner
  being rank 0 (``common.weights.gloo.GlooSender`` is the learner's half);
- tensors arrive in the engine's dtype, packed into uint8 buckets of about
  ``packed_buffer_size_bytes``, cut by the same rule vLLM's packed NCCL consumer uses
  (``common/weights/wire.py``), so one learner-side sender serves both backends;
- buckets are loaded through the model's ``load_weights`` inside vLLM's layerwise reload
  (``start`` / ``finish``), exactly like the NCCL engine; the next bucket is already being
  received while the current one loads;
- every collective carries a timeout: a learner that dies or stalls turns into an error naming
  it, never a hang;
- in a fleet group (``relay``: one group over every server, ``common/weights/gloo.py``) a worker
  receives each piece from the rank before it and passes it on to the rank after it while the
  next piece arrives. A failure to pass on is logged, not raised: this worker's own weights are
  complete, and the server behind reports for itself.

vLLM creates the engine from its registry: ``rollout_service/weight_receiver.py`` registers it
there, in every worker.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from common.dtypes import torch_dtype
from common.weights.gloo import GlooGroup
from common.weights.wire import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_RELAY_CHUNK_BYTES,
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_TIMEOUT_S,
    bucket_plan,
    chunk_spans,
    segment_plan,
    unpack,
    wait_work,
)

# Under "vllm." so that, inside vLLM's workers, it goes through vLLM's log handler.
log = logging.getLogger("vllm.rayless.weight_receiver_gloo")


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the learner's group: the learner's store, the group size,
    where this server's workers start, and the must-agree wire parameters."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    segment_bytes: int = DEFAULT_SEGMENT_BYTES  # must equal the sender's (common/weights/gloo.py)
    timeout_s: float = DEFAULT_TIMEOUT_S
    # Joining the learner's store, if shorter than timeout_s: RolloutCore passes what is left of
    # the learner's own wait, so a worker never keeps connecting to a store the learner dropped.
    rendezvous_timeout_s: float | None = None
    # A fleet group: receive from rank - 1 in pieces of relay_chunk_bytes, pass on to rank + 1.
    relay: bool = False
    relay_chunk_bytes: int = DEFAULT_RELAY_CHUNK_BYTES


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-round metadata: the fields of vLLM's ``NCCLWeightTransferUpdateInfo``, and
    ``aliases`` (``WeightUpdate.aliases``): names loaded from another name's received tensor."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    aliases: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names/dtype_names/shapes differ in length: "
                f"{len(self.names)}/{len(self.dtype_names)}/{len(self.shapes)}"
            )
        for d in self.dtype_names:
            torch_dtype(d)  # raises naming it
        sent = set(self.names)
        for alias, name in self.aliases.items():
            if name not in sent:
                raise ValueError(f"alias {alias!r} names {name!r}, which is not sent")


def _storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s storage (None where torch does not say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(t.untyped_storage()._cdata) - 1  # minus the temporary


class ReceivePool:
    """Receive buffers reused across buckets and pushes.

    A fresh host buffer pays a page fault per 4 KiB on first touch: measured here, receiving
    into a new 64 MiB buffer costs 5x a reused one, which is most of a raw CPU broadcast. But a
    bucket cannot be recycled blindly: vLLM's layerwise reload keeps views of it until every
    weight of their layer has arrived, possibly buckets later. So a buffer is handed out again
    only when nothing else references its storage (no view, no in-flight broadcast); otherwise
    a new one is made. After a push the largest ``keep`` buffers stay (``keep`` x bucket size of
    host memory between pushes)."""

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self.buffers: list[torch.Tensor] = []
        self.reused = self.allocated = 0

    def get(self, nbytes: int) -> torch.Tensor:
        for buf in self.buffers:
            if buf.numel() >= nbytes and _storage_refs(buf) == 1:
                self.reused += 1
                return buf[:nbytes]
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.allocated += 1
        if _storage_refs(buf) is not None:  # else: no way to tell when it is free; never reuse
            self.buffers.append(buf)
        return buf

    def trim(self) -> None:
        self.buffers = sorted(self.buffers, key=lambda b: b.numel(), reverse=True)[: self.keep]


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: receives packed buckets over gloo and loads them with layerwise reload."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: GlooGroup | None = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.segment_bytes = DEFAULT_SEGMENT_BYTES
        self.relay, self.relay_chunk_bytes = False, DEFAULT_RELAY_CHUNK_BYTES
        self.pool = ReceivePool()
        # Works of a push that failed half-way, kept until the group goes: gloo may still be
        # writing into their buffers.
        self._abandoned: list = []

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        if self.group is not None:
            self.shutdown()  # a learner re-forming the group (after a failure) replaces it
        pc = self.parallel_config
        # Same rank layout as vLLM's NCCL backend: data-parallel replicas, then TP x PP ranks.
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.bucket_bytes = init_info.packed_buffer_size_bytes
        self.segment_bytes = init_info.segment_bytes
        self.relay, self.relay_chunk_bytes = init_info.relay, init_info.relay_chunk_bytes
        label = f"learner@{init_info.master_address}:{init_info.master_port}"
        join_s = min(init_info.timeout_s, init_info.rendezvous_timeout_s or init_info.timeout_s)
        # A store client retries a refused connect until its timeout, and overshoots it by up
        # to about 3x (measured with torch 2.x: 22 s for 8 s): a third of the budget keeps the
        # whole join within it. Collectives still get the full timeout_s.
        try:
            store = TCPStore(
                init_info.master_address,
                init_info.master_port,
                init_info.world_size,
                is_master=False,
                timeout=timedelta(seconds=max(join_s / 3, 1.0)),
            )
        except Exception as e:  # re-raised naming the learner
            raise RuntimeError(
                f"weight-transfer group {label}: the learner's store did not answer within {join_s:.0f} s "
                f"(it gave up on this group, or died): {e}"
            ) from e
        store.set_timeout(timedelta(seconds=join_s))  # forming the group: the learner is there
        self.group = GlooGroup.open(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            timeout_s=init_info.timeout_s,
            label=label,
            store=store,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.pool.trim()  # every layer is loaded: no view of a receive buffer is left

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a host
        # without an accelerator; gloo work is complete once wait() returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        dtypes = [torch_dtype(d) for d in update_info.dtype_names]
        sizes = [math.prod(s) * dt.itemsize for s, dt in zip(update_info.shapes, dtypes, strict=True)]
        plan = bucket_plan(sizes, self.bucket_bytes)
        group = self.group
        loaded_as: dict[str, list[str]] = {}  # sent name -> the other names it is loaded under
        for alias, name in update_info.aliases.items():
            loaded_as.setdefault(name, []).append(alias)
        relay = _Relay(group, self.relay_chunk_bytes) if self.relay else None
        source = f"rank {group.rank - 1} of {group.label}" if relay else group.label

        def post(b: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, Any]]]:
            # A buffer no view of an earlier bucket still uses (ReceivePool); each segment
            # (relay: each piece of it) lands in its slice of it.
            bsizes = [sizes[i] for i in plan[b]]
            buf = self.pool.get(sum(bsizes))
            works, off = [], 0
            for run in segment_plan(bsizes, self.segment_bytes):
                n = sum(bsizes[j] for j in run)
                if n and relay is not None:
                    works += relay.post(buf[off : off + n])
                elif n:
                    works.append((buf[off : off + n], group.broadcast(buf[off : off + n], src=0)))
                off += n
            return buf, works

        t0 = time.perf_counter()
        waited = 0.0
        reused, allocated = self.pool.reused, self.pool.allocated
        buf = None
        pending: tuple[torch.Tensor, list[tuple[torch.Tensor, Any]]] | None = None  # post()'s bucket b
        try:
            with disable_mtp_completeness_check():
                pending = post(0) if plan else None
                for b, idx in enumerate(plan):
                    assert pending is not None  # bucket b was posted: before the loop, or in turn b - 1
                    buf, works = pending
                    t = time.perf_counter()
                    for piece, work in works:
                        wait_work(work, f"receiving bucket {b + 1}/{len(plan)} from {source}")
                        if relay is not None:
                            relay.forward(piece)  # on to the next server while the next piece arrives
                    waited += time.perf_counter() - t
                    # Receive the next bucket while this one loads (gloo runs it on its own thread).
                    pending = post(b + 1) if b + 1 < len(plan) else None
                    pairs = unpack(
                        buf,
                        [update_info.names[i] for i in idx],
                        [update_info.shapes[i] for i in idx],
                        [dtypes[i] for i in idx],
                        [sizes[i] for i in idx],
                    )
                    self.model.load_weights(with_aliases(pairs, loaded_as) if loaded_as else pairs)
                    if relay is not None:
                        relay.settle(keep_last_bucket=True)
        except BaseException:
            # Receives still posted (and pieces still being passed on) write into or read from
            # these buffers: keep them alive until the group is dropped.
            self._abandoned.append((pending, relay))
            raise
        if relay is not None:
            relay.settle(keep_last_bucket=False)
            if relay.failed is not None:
                self._abandoned.append(relay)
        del buf, pending
        total = time.perf_counter() - t0
        log.info(
            "received %d tensors%s in %d buckets (%.1f MB) in %.3f s: %.3f s waiting for data, %.3f s loading; "
            "%d receive buffers reused, %d new%s",
            len(sizes),
            f" (+{len(update_info.aliases)} tied, loaded from them)" if update_info.aliases else "",
            len(plan),
            sum(sizes) / 1e6,
            total,
            waited,
            total - waited,
            self.pool.reused - reused,
            self.pool.allocated - allocated,
            f"; relayed to rank {group.rank + 1}" if relay is not None and relay.next is not None else "",
        )

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._abandoned.clear()


def with_aliases(pairs, loaded_as: dict[str, list[str]]):
    """``(name, tensor)`` pairs, each followed by the same tensor under the names tied to it (a
    tied lm_head is loaded from the received embedding; it was not sent again)."""
    for name, t in pairs:
        yield name, t
        for alias in loaded_as.get(name, ()):
            yield alias, t


class _Relay:
    """One worker's place in a fleet group's relay chain: pieces come from ``rank - 1`` and go on
    to ``rank + 1`` (none after the last rank). Passing on is best effort: if the next rank is
    dead or stalled, the first failed send (within the group's timeout) stops the forwarding and
    is logged; this worker's own receive is unaffected, and the server behind reports for itself
    (the learner retries it on its own)."""

    def __init__(self, group: GlooGroup, chunk_bytes: int) -> None:
        self.group, self.chunk_bytes = group, chunk_bytes
        self.prev = group.rank - 1
        self.next = group.rank + 1 if group.rank + 1 < group.world_size else None
        self.sent: list[list[tuple[torch.Tensor, Any]]] = [[]]  # per bucket: (piece, send work)
        self.failed: str | None = None
        self.stuck: list[tuple[torch.Tensor, Any]] = []

    def post(self, segment: torch.Tensor) -> list[tuple[torch.Tensor, Any]]:
        pieces = [segment[o : o + n] for o, n in chunk_spans(segment.numel(), self.chunk_bytes)]
        return [(p, self.group.recv(p, self.prev)) for p in pieces]

    def forward(self, piece: torch.Tensor) -> None:
        if self.next is not None and self.failed is None:
            self.sent[-1].append((piece, self.group.send(piece, self.next)))

    def settle(self, keep_last_bucket: bool) -> None:
        """Waits for the sends of the buckets before the last (all, at the end): the next rank is
        receiving them while this one loads, and their buffers must not be reused before."""
        done, self.sent = (self.sent[:-1], self.sent[-1:] + [[]]) if keep_last_bucket else (self.sent, [[]])
        for piece, work in (x for bucket in done for x in bucket):
            if self.failed is not None:
                self.stuck.append((piece, work))  # gloo may still read it: kept with the group
                continue
            try:
                wait_work(work, f"passing weights on to rank {self.next} of {self.group.label}")
            except RuntimeError as e:
                self.failed = str(e)
                log.warning("%s; this server's own weights are complete, the one behind it reports for itself", e)
