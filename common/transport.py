"""ZeroMQ transport: typed messages over ROUTER/DEALER, with per-call timeouts.

One pattern serves every role, because every conversation has the same shape: one
controller (learner rank 0) talks to many services that come and go.

- The controller owns a ``ROUTER`` socket bound to a TCP port (``Endpoint.bind``). It knows each
  service by its ZMQ identity (= the service's name) and sends work to a chosen service, which
  is what lets its ledger say exactly which prompts a dead server took with it.
- Every service owns a ``DEALER`` socket connected to that port (``Endpoint.connect``): results,
  heartbeats and replies flow back asynchronously, many requests may be in flight at once.
  That is the work queue: the controller pushes as much work to a service as the capacity it
  announced in its Hello allows.
- ``call()`` is request/reply on top: it stamps a fresh ``call_id``, waits up to ``timeout``
  seconds for the reply carrying it, and keeps any other messages that arrive meanwhile for
  the next ``recv()``. A timeout raises ``CallTimeout`` naming the peer; an ``Error`` reply raises
  ``RemoteError``. Nothing here ever waits without a deadline.

Bad input never kills the receiver: a malformed, truncated, unknown-type, wrong-shape or
oversized message is logged (rate-limited) with the peer that sent it, counted in
``stats["rejected"]``, answered with an ``Error(code="bad_request")`` when the peer can be
addressed, and dropped.

``AsyncEndpoint`` is the same over ``zmq.asyncio`` for services whose core is asyncio (vLLM's
``AsyncLLM``); the sync ``Endpoint`` is what the controller and tests use.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket as _socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from common.handshake_watch import HandshakeWatch
from common.net import free_port as free_port  # re-exported: callers predate common.net
from common.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Codec,
    Error,
    Hello,
    Message,
    ServiceCapabilities,
    Welcome,
)
from common.serialization import WireError

log = logging.getLogger(__name__)

# Socket settings, in one place.
# - HWM: messages queued per peer before ZMQ pushes back. ROUTER_MANDATORY turns a send to a
#   gone or full peer into an error here (EHOSTUNREACH / EAGAIN after SNDTIMEO) instead of a
#   silent drop: the ledger must know what was not delivered.
# - SNDTIMEO: a send that cannot be queued within this many ms raises PeerUnavailable.
# - LINGER: on close, unsent messages get this long to leave, then are dropped, so a process
#   never hangs at exit waiting for a dead peer.
# - ZMTP heartbeats detect a dead TCP connection (a host that vanished without FIN); the
#   app-level Heartbeat message detects a live connection to a hung process.
# - MAXMSGSIZE: a frame larger than this makes ZMQ drop the connection of the sender before
#   we read it; the codec's total-size check catches many smaller frames adding up.
DEFAULT_HWM = 10_000
DEFAULT_SNDTIMEO_MS = 10_000
DEFAULT_LINGER_MS = 1_000
ZMTP_HEARTBEAT_IVL_MS = 2_000
ZMTP_HEARTBEAT_TIMEOUT_MS = 10_000


class TransportError(RuntimeError):
    pass


class CallTimeout(TransportError, TimeoutError):
    pass


class PeerUnavailable(TransportError):
    """A send could not be queued: the peer is not connected, gone, or not reading."""


class HandshakeFailed(PeerUnavailable):
    """The connection to the controller is up, but ZeroMQ's handshake on it fails (CURVE keys
    that do not match, keys on one side only): nothing can be sent until that changes."""


class RemoteError(TransportError):
    def __init__(self, peer: str, error: Error) -> None:
        super().__init__(f"{peer} answered {error.code}: {error.message}")
        self.peer = peer
        self.error = error


def default_name(role: str) -> str:
    return f"{role}-{_socket.gethostname()}-{os.getpid()}"


def safe_label(identity: bytes, limit: int = 64) -> str:
    """A peer identity fit for a log line: as text when it is printable UTF-8 (our services
    name themselves), else as hex. A hostile peer picks its identity; raw control bytes would
    turn the controller's log into a binary file (and could forge line breaks)."""
    try:
        text = identity.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.isprintable() and len(text) <= limit:
        return text
    shown = identity[: limit // 2].hex()
    return f"0x{shown}{'...' if len(identity) > limit // 2 else ''}"


class _RateLimitedLog:
    """Logs the first few rejections of each peer, then one summary line per interval: a
    fuzzing or misconfigured peer must not turn the log into the bottleneck, nor hide another
    peer's rejections behind its own. At most ``max_peers`` are tracked (the oldest forgotten)."""

    def __init__(self, burst: int = 20, interval_s: float = 5.0, max_peers: int = 1024) -> None:
        self.burst, self.interval_s, self.max_peers = burst, interval_s, max_peers
        self._peers: dict[bytes | None, list] = {}  # key -> [count, suppressed, last summary time]

    def error(self, text: str, key: bytes | None = None) -> None:
        state = self._peers.get(key)
        if state is None:
            if len(self._peers) >= self.max_peers:
                self._peers.pop(next(iter(self._peers)))
            state = self._peers[key] = [0, 0, 0.0]
        state[0] += 1
        now = time.monotonic()
        if state[0] <= self.burst:
            log.error(text)
        elif now - state[2] >= self.interval_s:
            log.error("%s (and %d more rejected messages from this peer since the last report)", text, state[1])
            state[1], state[2] = 0, now
        else:
            state[1] += 1


@dataclass
class _Core:
    """Socket-independent part of an endpoint: codec, stash, call ids, rejection policy."""

    name: str
    router: bool
    max_message_bytes: int
    codec: Codec = field(init=False)
    stash: deque = field(default_factory=deque)
    stats: dict[str, int] = field(default_factory=lambda: {"sent": 0, "received": 0, "rejected": 0})
    peer_names: dict[bytes, str] = field(default_factory=dict)
    remote_label: str = "controller"  # how a DEALER names its one peer in errors
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _log: _RateLimitedLog = field(default_factory=_RateLimitedLog)

    def __post_init__(self) -> None:
        self.codec = Codec(self.max_message_bytes)

    def peer_label(self, identity: bytes | None) -> str:
        if identity is None:
            return self.remote_label
        return self.peer_names.get(identity) or safe_label(identity)

    def send_failed(self, msg: Message, to: bytes | None, timeout: float | None) -> PeerUnavailable:
        """The error for a message no peer took within ``timeout`` (None: the socket's SNDTIMEO)."""
        wait_s = DEFAULT_SNDTIMEO_MS / 1000 if timeout is None else timeout
        return PeerUnavailable(
            f"{self.name}: could not queue {type(msg).__name__} to {self.peer_label(to)} within "
            f"{wait_s:.1f} s (not connected or not reading)"
        )

    def frames_out(self, msg: Message, to: bytes | None) -> list[Any]:
        frames = self.codec.encode(msg)
        if self.router:
            if to is None:
                raise ValueError(f"{self.name}: a ROUTER endpoint needs `to=` (the peer identity)")
            frames.insert(0, to)
        return frames

    def frames_in(self, frames: list[Any]) -> tuple[bytes | None, Message | None, Error | None]:
        """Decodes; on bad input returns (identity, None, error-to-send-back)."""
        identity = None
        if self.router:
            identity = frames[0].bytes if hasattr(frames[0], "bytes") else bytes(frames[0])
            frames = frames[1:]
        try:
            msg = self.codec.decode(frames)
        except WireError as e:
            self.stats["rejected"] += 1
            self._log.error(f"{self.name}: rejected message from {self.peer_label(identity)}: {e}", key=identity)
            return identity, None, Error(code="bad_request", message=str(e))
        self.stats["received"] += 1
        return identity, msg, None

    def new_call_id(self) -> int:
        return next(self._ids)


def _apply_options(sock: zmq.Socket, router: bool, identity: str | None, hwm: int, max_message_bytes: int) -> None:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, DEFAULT_LINGER_MS)
    sock.setsockopt(zmq.SNDTIMEO, DEFAULT_SNDTIMEO_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
    if router:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A service that restarts under the same name takes its identity over at once.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    else:
        if identity:
            sock.setsockopt(zmq.IDENTITY, identity.encode())
        # Queue only on a completed connection: sends before the controller is up wait
        # (bounded by SNDTIMEO) instead of piling up in a pipe to nowhere.
        sock.setsockopt(zmq.IMMEDIATE, 1)


class Endpoint:
    """A typed-message socket: ``bind`` (controller, ROUTER) or ``connect`` (service, DEALER)."""

    def __init__(self, sock: zmq.Socket, core: _Core, address: str, watch: HandshakeWatch | None = None) -> None:
        self.sock = sock
        self.core = core
        self.address = address
        self.watch = watch  # a DEALER's handshake outcome (``handshake_failure``)

    @classmethod
    def bind(
        cls,
        address: str,
        *,
        name: str = "controller",
        hwm: int = DEFAULT_HWM,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        context: zmq.Context | None = None,
        auth_dir: str | None = None,
    ) -> Endpoint:
        """Binds a ROUTER at ``address`` (``tcp://127.0.0.1:0`` picks a free port); with
        ``auth_dir``, a CURVE server admitting only the run's keys (``common/auth.py``)."""
        sock = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        _apply_options(sock, True, None, hwm, max_message_bytes)
        if auth_dir:
            from common.auth import secure_server

            try:
                secure_server(sock, auth_dir)
            except Exception:
                sock.close(0)  # a bad key folder must not leak the socket
                raise
        sock.bind(address)
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if not auth_dir:
            from common.auth import warn_if_open

            warn_if_open(bound)
        return cls(sock, _Core(name, True, max_message_bytes), bound)

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        name: str,
        hwm: int = DEFAULT_HWM,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        context: zmq.Context | None = None,
        auth_dir: str | None = None,
    ) -> Endpoint:
        """Connects a DEALER named ``name`` (its identity at the controller) to ``address``;
        with ``auth_dir``, as a CURVE client holding the run's service key."""
        sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        _apply_options(sock, False, name, hwm, max_message_bytes)
        if auth_dir:
            from common.auth import secure_client

            try:
                secure_client(sock, auth_dir)
            except Exception:
                sock.close(0)  # a bad key folder must not leak the socket
                raise
        watch = HandshakeWatch(sock, f"the controller at {address}", curve=bool(auth_dir), auth_dir=auth_dir)
        sock.connect(address)
        core = _Core(name, False, max_message_bytes)
        core.remote_label = f"controller at {address}"
        return cls(sock, core, address, watch)

    # -- properties
    @property
    def name(self) -> str:
        return self.core.name

    @property
    def stats(self) -> dict[str, int]:
        return self.core.stats

    def set_peer_name(self, identity: bytes, name: str) -> None:
        self.core.peer_names[identity] = name

    # -- sending
    def send(self, msg: Message, to: bytes | None = None, timeout: float | None = None) -> None:
        """Queues ``msg`` (to peer ``to`` on the controller side). Waits at most ``timeout`` s
        (default: the socket's SNDTIMEO) for room, then raises PeerUnavailable."""
        frames = self.core.frames_out(msg, to)
        try:
            if timeout is not None and not self.sock.poll(int(timeout * 1000), zmq.POLLOUT):
                raise zmq.Again()
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise self.core.send_failed(msg, to, timeout) from None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise PeerUnavailable(f"{self.name}: {self.core.peer_label(to)} is not connected") from None
            raise
        self.core.stats["sent"] += 1

    def reply(self, request: Message, msg: Message, to: bytes | None = None) -> None:
        msg.call_id = request.call_id
        self.send(msg, to)

    # -- receiving
    def _recv_raw(self, timeout: float | None) -> list[Any] | None:
        # Try first without waiting: under load a message is usually queued already, and
        # skipping the poll() saves a syscall per message on the hot path.
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
        ms = None if timeout is None else max(0, int(timeout * 1000))
        if not self.sock.poll(ms, zmq.POLLIN):
            return None
        return self.sock.recv_multipart(copy=False)

    def recv(self, timeout: float | None = None) -> tuple[bytes | None, Message] | None:
        """Next good message as ``(sender identity or None, message)``; None on timeout."""
        if self.core.stash:
            return self.core.stash.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            frames = self._recv_raw(left)
            if frames is None:
                return None
            identity, msg, err = self.core.frames_in(frames)
            if msg is not None:
                return identity, msg
            assert err is not None  # frames_in gives a message or the error to answer with
            self._answer_bad(identity, err)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _answer_bad(self, identity: bytes | None, err: Error) -> None:
        if self.core.router and identity is None:
            return
        try:
            self.sock.send_multipart(self.core.frames_out(err, identity), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the sender is gone or not reading; the rejection is logged already

    def call(self, msg: Message, *, to: bytes | None = None, timeout: float) -> Message:
        """Sends ``msg`` and waits for its reply. Raises CallTimeout / RemoteError / PeerUnavailable."""
        msg.call_id = self.core.new_call_id()
        deadline = time.monotonic() + timeout
        self.send(msg, to, timeout=timeout)
        held: list = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CallTimeout(
                        f"{self.name}: no reply from {self.core.peer_label(to)} to "
                        f"{type(msg).__name__} within {timeout:.1f} s"
                    )
                frames = self._recv_raw(left)
                if frames is None:
                    continue
                identity, got, err = self.core.frames_in(frames)
                if got is None:
                    assert err is not None  # frames_in gives a message or the error to answer with
                    self._answer_bad(identity, err)
                    continue
                if got.call_id == msg.call_id and (not self.core.router or identity == to):
                    if isinstance(got, Error):
                        raise RemoteError(self.core.peer_label(identity), got)
                    return got
                held.append((identity, got))
        finally:
            self.core.stash.extend(held)

    def handshake_failure(self) -> str | None:
        """Why the connection to the controller carries nothing, when ZeroMQ's handshake on it
        failed (``common.handshake_watch``); None otherwise, and on the controller's side."""
        return self.watch.failure() if self.watch is not None else None

    def close(self, linger_ms: int | None = None) -> None:
        if self.watch is not None:
            self.watch.close()
        self.sock.close(linger=DEFAULT_LINGER_MS if linger_ms is None else linger_ms)


class AsyncEndpoint:
    """``Endpoint`` for asyncio services (DEALER side). Same message semantics."""

    def __init__(
        self,
        address: str,
        *,
        name: str,
        hwm: int = DEFAULT_HWM,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        context: zmq.asyncio.Context | None = None,
        auth_dir: str | None = None,
    ) -> None:
        self.sock = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        _apply_options(self.sock, False, name, hwm, max_message_bytes)
        if auth_dir:
            from common.auth import secure_client

            try:
                secure_client(self.sock, auth_dir)
            except Exception:
                self.sock.close(0)  # a bad key folder must not leak the socket
                raise
        self.watch = HandshakeWatch(self.sock, f"the controller at {address}", curve=bool(auth_dir), auth_dir=auth_dir)
        self.sock.connect(address)
        self.address = address
        self.core = _Core(name, False, max_message_bytes)
        self.core.remote_label = f"controller at {address}"
        # Sends from many coroutines must not interleave frames: one lock.
        self._send_lock = asyncio.Lock()

    @property
    def name(self) -> str:
        return self.core.name

    @property
    def stats(self) -> dict[str, int]:
        return self.core.stats

    async def send(self, msg: Message, timeout: float | None = None) -> None:
        frames = self.core.frames_out(msg, None)
        async with self._send_lock:
            try:
                # pyzmq's stub of the async poll omits its flags argument; the call is as documented
                if timeout is not None and not await self.sock.poll(int(timeout * 1000), zmq.POLLOUT):  # type: ignore[call-arg]
                    raise zmq.Again()
                await self.sock.send_multipart(frames, copy=False)
            except zmq.Again:
                raise self.core.send_failed(msg, None, timeout) from None
        self.core.stats["sent"] += 1

    async def reply(self, request: Message, msg: Message) -> None:
        msg.call_id = request.call_id
        await self.send(msg)

    async def recv(self, timeout: float | None = None) -> Message | None:
        """Next good message from the controller; None on timeout."""
        if self.core.stash:
            return self.core.stash.popleft()[1]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ms = None if left is None else int(left * 1000)
            if not await self.sock.poll(ms, zmq.POLLIN):  # type: ignore[call-arg]  # (see send)
                return None
            frames = await self.sock.recv_multipart(copy=False)
            _, msg, err = self.core.frames_in(frames)
            if msg is not None:
                return msg
            assert err is not None  # frames_in gives a message or the error to answer with
            try:
                await self.sock.send_multipart(self.core.frames_out(err, None), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def handshake_failure(self) -> str | None:
        """``Endpoint.handshake_failure``."""
        return self.watch.failure()

    def close(self, linger_ms: int | None = None) -> None:
        self.watch.close()
        self.sock.close(linger=DEFAULT_LINGER_MS if linger_ms is None else linger_ms)


def _check_welcome(ep_name: str, reply: Message) -> Welcome:
    if not isinstance(reply, Welcome):
        raise TransportError(f"{ep_name}: expected Welcome, controller sent {type(reply).__name__}")
    if reply.protocol_version != PROTOCOL_VERSION:
        raise TransportError(
            f"{ep_name}: controller speaks protocol {reply.protocol_version}, this service {PROTOCOL_VERSION}"
        )
    return reply


def _unwelcome(ep: Endpoint | AsyncEndpoint, e: TransportError) -> TransportError:
    """The error for a Hello that got no Welcome: HandshakeFailed, saying why, when ZeroMQ's
    handshake failed (no Hello could leave: not a dead controller); else ``e`` itself."""
    why = ep.handshake_failure()
    return HandshakeFailed(f"{ep.name}: {why}") if why else e


def handshake(ep: Endpoint, role: str, capabilities: ServiceCapabilities | None, timeout: float) -> Welcome:
    """Service side of the handshake: Hello -> Welcome, or a clear error within ``timeout``
    (HandshakeFailed when the keys may not match)."""
    try:
        reply = ep.call(Hello(role=role, name=ep.name, capabilities=capabilities), timeout=timeout)
    except (CallTimeout, PeerUnavailable) as e:
        raise _unwelcome(ep, e) from None
    welcome = _check_welcome(ep.name, reply)
    if ep.watch is not None:
        ep.watch.close()  # the keys are proven: nothing more to watch (common/handshake_watch.py)
    return welcome


async def ahandshake(ep: AsyncEndpoint, role: str, capabilities: ServiceCapabilities | None, timeout: float) -> Welcome:
    """``handshake`` for asyncio services."""
    hello = Hello(role=role, name=ep.name, capabilities=capabilities, call_id=ep.core.new_call_id())
    deadline = time.monotonic() + timeout
    try:
        await ep.send(hello, timeout=timeout)
    except PeerUnavailable as e:
        raise _unwelcome(ep, e) from None
    held: list = []
    try:
        while (left := deadline - time.monotonic()) > 0:
            msg = await ep.recv(timeout=left)
            if msg is None:
                break
            if msg.call_id == hello.call_id:
                if isinstance(msg, Error):
                    raise RemoteError(ep.core.remote_label, msg)
                welcome = _check_welcome(ep.name, msg)
                ep.watch.close()  # the keys are proven (``handshake``)
                return welcome
            held.append((None, msg))
    finally:
        ep.core.stash.extend(held)
    raise _unwelcome(
        ep,
        CallTimeout(
            f"{ep.name}: no Welcome from {ep.core.remote_label} within {timeout:.1f} s "
            "(is the controller running and reachable?)"
        ),
    )
