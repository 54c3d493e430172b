"""The shell every service process wears around its own work: handshake, heartbeats, last
words, signals and exit codes, written once for the rollout server and the reward service.

The two serve differently -- the rollout server on one asyncio loop, the reward service in a
thread that polls its socket -- and each keeps its own socket-owning loop. So ``ServiceShell``
is a policy those loops call, not a loop of its own: it holds no socket and starts no thread,
because a ZeroMQ socket belongs to the one thread that uses it. It decides (when the next
heartbeat is due, whether the last words were said, how long a Hello may wait); the caller
sends, on its own thread, through its own endpoint. The two steps that send come as a plain
method and an ``a``-prefixed coroutine with the same meaning (``say_hello`` / ``asay_hello``,
``send_last_words`` / ``asend_last_words``).

Exit codes (``ExitCode``): 0 the service was stopped (Shutdown), 1 it broke and said so, 2 it
never served (a bad flag or file). Two endings are the service's to name, and the two
services name them differently today: a SIGTERM/SIGINT (rollout 1, so a supervisor counts the
server as gone; reward 0, a stop it was asked for) and no Welcome from the controller
(rollout 2, reward 1). Each passes its choice to the shell (``signal_exit``,
``no_welcome_exit``) rather than the shell guessing.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from common.protocol import Error, Heartbeat, Hello, Welcome
from common.transport import (
    AsyncEndpoint,
    CallTimeout,
    Endpoint,
    PeerUnavailable,
    TransportError,
    ahandshake,
    handshake,
)

log = logging.getLogger(__name__)

# Last words get this long to leave: when the controller is gone too (the run is being
# stopped), waiting the socket's full send timeout would outlast the supervisor's patience.
FATAL_SEND_S = 2.0
# One Hello waits at most this long before it is said again: a Hello queued on a connection
# that then broke (the controller restarted, or was not up yet) is never answered.
HELLO_ATTEMPT_S = 30.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class ExitCode(enum.IntEnum):
    STOPPED = 0  # Shutdown (or, where the service says so, a signal)
    FATAL = 1  # a fault of this service, announced to the controller first
    NO_START = 2  # it never served: a bad flag, a missing file, no controller


class ServiceShell:
    def __init__(
        self,
        role: str,
        name: str,
        controller: str,
        *,
        heartbeat_s: float,
        connect_timeout_s: float,
        signal_exit: ExitCode,
        no_welcome_exit: ExitCode,
        hello_attempt_s: float = HELLO_ATTEMPT_S,
    ) -> None:
        self.role, self.name, self.controller = role, name, controller
        self.heartbeat_s = heartbeat_s
        self.connect_timeout_s = connect_timeout_s
        self.signal_exit = signal_exit
        self.no_welcome_exit = no_welcome_exit
        self.hello_attempt_s = hello_attempt_s
        self.stop_signal: str | None = None  # the last words a signal asked for, until said
        self._said_last_words = False
        self._beats = 0
        self._next_beat = 0.0  # monotonic time the next heartbeat is due: the first, at once
        self._rehello = 0  # call id of the Hello said again, until its Welcome
        self._rehello_at = 0.0

    # ------------------------------------------------------------------ forgotten by the controller
    def hello_again(self, capabilities: dict[str, Any], call_id: int) -> Hello | None:
        """The controller answered ``unknown_peer``: it declared this service dead (silent past
        its deadline on an overloaded host, or a failed weight push) and gave its work back.
        Returns the Hello to send (the caller sends it with ``call_id`` from its endpoint), or
        None while one is pending: one Hello at a time, again after 10 s if no Welcome came."""
        if self._rehello and time.monotonic() - self._rehello_at < 10.0:
            return None
        log.warning("the controller no longer knows %s; saying Hello again", self.name)
        self._rehello, self._rehello_at = call_id, time.monotonic()
        return Hello(role=self.role, name=self.name, capabilities=capabilities, call_id=call_id)

    def welcomed_again(self, msg: Welcome) -> bool:
        """True when ``msg`` answers the Hello said again (the service is known again); False
        for a Welcome to an earlier Hello, which the caller ignores."""
        if not self._rehello or msg.call_id != self._rehello:
            return False
        self._rehello = 0
        log.info("%s welcomed again (controller policy version %d)", self.name, msg.policy_version)
        return True

    # ------------------------------------------------------------------ handshake
    def say_hello(self, ep: Endpoint, capabilities: dict[str, Any]) -> Welcome:
        """Hello until Welcome, for up to ``connect_timeout_s``; then TransportError naming the controller."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                return handshake(ep, self.role, capabilities, self._hello_timeout(deadline))
            except (PeerUnavailable, CallTimeout) as e:
                self._hello_failed(deadline, e)

    async def asay_hello(self, ep: AsyncEndpoint, capabilities: dict[str, Any]) -> Welcome:
        """``say_hello`` for asyncio services."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                return await ahandshake(ep, self.role, capabilities, self._hello_timeout(deadline))
            except (PeerUnavailable, CallTimeout) as e:
                self._hello_failed(deadline, e)

    def _hello_timeout(self, deadline: float) -> float:
        # At least a second: a DEALER needs that to connect before its Hello can leave.
        return max(1.0, min(deadline - time.monotonic(), self.hello_attempt_s))

    def _hello_failed(self, deadline: float, e: TransportError) -> None:
        if time.monotonic() >= deadline:
            raise TransportError(
                f"{self.name}: no Welcome from the controller at {self.controller} "
                f"within {self.connect_timeout_s:.0f} s: {e}"
            ) from None
        # A Welcome to this Hello may still come after the next one's: callers ignore it.
        log.info("controller not answering yet (%s); trying again", e)

    # ------------------------------------------------------------------ heartbeats
    def heartbeat(self, stats: dict[str, float], policy_version: int = 0) -> Heartbeat:
        """The next Heartbeat to send now; the one after is due ``heartbeat_s`` later."""
        beat = Heartbeat(name=self.name, seq=self._beats, policy_version=policy_version, stats=stats)
        self._beats += 1
        self._next_beat = time.monotonic() + self.heartbeat_s
        return beat

    def heartbeat_in(self) -> float:
        """Seconds until the next Heartbeat is due (0: now)."""
        return max(0.0, self._next_beat - time.monotonic())

    # ------------------------------------------------------------------ last words
    def last_words(self, message: str) -> Error | None:
        """The fatal notice, the first time only: None once it has been said (a SIGTERM also
        kills vLLM's engine, so a second fault follows the first)."""
        if self._said_last_words:
            return None
        self._said_last_words = True
        log.error("announcing fatal: %s", message)
        return Error(code="fatal", message=message)

    def send_last_words(self, ep: Endpoint, message: str) -> bool:
        """Tells the controller this service is going down, within FATAL_SEND_S, so it re-issues
        the service's work at once instead of at the heartbeat deadline. False if said before."""
        notice = self.last_words(message)
        if notice is None:
            return False
        try:
            ep.send(notice, timeout=FATAL_SEND_S)
        except (TransportError, zmq.ZMQError) as e:
            log.warning("could not announce the fault to the controller: %s", e)
        return True

    async def asend_last_words(self, ep: AsyncEndpoint, message: str) -> bool:
        """``send_last_words`` for asyncio services."""
        notice = self.last_words(message)
        if notice is None:
            return False
        try:
            await ep.send(notice, timeout=FATAL_SEND_S)
        except (TransportError, zmq.ZMQError) as e:
            log.warning("could not announce the fault to the controller: %s", e)
        return True

    # ------------------------------------------------------------------ signals
    def catch_signals(
        self, loop: asyncio.AbstractEventLoop | None = None, then: Callable[[str], None] | None = None
    ) -> None:
        """SIGTERM/SIGINT become ``stop_signal`` (the last words to say). Without a loop the
        handler only records it: it may run in the middle of a socket call, so the serving
        loop, which wakes often enough, says them and exits with ``signal_exit``. With a
        loop, ``then(last_words)`` runs on it, between coroutine steps, where sending is safe.
        Outside the main thread (in-process tests) Python allows no handler: nothing changes."""

        def record(signum: int) -> str:
            self.stop_signal = f"{self.name} stopping on {signal.Signals(signum).name}"
            return self.stop_signal

        for sig in STOP_SIGNALS:
            if loop is not None:
                loop.add_signal_handler(sig, lambda s=sig: then(record(s)) if then else record(s))
            elif threading.current_thread() is threading.main_thread():
                signal.signal(sig, lambda signum, _frame: record(signum))
