"""Why a service's connection to the controller carries nothing: ZeroMQ's handshake outcome.

A DEALER whose TCP connection is up but whose ZMTP handshake fails (CURVE keys that do not
match, keys on one side only) never gets a pipe to send on: with IMMEDIATE its sends just time
out, which reads "not connected or not reading", as a dead controller does. libzmq reports the
handshake's outcome on the socket's monitor (``zmq_socket_monitor``, libzmq >= 4.3):
HANDSHAKE_SUCCEEDED, or HANDSHAKE_FAILED_AUTH (the controller's ZAP handler refused our key; the
value is its status code), _PROTOCOL (the value says what, e.g. a mechanism mismatch) or
_NO_DETAIL (the peer closed the connection during the handshake: what a CURVE server does with
a client that encrypted its HELLO to another server key). ``HandshakeWatch`` keeps the latest
outcome and turns a failure into a sentence naming the likely cause, until the first Welcome
proves the keys (a later handshake then fails only if the controller's keys change).
"""

from __future__ import annotations

import itertools

import zmq
from zmq.utils.monitor import recv_monitor_message

_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_ids = itertools.count()


class HandshakeWatch:
    """Watches ``sock`` (before its ``connect``). ``curve``: the socket holds CURVE keys
    (``--auth_dir``). Read by the thread that owns ``sock``; ``close`` before the socket."""

    def __init__(self, sock: zmq.Socket, peer: str, *, curve: bool, auth_dir: str | None = None) -> None:
        self.sock, self.peer, self.curve, self.auth_dir = sock, peer, curve, auth_dir
        address = f"inproc://rayless-handshake-{next(_ids)}"
        sock.monitor(address, _EVENTS)
        # A plain socket on the same libzmq context, also for an asyncio endpoint: events are
        # read without waiting, from the owner's thread, between its own calls.
        self._events = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        # No high-water mark: libzmq's monitor sends its events blocking, on the context's I/O
        # thread; a full queue (2000 events: a handshake failing every 100 ms for minutes, with
        # nobody asking) would stall every socket of the process. Events only come while the
        # handshake fails, one per reconnect, and the watch ends at the first Welcome (``close``).
        self._events.setsockopt(zmq.RCVHWM, 0)
        self._events.connect(address)
        self.closed = False
        self._last: tuple[int, int] | None = None  # (event, value) of the latest handshake

    def failure(self) -> str | None:
        """What went wrong in the latest handshake, or None (it succeeded, or none ended yet)."""
        while not self.closed:
            try:
                event = recv_monitor_message(self._events, zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:  # closed under us: nothing more to learn
                break
            self._last = (event["event"], event["value"])
        if self._last is None or self._last[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return None
        return f"the {'CURVE ' if self.curve else ''}handshake with {self.peer} failed: {self._explain(*self._last)}"

    def _explain(self, event: int, value: int) -> str:
        keys = f"this service's --auth_dir {self.auth_dir}" if self.auth_dir else "this service's --auth_dir"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"it refused this service's key (ZAP status {value}): the keys may not match -- the peer key in "
                f"{keys} is not among the run's authorized keys"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.curve:
                return "this service holds CURVE keys (--auth_dir) and the controller runs without: start both alike"
            return "the controller requires CURVE keys: give this service --auth_dir (the run's key folder)"
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return f"ZMTP protocol error 0x{value:x} (is a rayless controller listening there?)"
        if self.curve:
            return (
                "the controller closed the connection during it: the keys may not match -- the controller.key in "
                f"{keys} must be the public key of the controller's own key folder"
            )
        return "the peer closed the connection during it (is a rayless controller listening there?)"

    def close(self) -> None:
        """Stops watching (idempotent): at the first Welcome, or when the socket closes."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is closed already
        self._events.close(0)
