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

A controller that goes away (the learner was killed, or is being restarted from a checkpoint)
is noticed when a send cannot leave: the DEALER queues only on a live connection (IMMEDIATE),
so with the controller's socket gone every send waits out its timeout and fails -- a heartbeat
within ``LOST_AFTER_BEATS`` periods -- and ZMTP heartbeats close a connection to a vanished
host within seconds. Silence from the controller proves nothing: it sends nothing to an idle
service while it trains. The service then keeps its
engine and says Hello every ``heartbeat_s`` for up to ``reconnect_timeout_s`` (logging the
wait), and on the Welcome of the restarted controller serves again: the controller treats it
as a joiner and pushes its weights before giving it work. Work taken before the Welcome belongs
to the old controller and is dropped (``session``). No Welcome in time: the service exits 3
(``NO_CONTROLLER``). A heartbeat that reaches a restarted controller before the loss is
noticed ends the same way: it answers ``unknown_peer`` and the service says Hello again.

Exit codes: one rule for every service, here and nowhere else (``ExitCode``, ``signal_exit_code``;
``describe_exit`` says it in words for a supervisor such as launch.local):

====== ============================================================================================
code   how the service ended
====== ============================================================================================
0      the controller ended it: a Shutdown, or its fatal notice (the run is over)
1      it broke (an engine that died, scoring that keeps failing, a bug) and told the controller
       (if one had welcomed it)
2      it never served: a bad flag or file, or an engine that cannot start on this host (one log
       line names the flag); starting it again unchanged fails the same way
3      no controller: no Welcome within --connect_timeout_s, or none back within
       --reconnect_timeout_s after it went away
128+N  stopped by signal N after saying its last words (if a controller had welcomed it): 143 for
       SIGTERM, 130 for SIGINT -- the code a shell, Slurm or systemd reads for a process a signal
       ended
====== ============================================================================================

A signal is not 0: a stop that came from outside the run is not the run finishing, and a
supervisor that reads 0 as "done" (launch.local does) would not count the service as gone.
Nor is it 1: nothing broke. (The code was once each service's own choice: a signalled reward
service exited 0, a rollout server 1.)
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import threading
import time
from collections.abc import Callable

import zmq

from common.protocol import Error, Heartbeat, Hello, ServiceCapabilities, Welcome
from common.transport import (
    AsyncEndpoint,
    CallTimeout,
    Endpoint,
    HandshakeFailed,
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
# While the controller is gone: how long one Hello may wait for a connection to leave on (the
# caller's send timeout), and how often the wait is logged.
RECONNECT_SEND_S = 1.0
RECONNECT_LOG_S = 30.0
DEFAULT_RECONNECT_S = 1800.0  # long enough for a learner to restart from a checkpoint
# A heartbeat that cannot leave within this many periods means no connection to the controller.
# More than one: a TCP reconnect after a network blip takes a moment, and a false alarm costs a
# Hello (the controller then re-issues this service's work).
LOST_AFTER_BEATS = 3


class ExitCode(enum.IntEnum):
    STOPPED = 0  # the controller ended it: Shutdown, or its fatal notice
    FATAL = 1  # a fault of this service, announced to the controller first
    NO_START = 2  # it never served: a bad flag or file, an engine that cannot start here
    NO_CONTROLLER = 3  # no Welcome in time, at start or after the controller went away


SIGNALLED = 128  # + the signal's number: the service stopped on that signal


def signal_exit_code(signum: int) -> int:
    """The exit code of a service stopped by signal ``signum`` (SIGTERM: 143)."""
    return SIGNALLED + int(signum)


def describe_exit(code: int) -> str:
    """How a service with exit status ``code`` ended, in words (``subprocess``'s negative codes,
    a signal the process did not handle, included): for supervisors' messages."""
    meanings: dict[int, str] = {
        ExitCode.STOPPED: "stopped by the controller",
        ExitCode.FATAL: "it broke; its log says why",
        ExitCode.NO_START: "it could not start (a flag, a file, or this host's memory: its log names which); "
        "started again unchanged it fails the same way",
        ExitCode.NO_CONTROLLER: "no controller answered it in time",
    }
    if code in meanings:
        return meanings[code]
    if code < 0:  # subprocess's way of saying a signal ended the process unhandled
        signum, how = -code, "killed by"
    elif code > SIGNALLED:
        signum, how = code - SIGNALLED, "stopped by"
    else:
        return f"exit code {code}"
    try:
        return f"{how} {signal.Signals(signum).name}"
    except ValueError:
        return f"{how} signal {signum}"


class ServiceShell:
    def __init__(
        self,
        role: str,
        name: str,
        controller: str,
        *,
        heartbeat_s: float,
        connect_timeout_s: float,
        hello_attempt_s: float = HELLO_ATTEMPT_S,
        reconnect_timeout_s: float = DEFAULT_RECONNECT_S,
    ) -> None:
        self.role, self.name, self.controller = role, name, controller
        self.heartbeat_s = heartbeat_s
        self.connect_timeout_s = connect_timeout_s
        self.hello_attempt_s = hello_attempt_s
        self.stop_signal: str | None = None  # the last words a signal asked for, until said
        self.stop_signum: int | None = None  # the signal that asked for them
        self._said_last_words = False
        self._beats = 0
        self._next_beat = 0.0  # monotonic time the next heartbeat is due: the first, at once
        self._rehello = 0  # call id of the Hello said again, until its Welcome
        self._rehello_at = 0.0
        self.reconnect_timeout_s = reconnect_timeout_s
        self.lost_since: float | None = None  # monotonic time the controller was found gone
        self._lost_logged = 0.0
        # Bumped by every Welcome to a Hello said again: work taken in an earlier session was
        # handed out by a controller that forgot it (or is gone); its results are dropped.
        self.session = 0

    # ------------------------------------------------------------------ forgotten by the controller
    def hello_again(self, capabilities: ServiceCapabilities, call_id: int) -> Hello | None:
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
        """True when ``msg`` answers the Hello said again (the service is known again, in a new
        ``session``); False for a Welcome to an earlier Hello, which the caller ignores."""
        if not self._rehello or msg.call_id != self._rehello:
            return False
        self._rehello = 0
        self.session += 1
        if self.lost_since is not None:
            log.info(
                "%s reconnected to the controller at %s after %.0f s (its policy version %d)",
                self.name,
                self.controller,
                time.monotonic() - self.lost_since,
                msg.policy_version,
            )
            self.lost_since = None
        else:
            log.info("%s welcomed again (controller policy version %d)", self.name, msg.policy_version)
        return True

    # ------------------------------------------------------------------ the controller went away
    def controller_lost(self, why: str) -> None:
        """A send could not leave (no connection to the controller within its timeout): from now
        on the caller says ``reconnect_hello`` instead of heartbeats. Idempotent while lost."""
        if self.lost_since is not None:
            return
        self.lost_since = self._lost_logged = time.monotonic()
        self._rehello = 0  # a Hello said before the loss will not be answered
        log.warning(
            "%s: the controller at %s is gone (%s); reconnecting for up to %.0f s (--reconnect_timeout_s)",
            self.name,
            self.controller,
            why,
            self.reconnect_timeout_s,
        )

    @property
    def lost(self) -> bool:
        return self.lost_since is not None

    @property
    def signal_exit(self) -> int:
        """The exit code after the signal caught by ``catch_signals`` (128 + its number)."""
        if self.stop_signum is None:
            raise RuntimeError(f"{self.name}: no signal was caught")
        return signal_exit_code(self.stop_signum)

    no_controller_exit = ExitCode.NO_CONTROLLER  # no Welcome at start, or none back in time

    def reconnect_expired(self) -> bool:
        """True once the controller has been gone longer than ``reconnect_timeout_s``: the
        caller exits with ``no_controller_exit``."""
        if self.lost_since is None or time.monotonic() - self.lost_since < self.reconnect_timeout_s:
            return False
        log.error(
            "%s: no controller at %s for %.0f s (--reconnect_timeout_s); giving up",
            self.name,
            self.controller,
            self.reconnect_timeout_s,
        )
        return True

    def reconnect_hello(self, capabilities: ServiceCapabilities, call_id: int) -> Hello | None:
        """While lost: the Hello to try now (send it with ``call_id`` and a RECONNECT_SEND_S
        timeout; a send that fails is ``hello_unsent``), or None while a sent one may still be
        answered (``heartbeat_s``, at least RECONNECT_SEND_S). Logs the wait now and then."""
        now = time.monotonic()
        if now - self._lost_logged >= RECONNECT_LOG_S:
            self._lost_logged = now
            log.info(
                "%s: still waiting for the controller at %s (%.0f of %.0f s)",
                self.name,
                self.controller,
                now - (self.lost_since or now),
                self.reconnect_timeout_s,
            )
        if self._rehello and now - self._rehello_at < max(self.heartbeat_s, RECONNECT_SEND_S):
            return None
        self._rehello, self._rehello_at = call_id, now
        return Hello(role=self.role, name=self.name, capabilities=capabilities, call_id=call_id)

    def hello_unsent(self) -> None:
        """The Hello from ``reconnect_hello`` could not leave (still no connection): the next
        one may be said at once (the caller's send already waited)."""
        self._rehello = 0

    # ------------------------------------------------------------------ handshake
    def say_hello(self, ep: Endpoint, capabilities: ServiceCapabilities) -> Welcome:
        """Hello until Welcome, for up to ``connect_timeout_s``; then TransportError naming the controller."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                return handshake(ep, self.role, capabilities, self._hello_timeout(deadline))
            except (PeerUnavailable, CallTimeout) as e:
                self._hello_failed(deadline, e)

    async def asay_hello(self, ep: AsyncEndpoint, capabilities: ServiceCapabilities) -> Welcome:
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
        if isinstance(e, HandshakeFailed):  # not a controller still starting: say so at once
            log.warning("%s; trying again", e)
        else:
            log.info("controller not answering yet (%s); trying again", e)

    # ------------------------------------------------------------------ heartbeats
    def heartbeat(self, stats: dict[str, float], policy_version: int = 0) -> Heartbeat:
        """The next Heartbeat to send now; the one after is due ``heartbeat_s`` later."""
        beat = Heartbeat(name=self.name, seq=self._beats, policy_version=policy_version, stats=stats)
        self._beats += 1
        self._next_beat = time.monotonic() + self.heartbeat_s
        return beat

    @property
    def heartbeat_send_s(self) -> float:
        """Send timeout of a heartbeat: one that cannot leave in time marks the controller lost."""
        return max(LOST_AFTER_BEATS * self.heartbeat_s, RECONNECT_SEND_S)

    def heartbeat_in(self) -> float:
        """Seconds until the next Heartbeat is due (0: now)."""
        return max(0.0, self._next_beat - time.monotonic())

    # ------------------------------------------------------------------ last words
    def last_words(self, message: str, *, fault: bool = True) -> Error | None:
        """The fatal notice, the first time only: None once it has been said (a SIGTERM also
        kills vLLM's engine, so a second fault follows the first). ``fault=False``: a stop that
        was asked for (a signal), logged as INFO; the controller is told the same way either
        way (``Error(code="fatal")``: the service is going, its work is to be re-issued)."""
        if self._said_last_words:
            return None
        self._said_last_words = True
        if fault:
            log.error("announcing fatal: %s", message)
        else:
            log.info("%s; telling the controller", message)
        return Error(code="fatal", message=message)

    def send_last_words(self, ep: Endpoint, message: str, *, fault: bool = True) -> bool:
        """Tells the controller this service is going down, within FATAL_SEND_S, so it re-issues
        the service's work at once instead of at the heartbeat deadline. False if said before."""
        notice = self.last_words(message, fault=fault)
        if notice is None:
            return False
        try:
            ep.send(notice, timeout=FATAL_SEND_S)
        except (TransportError, zmq.ZMQError) as e:
            self._unheard(e, fault)
        return True

    async def asend_last_words(self, ep: AsyncEndpoint, message: str, *, fault: bool = True) -> bool:
        """``send_last_words`` for asyncio services."""
        notice = self.last_words(message, fault=fault)
        if notice is None:
            return False
        try:
            await ep.send(notice, timeout=FATAL_SEND_S)
        except (TransportError, zmq.ZMQError) as e:
            self._unheard(e, fault)
        return True

    def _unheard(self, e: Exception, fault: bool) -> None:
        if fault:
            log.warning("could not announce the fault to the controller: %s", e)
        else:  # stopping anyway; the controller, if any, finds out by the silence
            log.info("could not tell the controller that %s is stopping: %s", self.name, e)

    # ------------------------------------------------------------------ signals
    def catch_signals(
        self, loop: asyncio.AbstractEventLoop | None = None, then: Callable[[str], object] | None = None
    ) -> None:
        """SIGTERM/SIGINT become ``stop_signal`` (the last words to say). Without a loop the
        handler only records it: it may run in the middle of a socket call, so the serving
        loop, which wakes often enough, says them and exits with ``signal_exit``. With a
        loop, ``then(last_words)`` runs on it, between coroutine steps, where sending is safe.
        Outside the main thread (in-process tests) Python allows no handler: nothing changes."""

        def record(signum: int) -> str:
            self.stop_signum = int(signum)
            self.stop_signal = f"{self.name} stopping on {signal.Signals(signum).name}"
            return self.stop_signal

        def on_loop(signum: int) -> None:
            words = record(signum)
            if then is not None:
                then(words)

        for sig in STOP_SIGNALS:
            if loop is not None:
                loop.add_signal_handler(sig, on_loop, sig)
            elif threading.current_thread() is threading.main_thread():
                signal.signal(sig, lambda signum, _frame: record(signum))
