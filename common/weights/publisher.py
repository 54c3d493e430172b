"""Learner side of weight sync: push the policy's weights into the rollout servers' engines.

``WeightPublisher`` is what the learner calls. Per push it makes one pass over the weights
(``ModelWeights``) and sends each packed bucket once for the whole fleet:

    start    WeightUpdateStart   -> every server   servers pause, keeping in-flight requests
    update   WeightUpdate(meta)  -> every server   their workers start receiving
             bucket 1..B into the fleet group      (gloo on CPU: a relay; NCCL on GPUs: a broadcast)
    finish   WeightUpdateFinish  -> every server   load done, prefix cache reset, version set

The three steps are vLLM's weight-transfer API (``start_weight_update`` / ``update_weights`` /
``finish_weight_update``), carried as ZMQ calls (``common/protocol.py`` tags 30-34) to the
server, which makes the vLLM calls. The tensors go over ``torch.distributed`` groups formed with
``WeightSyncInit``:

- the fleet group: the learner and every target server's workers (each server told its
  ``rank_offset``), formed at a push whose targets are not exactly its members (a server joined,
  or one left or failed) -- so a push costs the learner about one model's bytes whatever the
  number of servers;
- a server's own group (``connect``): how a joiner is brought up to date between pushes, and how
  a server that failed in a fleet transfer is retried within the same push. A server's workers
  are in one group at a time; forming another replaces it.

LoRA (``lora_sync="adapter"``, a peft model): a push sends the adapter alone
(``AdapterWeights``, ``WeightUpdate.lora``), which the servers serve beside the base weights
(``WeightUpdateStart.adapter_only``: they do not pause). A push to a server that does not hold
this learner's base weights yet (a joiner; any server at the first push; one reconnected after
a failure) sends the base weights and the adapter in one pass, to every target of that push.

Delta pushes (``sync="delta"``, ``common.weights.delta``): a push sends, per tensor, only the
values that changed in the served dtype since the last push, and ends with a digest per tensor
that every server checks. A push to a server that does not hold the learner's last pushed copy
(``_Link.base_gen``: a joiner, a reconnect, a server left out of a push that changed it) is full,
to every target of that push, as with the LoRA adapter's base.

``fanout="per_server"`` keeps every server on its own group (one copy of the bytes per server,
fanned out from one pass): the old design, kept for comparison (``bench/weight_fanout.py``).

The backend is a name (``common.weights.base.SENDERS``: ``gloo``, ``nccl``, or ``auto``): it
picks the ``WeightSender`` that forms the groups and moves the buckets; everything here is the
same for all of them.

Multi-rank learners (DeepSpeed ZeRO-3): build a publisher on *every* rank and call ``push`` on
every rank at the same point. Each rank gathers each layer's parameters
(``deepspeed.zero.GatheredParameters``, a collective); only rank 0 talks to servers and sends.
``connect`` / ``disconnect`` are rank 0 alone.

Every step has a deadline. A server that dies or stalls (during a call or in the middle of a
transfer) is reported by name in ``WeightSyncError.failures`` within about ``timeout_s`` (plus
up to 10 s, in a fleet transfer);
the others are still updated (in a fleet transfer, those the failure cut off are retried on
their own groups in a second pass, which the other ZeRO-3 ranks are told about), and the failed
server's group is dropped (``connect`` it again to retry). The fleet group is formed again
without it at the next push.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from common import protocol as P
from common.dtypes import dtype_name, to_dtype
from common.transport import RemoteError, TransportError
from common.weights.base import Rendezvous, SendGroup, resolve_backend, sender_class
from common.weights.delta import SYNCS, EncodedWeights, PushStats
from common.weights.source import AdapterWeights, ModelWeights, checked
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


FLEET = "<fleet>"  # the fleet group's key among the groups a push sends into
FANOUTS = ("fleet", "per_server")


@dataclass
class _Link:
    server: str
    workers: int
    group: SendGroup | None  # its own group; None while it is in the fleet group (or has none)
    based: bool = False  # holds this learner's base weights (lora_sync="adapter": pushes may send only the adapter)
    base_gen: int = -1  # sync="delta": the EncodedWeights.generation it holds (-1: none)


class _WithAdapter:
    """The base weights, then the adapter, as one source: one pass, one ``WeightUpdate``."""

    def __init__(self, base: ModelWeights, adapter: AdapterWeights) -> None:
        self.base, self.adapter = base, adapter
        self.module, self.aliases, self.lora, self.zero3 = base.module, base.aliases, adapter.lora, base.zero3

    def metadata(self) -> list:
        return self.base.metadata() + self.adapter.metadata()

    def nbytes(self) -> int:
        return self.base.nbytes() + self.adapter.nbytes()

    def __iter__(self):
        yield from self.base
        yield from self.adapter


@dataclass
class _Fleet:
    members: list[str]  # in rank order: the relay runs through them in this order
    group: SendGroup


@dataclass
class PushReport:
    version: int
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    bytes_per_server: int = 0
    # start, transfer (bytes out and every server's update reply, vLLM's load included), send
    # (the learner's own part of transfer: its bytes on the wire), finish, total; a push with a
    # retry adds the retry's time to each. sync="delta" adds encode (reading and diffing the
    # weights before the metadata goes out), which total includes.
    seconds: dict[str, float] = field(default_factory=dict)
    fleet: list[str] = field(default_factory=list)  # updated by the one fleet-wide transfer
    retried: list[str] = field(default_factory=list)  # failed in the fleet, then pushed on their own
    sync: PushStats | None = None  # sync="delta": the encoding, values changed, tensors sparse/whole


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
        fanout: str = "fleet",
        lora_sync: str = "merged",
        sync: str = "full",
    ) -> None:
        if fanout not in FANOUTS:
            raise ValueError(f"unknown fanout {fanout!r} (known: {', '.join(FANOUTS)})")
        if lora_sync not in ("merged", "adapter"):
            raise ValueError(f"unknown lora_sync {lora_sync!r} (merged, adapter)")
        if sync not in SYNCS:
            raise ValueError(f"unknown weight_sync {sync!r} (known: {', '.join(SYNCS)})")
        if sync == "delta" and lora_sync == "adapter":
            raise ValueError("weight_sync delta sends merged weights: it does not combine with lora_sync adapter")
        self.control, self.rank, self.backend = control, rank, resolve_backend(backend)
        self.timeout_s, self.fanout = timeout_s, fanout
        self.sender = sender_class(self.backend)(host=host, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        adapter = lora_sync == "adapter"
        self.source = ModelWeights(
            model, to_dtype(dtype), keep=rank == 0, tied_once=self.sender.sends_tied_once, merge=not adapter
        )
        # lora_sync="adapter": what most pushes send (the base weights go once per server).
        self.adapter = AdapterWeights(model, self.source.dtype, keep=rank == 0) if adapter else None
        # sync="delta": the copy of the last push (host memory, rank 0) and the encoder.
        self.encoded = EncodedWeights(self.source, keep=rank == 0) if sync == "delta" else None
        self.links: dict[str, _Link] = {}
        self.fleet: _Fleet | None = None
        self.fleet_builds = 0  # how many times a fleet group was formed (rebuilds included)
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
        """Forms ``server``'s own weight group (rank 0 only): how a joiner is brought up to date
        between pushes. ``workers``: its vLLM worker count; ``dtype``: its engine dtype (from its
        Hello) -- all servers must share one. It joins the fleet group at the next push.
        Fails as soon as the server answers with an error, naming it and quoting the error."""
        self._sender_only("connect")
        if self.control is None:
            raise RuntimeError("no control channel to reach the servers (WeightPublisher(..., control=RolloutClient))")
        if dtype:
            want = to_dtype(dtype)
            if self.source.dtype is None:
                self.source.dtype = want
                if self.adapter is not None:
                    self.adapter.dtype = want
            elif want != self.source.dtype:
                raise WeightSyncError(
                    "connect", {server: f"engine dtype {want} differs from the other servers' {self.source.dtype}"}
                )
        if server in self.links:
            self.disconnect(server)
        self._connect_own(server, workers)

    def _connect_own(self, server: str, workers: int) -> None:
        """Forms ``server``'s own group; its workers leave whatever group they were in."""
        world = 1 + workers
        t0 = time.monotonic()
        try:
            rendezvous = self.sender.listen(world)
            pending = {server: self._sync_init(server, rendezvous.init_info)}
        except Exception as e:  # re-raised naming the server
            raise WeightSyncError("connect", {server: f"{type(e).__name__}: {e}"}) from e
        group, errors = self._form(rendezvous, pending, server)
        if group is None:
            raise WeightSyncError("connect", errors)
        if self.fleet is not None and server in self.fleet.members:
            self._drop_fleet(f"{server} left it for a group of its own")
        self.links[server] = _Link(server, workers, group)
        log.info(
            "weight group with %s formed (%s, %d rank(s), %.2f s)", server, self.backend, world, time.monotonic() - t0
        )

    def disconnect(self, server: str, notify: bool = True) -> None:
        """Drops ``server``'s weight group (the fleet's, if it is in it: the others rejoin a new
        one at the next push); tells it to leave too unless it is gone (``notify``)."""
        link = self.links.pop(server, None)
        if link is None:
            return
        if self.fleet is not None and server in self.fleet.members:
            self._drop_fleet(f"{server} left")
        if notify and self.control is not None:
            try:
                self.control.request(server, P.WeightSyncClose()).result(min(self.timeout_s, 5.0))
            except TransportError as e:
                log.warning("%s did not acknowledge leaving the weight group: %s", server, e)
        if link.group is not None:
            link.group.close()

    def close(self) -> None:
        for server in list(self.links):
            self.disconnect(server, notify=False)
        self._drop_fleet("closed")

    def _channel(self) -> SyncControl:
        if self.control is None:
            raise RuntimeError("no control channel to reach the servers (WeightPublisher(..., control=RolloutClient))")
        return self.control

    def _own_group(self, server: str) -> SendGroup:
        group = self.links[server].group
        if group is None:
            raise RuntimeError(f"{server} has no weight group of its own (it is in the fleet's)")
        return group

    def _sync_init(self, server: str, init_info: dict[str, Any]) -> PendingReply:
        return self._channel().request(
            server, P.WeightSyncInit(backend=self.backend, init_info=init_info, timeout_s=self.timeout_s)
        )

    def _form(
        self, rendezvous: Rendezvous, pending: dict[str, PendingReply], label: str, grace_s: float = 0.0
    ) -> tuple[SendGroup | None, dict[str, str]]:
        """Completes a group whose servers were sent their ``WeightSyncInit`` (``pending``): our
        side joins on a thread while their replies are collected here (the control channel is
        not thread-safe). Returns the group, or None and {server: why}. Fails fast: a server that
        answers with an error cannot join, so nothing more is waited for then (``grace_s`` > 0,
        for a fleet: the other servers' replies are still collected for up to that long past the
        timeout, so that their rendezvous has ended when they are asked again)."""
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = rendezvous.join(label)
            except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
                box["error"] = e

        t = threading.Thread(target=join, name=f"weight-group-{label}", daemon=True)
        t.start()
        # The workers give up joining after the rendezvous timeout the sender gave them, if any.
        deadline = time.monotonic() + min(
            self.timeout_s, rendezvous.init_info.get("rendezvous_timeout_s") or self.timeout_s
        )
        errors: dict[str, str] = {}
        for s, p in pending.items():
            if errors and not grace_s:
                wait = 0.0  # fail fast; a reply to this call after now is dropped as late
            else:
                wait = max(0.0, deadline + (grace_s if errors else 0.0) - time.monotonic())
            try:
                p.result(wait)
            except TransportError as e:
                errors[s] = f"{type(e).__name__}: {e}"
        if errors:
            return None, errors  # the join thread ends on its own within the timeout
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
        if "group" in box:
            return box["group"], {}
        why = box.get("error") or f"the group did not form within {self.timeout_s:.0f} s"
        if not isinstance(why, str):
            why = f"{type(why).__name__}: {why}"
        return None, {s: why for s in pending}

    def _drop_fleet(self, why: str) -> None:
        if self.fleet is not None:
            log.info("fleet weight group over %s dropped: %s", ",".join(self.fleet.members), why)
            self.fleet.group.close()
            self.fleet = None

    def _ensure_fleet(self, servers: list[str]) -> bool:
        """The fleet group over exactly ``servers``: the current one if its members are these,
        else a new one (the joiners since the last push, or without the servers gone since).
        False if it could not form: this push then goes to each server on its own group."""
        if self.fleet is not None and set(self.fleet.members) == set(servers):
            return True
        self._drop_fleet("membership changed")
        for s in servers:
            # Their workers leave their own group to join the fleet's.
            link = self.links[s]
            if link.group is not None:
                link.group.close()
                link.group = None
        t0 = time.monotonic()
        world = 1 + sum(self.links[s].workers for s in servers)
        pending: dict[str, PendingReply] = {}
        errors: dict[str, str] = {}
        try:
            rendezvous = self.sender.listen(world, fleet=True)
            offset = 1
            for s in servers:
                try:
                    pending[s] = self._sync_init(s, {**rendezvous.init_info, "rank_offset": offset})
                except TransportError as e:
                    errors[s] = f"{type(e).__name__}: {e}"
                offset += self.links[s].workers
        except Exception as e:  # noqa: BLE001 - logged; the push falls back to per-server groups
            errors["<learner>"] = f"{type(e).__name__}: {e}"
        group = None
        if errors:
            for p in pending.values():  # not waited for: a late reply is dropped
                try:
                    p.result(0.0)
                except TransportError:
                    pass
        else:
            group, errors = self._form(
                rendezvous, pending, f"fleet of {len(servers)}", grace_s=min(self.timeout_s, 10.0)
            )
        if group is None:
            log.warning("fleet weight group over %s did not form (%s); pushing to each on its own", servers, errors)
            return False
        self.fleet = _Fleet(list(servers), group)
        self.fleet_builds += 1
        log.info(
            "fleet weight group formed over %d server(s), %d rank(s) (%s, %.2f s)",
            len(servers),
            world,
            self.backend,
            time.monotonic() - t0,
        )
        return True

    # -- pushing
    def push(self, version: int, servers: Iterable[str] | None = None) -> PushReport:
        """Sends the current weights as ``version`` to ``servers`` (default: every connected
        one). Call on every learner rank. Raises WeightSyncError naming servers that failed
        (those that succeeded are in ``err.report.updated``).

        Two or more servers (``fanout="fleet"``): one transfer through the fleet group (formed
        again first if its members are not exactly these servers). A server that fails in it is
        pushed to on its own group right after, in a second pass over the weights; one that
        fails there too, or never answered, is reported. One server, or ``fanout="per_server"``:
        each server's own group, all fanned out from one pass.

        ``lora_sync="adapter"``: the adapter alone, or the base weights and the adapter when a
        target does not hold the base yet (``_Link.based``)."""
        targets = list(self.links) if servers is None else list(servers)
        ok = [s for s in targets if s in self.links]
        whole = self.adapter is None or any(not self.links[s].based for s in ok)
        if self.adapter is not None:
            whole = self._rank0_says(whole)  # ZeRO-3: the other ranks learn what rank 0 sends
        t0 = time.monotonic()
        if self.encoded is not None:
            # Full unless every target holds the copy the delta is taken against.
            full = self._rank0_says(any(self.links[s].base_gen != self.encoded.generation for s in ok))
            self.encoded.prepare(full)  # a delta is encoded here (ZeRO-3: the gathers, every rank)
        try:
            return self._push(version, targets, ok, whole, t0)
        finally:
            if self.encoded is not None:
                self.encoded.end()

    def _push(self, version: int, targets: list[str], ok: list[str], whole: bool, t0: float) -> PushReport:
        src = self.encoded if self.encoded is not None else self._source(whole)
        report = PushReport(version=version, bytes_per_server=src.nbytes())
        if self.encoded is not None:
            self._add_seconds(report, "encode", t0)  # the delta's own pass over the weights (full: none)
        if self.rank != 0:
            while True:
                for _ in src:  # the ZeRO-3 gathers are collectives: every rank iterates
                    pass
                if not self._rank0_says(False):
                    return report
        meta = src.metadata()
        failures = {s: "not connected (connect it first)" for s in targets if s not in self.links}
        own: list[str] = []
        if self.fanout == "fleet" and len(ok) > 1 and self._ensure_fleet(ok):
            report.fleet = self._push_fleet(version, src, meta, report, failures)  # pass 1
            report.retried = [s for s in ok if s not in report.fleet and s not in failures]
            if self.fleet is not None and (failures or report.retried):
                self._drop_fleet("a server failed in it; formed again at the next push")
            # Other ranks (ZeRO-3) must know whether a second pass follows. Not in a `finally`:
            # if this pass broke half-way, their gathers are out of step already.
            if self._rank0_says(bool(report.retried)):
                own = self._push_own_groups(report.retried, version, src, meta, report, failures)  # pass 2
                self._rank0_says(False)
        else:
            own = self._push_own_groups(ok, version, src, meta, report, failures)
            self._rank0_says(False)
        report.updated = report.fleet + own
        report.seconds["total"] = time.monotonic() - t0
        report.failed = failures
        for s in report.updated:
            self.links[s].based = True  # every push sends the base weights until they have them
            if self.encoded is not None:
                self.links[s].base_gen = self.encoded.generation
        if self.encoded is not None:
            report.sync = self.encoded.stats
        for s in failures:
            if s in self.links:
                # A group that failed mid-transfer is out of step for good: drop it.
                self.disconnect(s, notify=False)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in report.seconds.items() if k != "total")
        log.info(
            "pushed v%d to %d server(s) in %.2f s (%s; %.1f MB each%s%s%s)%s",
            version,
            len(report.updated),
            report.seconds["total"],
            parts,
            report.bytes_per_server / 1e6,
            "" if self.adapter is None else ", the base weights and the adapter" if whole else ", the adapter",
            "" if report.sync is None else _describe(report.sync),
            f"; {len(report.fleet)} through the fleet group" if report.fleet else "",
            f"; failed: {failures}" if failures else "",
        )
        if failures:
            raise WeightSyncError(f"weight push v{version}", failures, report)
        return report

    # -- helpers
    def _source(self, whole: bool) -> Any:
        """What this push sends (``whole``: the base weights too, under lora_sync="adapter")."""
        if self.adapter is None:
            return self.source
        return _WithAdapter(self.source, self.adapter) if whole else self.adapter

    def _start_msg(self, version: int, src: Any) -> P.WeightUpdateStart:
        return P.WeightUpdateStart(policy_version=version, adapter_only=src is self.adapter)

    def _push_own_groups(
        self, servers: list[str], version: int, src: Any, meta: list, report: PushReport, failures: dict[str, str]
    ) -> list[str]:
        """One pass over the weights fanned out to each server's own group (formed first where
        it has none, e.g. after leaving a broken fleet). Returns the servers updated."""
        ready = []
        for s in servers:
            if self.links[s].group is None:
                try:
                    self._connect_own(s, self.links[s].workers)
                except WeightSyncError as e:
                    failures.update(e.failures)
                    continue
            ready.append(s)
        t0 = time.monotonic()
        ok = self._step(ready, lambda s: self._start_msg(version, src), "start", failures)
        self._add_seconds(report, "start", t0)
        t1 = time.monotonic()
        pending = self._send_all(ok, lambda s: self._update_msg(src, meta), "update", failures)
        failed = self._transfer(src, {s: self._own_group(s) for s in pending}, meta, report, close=list(pending))
        failures.update(failed)
        pending = {s: p for s, p in pending.items() if s not in failed}
        ok = self._collect(pending, "update", failures)
        self._add_seconds(report, "transfer", t1)
        return self._finish(ok, version, report, failures)

    def _push_fleet(
        self, version: int, src: Any, meta: list, report: PushReport, failures: dict[str, str]
    ) -> list[str]:
        """One pass through the fleet group. Returns the servers updated. A member that answers
        its update with an error (it was behind a member that failed: the relay broke) is left
        out of both the result and ``failures``: the caller pushes to it on its own. A member
        that does not answer at all (dead, stalled) goes into ``failures``."""
        fleet = self.fleet
        assert fleet is not None  # formed by _ensure_fleet before this pass
        t0 = time.monotonic()
        ok = self._step(fleet.members, lambda s: self._start_msg(version, src), "start", failures)
        self._add_seconds(report, "start", t0)
        t1 = time.monotonic()
        pending = self._send_all(ok, lambda s: self._update_msg(src, meta), "update", failures)
        failed = self._transfer(src, {FLEET: fleet.group} if pending else {}, meta, report, close=[])
        if failed:
            log.warning("fleet transfer failed on the learner's side: %s", failed[FLEET])
        # A member behind a failed one gives up within our timeout of its last piece, and one
        # that relays to a stalled one waits that long on its send after its own last piece: by
        # the end of our send plus that timeout (plus a margin for the loads), every member that
        # is alive has answered. If our own send failed, it already waited out the timeout (a
        # stalled first member) or found a dead one at once, which fails everyone behind at once.
        margin = min(self.timeout_s, 10.0)
        deadline = time.monotonic() + margin + (0.0 if failed else self.timeout_s)
        ok = []
        for s, p in pending.items():
            try:
                p.result(max(0.0, deadline - time.monotonic()))
                ok.append(s)
            except RemoteError as e:
                log.warning("%s failed in the fleet transfer (%s); pushing to it on its own", s, e)
            except TransportError as e:
                failures[s] = f"update: {e}"
        self._add_seconds(report, "transfer", t1)
        return self._finish(ok, version, report, failures)

    def _transfer(
        self, src: Any, groups: dict[str, SendGroup], meta: list, report: PushReport, close: list[str]
    ) -> dict[str, str]:
        """Sends one pass into ``groups`` (or just iterates, to stay in step with the other
        ranks' gathers, when there are none). Returns {group key: error}."""
        t = time.monotonic()
        if not groups:
            for _ in src:
                pass
            return {}
        if self._buffers is None:
            self._buffers = Buffers(next(self.source.module.parameters()).device)
        try:
            return self.sender.send(checked(src, meta), groups, self._buffers)
        except BaseException:
            # Our side broke mid-transfer (e.g. the weights changed shape): every group in this
            # push is out of step now.
            for s in close:
                self.disconnect(s, notify=False)
            if FLEET in groups:
                self._drop_fleet("the learner's side broke mid-transfer")
            raise
        finally:
            self._add_seconds(report, "send", t)

    def _finish(self, servers: list[str], version: int, report: PushReport, failures: dict[str, str]) -> list[str]:
        t = time.monotonic()
        ok = self._step(servers, lambda s: P.WeightUpdateFinish(policy_version=version), "finish", failures)
        self._add_seconds(report, "finish", t)
        return ok

    def _rank0_says(self, value: bool) -> bool:
        """Multi-rank ZeRO-3: rank 0 tells the other ranks what its next pass over the weights
        is (whether it makes another, a retry; whether the base goes with the adapter), so that
        every rank makes the same gathers; they return what it said. Single-rank or not
        ZeRO-3: only rank 0 iterates, nothing to tell."""
        import torch.distributed as dist

        if not (self.source.zero3 and dist.is_initialized() and dist.get_world_size() > 1):
            return value
        flag = torch.tensor([int(value)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    @staticmethod
    def _update_msg(src: Any, meta: list) -> P.WeightUpdate:
        return P.WeightUpdate(
            names=[m.name for m in meta],
            dtype_names=[dtype_name(m.dtype) for m in meta],
            shapes=[list(m.shape) for m in meta],
            aliases=dict(src.aliases),
            lora=src.lora,
            encoding=getattr(src, "encoding", ""),
        )

    @staticmethod
    def _add_seconds(report: PushReport, key: str, since: float) -> None:
        report.seconds[key] = report.seconds.get(key, 0.0) + time.monotonic() - since

    def _sender_only(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what} is rank 0's job (this is rank {self.rank})")

    def _send_all(self, servers: list[str], make, step: str, failures: dict[str, str]) -> dict[str, PendingReply]:
        pending = {}
        for s in servers:
            try:
                pending[s] = self._channel().request(s, make(s))
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


def _describe(stats: PushStats) -> str:
    if stats.encoding == "full":
        return ", full (a target lacked the base)"
    return (
        f", delta: {stats.changed_fraction:.2%} of values changed, {stats.sparse} tensors sparse, "
        f"{stats.whole} whole, {stats.unchanged} unchanged"
    )
