"""The controller's view of the services connected to it: who is there, what each holds.

``ServicePool`` is socket-free bookkeeping driven by the controller's loop: it sees every
message that arrives on the controller's ROUTER (``handle``), answers the handshake, tracks
heartbeats, and records which work keys (prompt ids, request ids) each peer holds. Whatever
a peer holds when it dies — silent past ``peer_timeout_s``, or announcing a fatal error — comes
back from ``reap()`` / ``handle()`` as lost work, so the caller can re-issue it. Nothing is
lost silently.

Peers join at any time (a Hello). A peer of a role that needs preparation before work (a
rollout server must receive the current weights first) joins as *not ready*; the caller
marks it ready. Dispatch picks the ready peer with the lowest load relative to its announced
capacity.

Run order in a controller loop::

    while ...:
        got = endpoint.recv(timeout=0.1)
        if got:
            result = pool.handle(*got)       # None if it was control traffic
            ...                              # a work result: pool.complete(...) + ledger
        for peer, keys in pool.reap():       # dead peers
            ledger.reissue(keys)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from common.protocol import Error, Heartbeat, Hello, Message, ServiceCapabilities, Welcome, version_error
from common.transport import Endpoint, PeerUnavailable, safe_label

log = logging.getLogger(__name__)


@dataclass
class Peer:
    identity: bytes
    name: str
    role: str
    capabilities: ServiceCapabilities | None  # what its Hello announced (None: nothing)
    last_seen: float
    ready: bool = False
    alive: bool = True
    policy_version: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    in_flight: set = field(default_factory=set)  # work keys held by this peer

    def __post_init__(self) -> None:
        # Read once: dispatch asks for it for every peer on every turn, and a peer's
        # capabilities are those of its Hello (saying Hello again makes a new Peer); a heartbeat
        # with a "capacity" stat updates it (a rollout server whose environment workers died).
        self.capacity: int = max(1, self.capabilities.capacity) if self.capabilities is not None else 1

    @property
    def load(self) -> float:
        return len(self.in_flight) / max(1, self.capacity)


@dataclass
class LostWork:
    peer: Peer
    keys: list[Hashable]
    reason: str


class ServicePool:
    """Registry + liveness + per-peer in-flight work. Not thread-safe: one controller loop owns it."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        peer_timeout_s: float = 30.0,
        needs_preparation: Iterable[str] = ("rollout",),
        welcome_config: Callable[[Hello], dict[str, Any]] | None = None,
        admit: Callable[[Hello], Error | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.peer_timeout_s = peer_timeout_s
        self.needs_preparation = set(needs_preparation)
        self.welcome_config = welcome_config or (lambda hello: {})
        # The run's own check of a Hello after the protocol's (e.g. the agent a rollout server
        # runs): an Error refuses the peer, which never gets work.
        self.admit = admit or (lambda hello: None)
        self.refused: dict[str, str] = {}  # peer name -> why its last Hello was refused
        self._version: int | None = None  # the weights the rollout fleet holds; None before the first push
        self.clock = clock
        self.peers: dict[bytes, Peer] = {}
        self.lost: list[LostWork] = []  # dead peers' work not yet collected by reap()
        self.joined: list[Peer] = []  # peers that joined since the last take_joined()
        # Work key -> the peer it was last sent to: who holds a key, without asking every peer.
        self._sent_to: dict[Hashable, Peer] = {}
        self.counters = {"joined": 0, "died": 0, "rejected_hello": 0, "lost_keys": 0}

    # ------------------------------------------------------------------ the fleet's weights
    @property
    def policy_version(self) -> int:
        """The version of the weights the rollout fleet holds: the last push's (0 before any).

        The one place a run's policy version lives on rank 0: the controller stamps outgoing
        prompts with it, a joiner's Welcome carries it, the async feed admits by it. Only a push
        moves it (``weights_pushed``, called by ``learner.controller.weight_fleet.FleetWeights``)."""
        return self._version or 0

    @property
    def pushed(self) -> bool:
        """Whether any weights were pushed yet (a joiner before the first push gets none)."""
        return self._version is not None

    def weights_pushed(self, version: int, servers: Iterable[str]) -> None:
        """Records a push of ``version``: the fleet's version, and the version each of
        ``servers`` (the ones it updated) now holds. Versions never go back."""
        if self._version is not None and version < self._version:
            raise ValueError(f"policy version cannot go back: {version} < {self._version}")
        self._version = version
        for name in servers:
            peer = self.peers.get(name.encode())
            if peer is not None:
                peer.policy_version = version

    # ------------------------------------------------------------------ messages
    def handle(self, identity: bytes, msg: Message) -> Message | None:
        """Consumes control traffic (Hello, Heartbeat, fatal Error); returns anything else."""
        peer = self.peers.get(identity)
        if peer is not None and peer.alive:
            peer.last_seen = self.clock()
        if isinstance(msg, Hello):
            self._on_hello(identity, msg)
            return None
        if peer is None or not peer.alive:
            # A message from a peer we never met or already declared dead: its work was
            # re-issued, so a late result would be a duplicate. The caller's ledger drops
            # duplicates anyway; tell the peer to re-introduce itself.
            log.warning(
                "message %s from unknown or dead peer %s; asking it to say Hello again",
                type(msg).__name__,
                safe_label(identity),
            )
            self._try_send(Error(code="unknown_peer", message="say Hello first (or again)"), identity)
            return None
        if isinstance(msg, Heartbeat):
            peer.policy_version = msg.policy_version
            peer.stats = dict(msg.stats)
            if "capacity" in msg.stats:  # what it can serve now (a rollout server with dead environment workers: less)
                peer.capacity = max(0, int(msg.stats["capacity"]))
            return None
        if isinstance(msg, Error) and msg.code == "fatal" and msg.call_id == 0:
            self._declare_dead(peer, f"announced a fatal error: {msg.message}")
            return None
        return msg

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        err = version_error(hello) or self.admit(hello)
        if err is not None:
            self.counters["rejected_hello"] += 1
            self.refused[hello.name] = err.message
            log.error("rejected %s: %s", hello.name, err.message)
            self.endpoint.reply(hello, err, to=identity)
            return
        old = self.peers.get(identity)
        if old is not None and old.alive:
            # Same identity says Hello again: it restarted before we noticed. What it held is gone.
            self._declare_dead(old, "restarted (said Hello again)")
        peer = Peer(
            identity=identity,
            name=hello.name,
            role=hello.role,
            capabilities=hello.capabilities,
            last_seen=self.clock(),
            ready=hello.role not in self.needs_preparation,
        )
        self.peers[identity] = peer
        self.endpoint.set_peer_name(identity, hello.name)
        self.counters["joined"] += 1
        self.joined.append(peer)
        log.info("%s joined as %s (capabilities %s)", hello.name, hello.role, hello.capabilities)
        self.endpoint.reply(
            hello,
            Welcome(peer_id=hello.name, policy_version=self.policy_version, config=self.welcome_config(hello)),
            to=identity,
        )

    # ------------------------------------------------------------------ liveness
    def _declare_dead(self, peer: Peer, reason: str) -> None:
        if not peer.alive:
            return
        peer.alive = False
        peer.ready = False
        keys = list(peer.in_flight)
        peer.in_flight.clear()
        for key in keys:
            if self._sent_to.get(key) is peer:
                del self._sent_to[key]
        self.counters["died"] += 1
        self.counters["lost_keys"] += len(keys)
        log.error(
            "%s (%s) is gone: %s; %d work item(s) it held will be re-issued", peer.name, peer.role, reason, len(keys)
        )
        self.lost.append(LostWork(peer, keys, reason))

    def reap(self) -> list[LostWork]:
        """Declares peers silent past the deadline dead; returns all lost work not yet returned."""
        now = self.clock()
        for peer in list(self.peers.values()):
            if peer.alive and now - peer.last_seen > self.peer_timeout_s:
                self._declare_dead(
                    peer, f"no message for {now - peer.last_seen:.1f} s (peer timeout {self.peer_timeout_s:.1f} s)"
                )
        lost, self.lost = self.lost, []
        return lost

    def mark_dead(self, peer: Peer, reason: str) -> None:
        """For callers that learn of a death another way (e.g. a send or call failed)."""
        self._declare_dead(peer, reason)

    def take_joined(self) -> list[Peer]:
        joined, self.joined = [p for p in self.joined if p.alive], []
        return joined

    # ------------------------------------------------------------------ work
    def alive(self, role: str | None = None) -> list[Peer]:
        return [p for p in self.peers.values() if p.alive and (role is None or p.role == role)]

    def ready(self, role: str) -> list[Peer]:
        return [p for p in self.alive(role) if p.ready]

    def pick(self, role: str) -> Peer | None:
        """The ready peer of ``role`` with the lowest relative load, or None if none has room."""
        candidates = [p for p in self.ready(role) if len(p.in_flight) < p.capacity]
        return min(candidates, key=lambda p: (p.load, p.name)) if candidates else None

    def send_work(self, peer: Peer, msg: Message, keys: Iterable[Hashable]) -> bool:
        """Sends ``msg`` to ``peer`` and records ``keys`` as held by it. False (and the peer is
        declared dead, holding nothing of this) if it cannot be reached."""
        if not self._try_send(msg, peer.identity):
            self._declare_dead(peer, "unreachable (send failed)")
            return False
        for key in keys:
            peer.in_flight.add(key)
            self._sent_to[key] = peer
        return True

    def complete(self, identity: bytes, keys: Iterable[Hashable]) -> None:
        peer = self.peers.get(identity)
        if peer is not None:
            for key in keys:
                peer.in_flight.discard(key)
                if self._sent_to.get(key) is peer:
                    del self._sent_to[key]

    def holder(self, key: Hashable) -> Peer | None:
        """The peer holding ``key`` (the last one it was sent to, while that one holds it)."""
        peer = self._sent_to.get(key)
        return peer if peer is not None and key in peer.in_flight else None

    def _try_send(self, msg: Message, identity: bytes) -> bool:
        try:
            self.endpoint.send(msg, to=identity, timeout=1.0)
            return True
        except PeerUnavailable as e:
            log.error("%s", e)
            return False
