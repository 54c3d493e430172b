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

The backend is a name (``common.weights.base.SENDERS``: ``gloo``, ``nccl``, or ``auto``): it
picks the ``WeightSender`` that forms the groups and moves the buckets; everything here is the
same for all of them.

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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from common import protocol as P
from common.dtypes import dtype_name, to_dtype
from common.transport import TransportError
from common.weights.base import SendGroup, resolve_backend, sender_class
from common.weights.source import ModelWeights, checked
from common.weights.wire import DEFAULT_BUCKET_BYTES, Buffers

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """Some servers could not be brought to the new weights. ``failures``: {server: why}."""

    def __init__(self, what: str, failures: dict[str, str], report: PushReport | None = None) -> None:
        lines = "; ".join(f"{s}: {why}" for s, why in failures.items())
        super().__init__(f"{what} failed for {len(failures)} server(s): {lines}")
        self.failures = failures
        self.report = report


# --------------------------------------------------------------------------- control plane


class PendingReply(Protocol):
    def result(self, timeout: float) -> P.Message:
        """The reply, or CallTimeout / RemoteError / TransportError naming the server."""


class SyncControl(Protocol):
    """How the publisher reaches a server: send a call now, collect its reply later (so one
    thread can have calls out to many servers while it broadcasts). ``learner.controller.rollout_client.
    RolloutClient`` implements it over the controller's ROUTER socket."""

    def request(self, server: str, msg: P.Message) -> PendingReply: ...


@dataclass
class _Link:
    server: str
    group: SendGroup
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
        self.control, self.rank, self.backend = control, rank, resolve_backend(backend)
        self.timeout_s = timeout_s
        self.sender = sender_class(self.backend)(host=host, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        self.source = ModelWeights(model, to_dtype(dtype), keep=rank == 0)
        self.links: dict[str, _Link] = {}
        self.version: int | None = None  # last version pushed by this publisher
        self._buffers: Buffers | None = None  # 2 x bucket, on the weights' device, kept between pushes

    @property
    def dtype(self) -> torch.dtype | None:
        return self.source.dtype

    @property
    def servers(self) -> list[str]:
        return list(self.links)

    @property
    def segment_bytes(self) -> float:
        """Tensors this large go out from their own memory, not copied into a bucket first
        (gloo; NCCL's consumer takes one broadcast per bucket). Set before ``connect``: the
        server is told it when its group forms."""
        return self.sender.segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, value: float) -> None:
        self.sender.segment_bytes = value

    # -- groups
    def connect(self, server: str, workers: int, dtype: str | None = None) -> None:
        """Forms the weight group with ``server`` (rank 0 only). ``workers``: its vLLM worker
        count; ``dtype``: its engine dtype (from its Hello) -- all servers must share one."""
        self._sender_only("connect")
        if self.control is None:
            raise RuntimeError("no control channel to reach the servers (e.g. RolloutClient(..., publisher))")
        if dtype:
            want = to_dtype(dtype)
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
            rendezvous = self.sender.listen(world)
            pending = self.control.request(
                server, P.WeightSyncInit(backend=self.backend, init_info=rendezvous.init_info, timeout_s=self.timeout_s)
            )
            # The server's workers are joining now; forming the group blocks until they have.
            group = rendezvous.join(server)
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
                failed = self.sender.send(checked(self.source, meta), groups, self._buffers)
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
