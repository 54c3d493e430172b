"""Learner side of weight sync: push the policy's weights into the rollout servers' engines.

``WeightPublisher`` is what the learner calls. Per push it makes exactly one pass over the
weights (``ModelWeights``) and fans each packed bucket out to every target server at once:

    start    WeightUpdateStart   -> every server   servers pause, keeping in-flight requests
    update   WeightUpdate(meta)  -> every server   their workers start receiving
             bucket 1..B over each server's group  (gloo on CPU, NCCL on GPUs)
    finish   WeightUpdateFinish  -> every server   load done, prefix cache reset, version set

The three steps are vLLM's weight-transfer API (``start_weight_update`` / ``update_weights`` /
``finish_weight_update``), carried as ZMQ calls (``common/protocol.py`` tags 30-34) to the
server, which makes the vLLM calls. The tensors go over ``torch.distributed``: one group per
(learner, server), formed by ``connect`` (``WeightSyncInit``). Per-server groups let servers
join and leave without re-forming anything global; the cost is that rank 0 sends the bytes once
per server (a global group would broadcast once). See docs/rollout.md.

The backend is a switch: ``gloo`` (CPU; ``common/weight_transfer_gloo.py``, registered into
vLLM's registry) or ``nccl`` (GPU; vLLM's own backend on the worker, vLLM's communicator here).
Both use vLLM's packed layout, so the learner code is the same.

Multi-rank learners (DeepSpeed ZeRO-3): build a publisher on *every* rank and call ``push`` on
every rank at the same point. Each rank gathers each layer's parameters
(``deepspeed.zero.GatheredParameters``, a collective); only rank 0 talks to servers and sends.
``connect`` / ``disconnect`` are rank 0 alone.

Every step has a deadline. A server that dies or stalls (during a call or in the middle of a
broadcast) is reported by name in ``WeightSyncError.failures`` within ``timeout_s``; the others
are still updated, and the failed server's group is dropped (``connect`` it again to retry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from common import protocol as P
from common.transport import TransportError, free_port
from common.weight_transfer_wire import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_SEGMENT_BYTES,
    Buffers,
    GlooGroup,
    ParamMeta,
    dtype_name,
    send_packed,
)

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


class WeightSyncError(RuntimeError):
    """Some servers could not be brought to the new weights. ``failures``: {server: why}."""

    def __init__(self, what: str, failures: dict[str, str], report: PushReport | None = None) -> None:
        lines = "; ".join(f"{s}: {why}" for s, why in failures.items())
        super().__init__(f"{what} failed for {len(failures)} server(s): {lines}")
        self.failures = failures
        self.report = report


# --------------------------------------------------------------------------- the weights


def _unwrap(model: Any) -> torch.nn.Module:
    # A DeepSpeed engine (or DDP) wraps the trained module as `.module`; names must not carry
    # the wrapper's "module." prefix. An HF model has no `.module`.
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


class ModelWeights:
    """A vLLM ``WeightSource`` over a torch module: checkpoint (HF) names, in the engine dtype.

    - Tied parameters are listed under every name (``lm_head.weight`` and
      ``model.embed_tokens.weight``): some engines keep a separate ``lm_head``.
    - Under ZeRO-3 (parameters carry ``ds_id``), each layer's parameters are gathered on all
      ranks together; rank 0 copies them out while gathered (``keep=True``), other ranks only
      take part in the gather (``keep=False``).
    - Shapes come from ``ds_shape`` under ZeRO-3, so ``metadata()`` never gathers.

    It keeps ``vllm.distributed.weight_transfer.base.WeightSource``'s contract (metadata and
    iteration agree element for element) without importing vLLM: a learner that only sends
    weights does not load vLLM.
    """

    def __init__(self, model: Any, dtype: torch.dtype | None = None, keep: bool = True) -> None:
        self.module = _unwrap(model)
        self.dtype = dtype
        self.keep = keep
        self._params = list(self.module.named_parameters(remove_duplicate=False))
        self.zero3 = any(hasattr(p, "ds_id") for _, p in self._params)

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(n, self.dtype or p.dtype, tuple(p.ds_shape if self.zero3 else p.shape)) for n, p in self._params
        ]

    def nbytes(self) -> int:
        return sum(torch.Size(m.shape).numel() * m.dtype.itemsize for m in self.metadata())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        if not self.zero3:
            for name, p in self._params:
                yield name, p.detach().to(self.dtype or p.dtype)
            return
        import deepspeed

        for group in _layer_runs(self._params):
            unique = list({id(p): p for _, p in group}.values())
            # A collective: every rank gathers the same layer at the same time.
            with deepspeed.zero.GatheredParameters(unique, modifier_rank=None):
                for name, p in group:
                    # Copy out while gathered: the bucket is packed after the context exits.
                    yield name, (p.data.to(self.dtype or p.dtype, copy=True) if self.keep else None)


def _layer_runs(params: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    """Consecutive parameters of one layer (same prefix up to the first numeric segment, e.g.
    ``model.layers.3``): the unit gathered at once under ZeRO-3, so peak memory is one layer,
    not the model. Order is kept: it is the order the servers were told."""

    def key(name: str) -> str:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                return ".".join(parts[: i + 1])
        return name  # embeddings, final norm, lm_head: one each

    runs: list[list[tuple[str, Any]]] = []
    last = None
    for name, p in params:
        k = key(name)
        if not runs or k != last:
            runs.append([])
            last = k
        runs[-1].append((name, p))
    return runs


def _checked(pairs: Iterable[tuple[str, torch.Tensor]], meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Iteration checked against the metadata the servers were told to expect: a mismatch would
    cut buckets differently on the two sides, so it is an error naming the first bad tensor."""
    i = -1
    for i, (name, t) in enumerate(pairs):
        m = meta[i] if i < len(meta) else None
        if m is None or name != m.name or t.dtype != m.dtype or tuple(t.shape) != tuple(m.shape):
            want = f"{m.name} {m.dtype} {tuple(m.shape)}" if m else "nothing more"
            raise ValueError(
                f"weights changed while sending: tensor {i} is {name} {t.dtype} {tuple(t.shape)}, servers expect {want}"
            )
        yield name, t
    if i + 1 != len(meta):
        raise ValueError(f"weights changed while sending: {i + 1} tensors, servers expect {len(meta)}")


# --------------------------------------------------------------------------- control plane


class PendingReply(Protocol):
    def result(self, timeout: float) -> P.Message:
        """The reply, or CallTimeout / RemoteError / TransportError naming the server."""


class SyncControl(Protocol):
    """How the publisher reaches a server: send a call now, collect its reply later (so one
    thread can have calls out to many servers while it broadcasts). ``learner.controller.rollout_client.
    RolloutClient`` implements it over the controller's ROUTER socket."""

    def request(self, server: str, msg: P.Message) -> PendingReply: ...


# --------------------------------------------------------------------------- groups


class _CudaWork:
    """NCCL broadcasts are enqueued on a stream; waiting is polling an event, with a deadline
    (a dead NCCL peer never completes the kernel, so a plain synchronize would hang)."""

    def __init__(self, timeout_s: float) -> None:
        self.event = torch.cuda.Event()
        self.event.record()
        self.timeout_s = timeout_s

    def wait(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.event.query():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"NCCL broadcast not complete after {self.timeout_s:.0f} s (peer dead or stalled; "
                    "the communicator is unusable and must be dropped)"
                )
            time.sleep(0.001)


class _NcclGroup:
    def __init__(self, comm: Any, timeout_s: float) -> None:
        self.comm, self.timeout_s = comm, timeout_s

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> _CudaWork:
        self.comm.broadcast(tensor, src=src)
        return _CudaWork(self.timeout_s)

    def close(self) -> None:
        destroy = getattr(self.comm, "destroy", None)
        if callable(destroy):
            destroy()


@dataclass
class _Link:
    server: str
    group: Any
    workers: int
    pushes: int = 0


@dataclass
class PushReport:
    version: int
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    bytes_per_server: int = 0
    seconds: dict[str, float] = field(default_factory=dict)  # start, transfer, finish, total


# --------------------------------------------------------------------------- publisher


class WeightPublisher:
    """Learner-side half of weight sync (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        *,
        control: SyncControl | None = None,
        rank: int = 0,
        backend: str = "gloo",
        dtype: torch.dtype | str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.control, self.rank, self.backend = control, rank, backend
        self.bucket_bytes, self.timeout_s, self.host = bucket_bytes, timeout_s, host
        # gloo only (vLLM's NCCL consumer takes one broadcast per bucket): tensors this large go
        # out from their own memory instead of being copied into the bucket first.
        self.segment_bytes = DEFAULT_SEGMENT_BYTES
        self.source = ModelWeights(model, _dtype(dtype), keep=rank == 0)
        self.links: dict[str, _Link] = {}
        self.version: int | None = None  # last version pushed by this publisher
        self._buffers: Buffers | None = None  # 2 x bucket, on the weights' device, kept between pushes

    @property
    def dtype(self) -> torch.dtype | None:
        return self.source.dtype

    @property
    def servers(self) -> list[str]:
        return list(self.links)

    # -- groups
    def connect(self, server: str, workers: int, dtype: str | None = None) -> None:
        """Forms the weight group with ``server`` (rank 0 only). ``workers``: its vLLM worker
        count; ``dtype``: its engine dtype (from its Hello) -- all servers must share one."""
        self._sender_only("connect")
        if self.control is None:
            raise RuntimeError("no control channel to reach the servers (e.g. RolloutClient(..., publisher))")
        if dtype:
            want = _dtype(dtype)
            if self.source.dtype is None:
                self.source.dtype = want
            elif want != self.source.dtype:
                raise WeightSyncError(
                    "connect", {server: f"engine dtype {want} differs from the other servers' {self.source.dtype}"}
                )
        if server in self.links:
            self.disconnect(server)
        world = 1 + workers
        t0 = time.monotonic()
        try:
            if self.backend == "gloo":
                store = GlooGroup.host_store(self.host, world, self.timeout_s)
                port = store.port
                # Workers wait twice as long as we do: when one server stalls, we wait timeout_s on
                # it before dropping it, and the healthy servers, waiting for their next bucket
                # meanwhile, must not time out first.
                init_info = {
                    "master_address": self.host,
                    "master_port": port,
                    "world_size": world,
                    "rank_offset": 1,
                    "packed_buffer_size_bytes": self.bucket_bytes,
                    "segment_bytes": self.segment_bytes,
                    "timeout_s": 2 * self.timeout_s,
                }
            else:
                port = free_port(self.host)
                init_info = {
                    "master_address": self.host,
                    "master_port": port,
                    "world_size": world,
                    "rank_offset": 1,
                    "packed": True,
                    "packed_buffer_size_bytes": self.bucket_bytes,
                    "packed_num_buffers": 2,
                }
            pending = self.control.request(
                server, P.WeightSyncInit(backend=self.backend, init_info=init_info, timeout_s=self.timeout_s)
            )
            # The server's workers are joining now; forming the group blocks until they have.
            if self.backend == "gloo":
                group = GlooGroup.open(self.host, port, 0, world, timeout_s=self.timeout_s, label=server, store=store)
            else:
                from vllm.distributed.weight_transfer.nccl_common import trainer_init

                group = _NcclGroup(
                    trainer_init({"master_address": self.host, "master_port": port, "world_size": world}),
                    self.timeout_s,
                )
            pending.result(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - re-raised naming the server
            raise WeightSyncError("connect", {server: f"{type(e).__name__}: {e}"}) from e
        self.links[server] = _Link(server, group, workers)
        log.info(
            "weight group with %s formed (%s, %d rank(s), %.2f s)", server, self.backend, world, time.monotonic() - t0
        )

    def disconnect(self, server: str, notify: bool = True) -> None:
        """Drops the group with ``server``; tells it to leave too unless it is gone (``notify``)."""
        link = self.links.pop(server, None)
        if link is None:
            return
        if notify and self.control is not None:
            try:
                self.control.request(server, P.WeightSyncClose()).result(min(self.timeout_s, 5.0))
            except TransportError as e:
                log.warning("%s did not acknowledge leaving the weight group: %s", server, e)
        link.group.close()

    def close(self) -> None:
        for server in list(self.links):
            self.disconnect(server, notify=False)

    # -- pushing
    def push(self, version: int, servers: Iterable[str] | None = None) -> PushReport:
        """Sends the current weights as ``version`` to ``servers`` (default: every connected
        one). Call on every learner rank. Raises WeightSyncError naming servers that failed
        (those that succeeded are in ``err.report.updated``)."""
        meta = self.source.metadata()
        report = PushReport(version=version, bytes_per_server=self.source.nbytes())
        if self.rank != 0:
            for _ in self.source:  # the ZeRO-3 gathers are collectives: every rank iterates
                pass
            return report
        t0 = time.monotonic()
        targets = list(self.links) if servers is None else list(servers)
        failures = {s: "not connected (connect it first)" for s in targets if s not in self.links}
        ok = [s for s in targets if s in self.links]

        ok = self._step(ok, lambda s: P.WeightUpdateStart(policy_version=version), "start", failures)
        report.seconds["start"] = time.monotonic() - t0
        update = P.WeightUpdate(
            names=[m.name for m in meta],
            dtype_names=[dtype_name(m.dtype) for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        pending = self._send_all(ok, lambda s: update, "update", failures)
        t1 = time.monotonic()
        if pending:
            groups = {s: self.links[s].group for s in pending}
            if self._buffers is None:
                self._buffers = Buffers(next(self.source.module.parameters()).device)
            try:
                failed = send_packed(
                    _checked(self.source, meta),
                    groups,
                    self.bucket_bytes,
                    buffers=self._buffers,
                    segment_bytes=self.segment_bytes if self.backend == "gloo" else float("inf"),
                )
            except BaseException:
                # Our side broke mid-transfer (e.g. the weights changed shape): every group in
                # this push is out of step now.
                for s in pending:
                    self.disconnect(s, notify=False)
                raise
            failures.update(failed)
            pending = {s: p for s, p in pending.items() if s not in failed}
        else:
            for _ in self.source:  # stay in step with the other ranks' gathers
                pass
        ok = self._collect(pending, "update", failures)
        report.seconds["transfer"] = time.monotonic() - t1
        t2 = time.monotonic()
        ok = self._step(ok, lambda s: P.WeightUpdateFinish(policy_version=version), "finish", failures)
        report.seconds["finish"] = time.monotonic() - t2
        report.seconds["total"] = time.monotonic() - t0
        report.updated, report.failed = ok, failures
        for s in ok:
            self.links[s].pushes += 1
        for s in failures:
            if s in self.links:
                # A group that failed mid-transfer is out of step for good: drop it.
                self.disconnect(s, notify=False)
        self.version = version
        log.info(
            "pushed v%d to %d server(s) in %.2f s (%.1f MB each)%s",
            version,
            len(ok),
            report.seconds["total"],
            report.bytes_per_server / 1e6,
            f"; failed: {failures}" if failures else "",
        )
        if failures:
            raise WeightSyncError(f"weight push v{version}", failures, report)
        return report

    # -- helpers
    def _sender_only(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what} is rank 0's job (this is rank {self.rank})")

    def _send_all(self, servers: list[str], make, step: str, failures: dict[str, str]) -> dict[str, PendingReply]:
        pending = {}
        for s in servers:
            try:
                pending[s] = self.control.request(s, make(s))
            except TransportError as e:
                failures[s] = f"{step}: {e}"
        return pending

    def _collect(self, pending: dict[str, PendingReply], step: str, failures: dict[str, str]) -> list[str]:
        deadline = time.monotonic() + self.timeout_s
        ok = []
        for s, p in pending.items():
            try:
                p.result(max(0.0, deadline - time.monotonic()))
                ok.append(s)
            except TransportError as e:
                failures[s] = f"{step}: {e}"
        return ok

    def _step(self, servers: list[str], make, step: str, failures: dict[str, str]) -> list[str]:
        return self._collect(self._send_all(servers, make, step, failures), step, failures)


def _dtype(d: torch.dtype | str | None) -> torch.dtype | None:
    if d is None or isinstance(d, torch.dtype):
        return d
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}.get(d, d)
    got = getattr(torch, name, None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"unknown dtype {d!r}")
    return got
