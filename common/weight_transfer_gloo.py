"""A gloo backend for vLLM's weight-transfer API, so CPU runs take the same path as NCCL.

vLLM 0.32 moves trainer weights into a running engine through
``vllm.distributed.weight_transfer``: each worker owns a ``WeightTransferEngine`` chosen by
name from ``WeightTransferEngineFactory`` (``--weight-transfer-config '{"backend": ...}'``), and
the engine exposes init / start / update / finish as collective RPCs. The built-in ``nccl``
backend needs CUDA. This module registers ``gloo`` with the same interface and the same wire
layout as ``nccl`` in packed mode:

- one process group per (learner, rollout server): the learner is rank 0 and hosts the
  ``TCPStore``; the server's vLLM workers are ranks 1..k. A plain ``ProcessGroupGloo`` on its
  own store, never the default process group, so it coexists with vLLM's own groups and
  DeepSpeed's, and a group can be formed or dropped while everything else keeps running;
- tensors travel in the engine's dtype, packed into uint8 buckets of about
  ``packed_buffer_size_bytes``, cut by the same rule vLLM's packed NCCL consumer uses
  (``common/weight_transfer_wire.py``), so one learner-side sender serves both backends;
- on the worker, buckets are loaded through the model's ``load_weights`` inside vLLM's layerwise
  reload (``start`` / ``finish``), exactly like the NCCL engine; the next bucket is already being
  received while the current one loads;
- every collective carries a timeout: a learner that dies or stalls turns into an error naming
  it, never a hang.

Registration must happen inside vLLM's worker processes, before the model loads. The rollout
server does it by naming ``rollout_service.worker_ext.RolloutWorkerExtension`` as vLLM's
``worker_extension_cls``: vLLM imports that class in every worker before ``load_model``, and
importing this module is what registers the backend (``register()``). The learner side calls
``register()`` too, for the trainer engine.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from common.weight_transfer_wire import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooGroup,
    bucket_plan,
    dtype_name,
    segment_plan,
    send_packed,
    unpack,
    wait_work,
)

# Under "vllm." so that, inside vLLM's workers, it goes through vLLM's log handler.
log = logging.getLogger("vllm.rayless.weight_transfer_gloo")

BACKEND = "gloo"


# --------------------------------------------------------------------------- worker side


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the learner's group: the learner's store, the group size,
    where this server's workers start, and the must-agree wire parameters."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    segment_bytes: int = DEFAULT_SEGMENT_BYTES  # must equal the sender's (common/weight_transfer_wire.py)
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-round metadata, the same fields as vLLM's ``NCCLWeightTransferUpdateInfo``."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names/dtype_names/shapes differ in length: "
                f"{len(self.names)}/{len(self.dtype_names)}/{len(self.shapes)}"
            )
        for d in self.dtype_names:
            if not isinstance(getattr(torch, d, None), torch.dtype):
                raise ValueError(f"unknown dtype name {d!r}")


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
        self.pool = ReceivePool()

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        if self.group is not None:
            self.shutdown()  # a learner re-forming the group (after a failure) replaces it
        pc = self.parallel_config
        # Same rank layout as vLLM's NCCL backend: data-parallel replicas, then TP x PP ranks.
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.bucket_bytes = init_info.packed_buffer_size_bytes
        self.segment_bytes = init_info.segment_bytes
        self.group = GlooGroup.open(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            timeout_s=init_info.timeout_s,
            label=f"learner@{init_info.master_address}:{init_info.master_port}",
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

        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        sizes = [math.prod(s) * dt.itemsize for s, dt in zip(update_info.shapes, dtypes)]
        plan = bucket_plan(sizes, self.bucket_bytes)
        group = self.group

        def post(b: int):
            # A buffer no view of an earlier bucket still uses (ReceivePool); each segment
            # lands in its slice of it.
            bsizes = [sizes[i] for i in plan[b]]
            buf = self.pool.get(sum(bsizes))
            works, off = [], 0
            for run in segment_plan(bsizes, self.segment_bytes):
                n = sum(bsizes[j] for j in run)
                if n:
                    works.append(group.broadcast(buf[off : off + n], src=0))
                off += n
            return buf, works

        t0 = time.perf_counter()
        waited = 0.0
        reused, allocated = self.pool.reused, self.pool.allocated
        buf = None
        with disable_mtp_completeness_check():
            pending = post(0) if plan else None
            for b, idx in enumerate(plan):
                buf, works = pending
                t = time.perf_counter()
                for work in works:
                    wait_work(work, f"receiving bucket {b + 1}/{len(plan)} from {group.label}")
                waited += time.perf_counter() - t
                # Receive the next bucket while this one loads (gloo runs it on its own thread).
                pending = post(b + 1) if b + 1 < len(plan) else None
                self.model.load_weights(
                    unpack(
                        buf,
                        [update_info.names[i] for i in idx],
                        [update_info.shapes[i] for i in idx],
                        [dtypes[i] for i in idx],
                        [sizes[i] for i in idx],
                    )
                )
        del buf, pending
        total = time.perf_counter() - t0
        log.info(
            "received %d tensors in %d buckets (%.1f MB) in %.3f s: %.3f s waiting for data, %.3f s loading; "
            "%d receive buffers reused, %d new",
            len(sizes),
            len(plan),
            sum(sizes) / 1e6,
            total,
            waited,
            total - waited,
            self.pool.reused - reused,
            self.pool.allocated - allocated,
        )

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


# --------------------------------------------------------------------------- trainer side


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info for vLLM's ``WeightTransferTrainerFactory`` (backend "gloo")."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    world_size: int
    master_port: int = 0  # 0: any free port, chosen by the store
    packed_buffer_size_bytes: int = DEFAULT_BUCKET_BYTES
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """vLLM's trainer-engine interface over ``GlooGroup``, for callers that drive one engine
    through a ``VLLMWeightSyncClient`` (vLLM's own RLHF examples do). The rayless learner uses
    ``common.weight_sync.WeightPublisher`` instead, which fans one pass over the weights out to
    many servers; both produce the same bytes on the wire."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self, *, client, source, is_sender=True, bucket_bytes=DEFAULT_BUCKET_BYTES, segment_bytes=DEFAULT_SEGMENT_BYTES
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes, self.segment_bytes = bucket_bytes, segment_bytes
        self.group: GlooGroup | None = None

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.packed_buffer_size_bytes,
            segment_bytes=init_info.segment_bytes,
        )
        if not engine.is_sender:
            return engine
        store = GlooGroup.host_store(
            init_info.master_address, init_info.world_size, init_info.timeout_s, init_info.master_port
        )
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=store.port,
            world_size=init_info.world_size,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            segment_bytes=init_info.segment_bytes,
            timeout_s=init_info.timeout_s,
        )
        from concurrent.futures import ThreadPoolExecutor

        # The workers block in init until everyone has joined, so the RPC runs beside us.
        with ThreadPoolExecutor(max_workers=1) as exe:
            fut = exe.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = GlooGroup.open(
                init_info.master_address,
                store.port,
                0,
                init_info.world_size,
                timeout_s=init_info.timeout_s,
                label="inference workers",
                store=store,
            )
            fut.result(timeout=init_info.timeout_s)
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # stay in the trainer-side gather collectives
                pass
            return
        from concurrent.futures import ThreadPoolExecutor

        self.client.start_weight_update()
        info = {
            "names": [m.name for m in meta],
            "dtype_names": [dtype_name(m.dtype) for m in meta],
            "shapes": [list(m.shape) for m in meta],
        }
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            fut = exe.submit(self.client.update_weights, info)
            failed = send_packed(
                iter(self.source), {"workers": self.group}, self.bucket_bytes, segment_bytes=self.segment_bytes
            )
            if failed:
                raise RuntimeError(failed["workers"])
            fut.result()
        finally:
            exe.shutdown(wait=False)  # never join an RPC thread stuck on a dead peer
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def register() -> None:
    """Adds "gloo" to vLLM's worker and trainer registries (idempotent)."""
    for factory, module, cls in (
        (WeightTransferEngineFactory, __name__, "GlooWeightTransferEngine"),
        (WeightTransferTrainerFactory, __name__, "GlooTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:
            pass  # already registered in this process


register()
