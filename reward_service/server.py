"""The reward service process: a ``Scorer`` behind a DEALER socket to the controller.

Threads and sockets:
- the *main* thread owns the DEALER socket (ZMQ sockets are not thread-safe): it answers
  the handshake, receives requests, sends replies and a Heartbeat every ``--heartbeat_s``;
- one *scoring* thread runs ``Scorer.score`` on queued ScoreRequests in arrival order (one
  model forward at a time is what a GPU wants) and hands replies back through a queue,
  waking the main thread over an inproc PAIR socket. So heartbeats keep flowing while a
  long batch scores, and a slow batch does not look like a dead service.

Messages in (controller -> service):
- ``ScoreRequest`` -> ``ScoredBatch`` (same ``call_id``), or ``Error`` with the request's
  ``call_id`` and ``prompt_ids``: "bad_request" (it cannot be scored as sent; the service
  stays up), "overloaded" (more than ``--max_pending`` queued), "internal" (a model forward
  raised, e.g. out of memory; the controller may re-issue the work elsewhere);
- ``Shutdown`` -> finish queued work (at most ``DRAIN_S``), answer ``Ack`` if it was a call,
  exit 0;
- ``Error(code="fatal")`` from the controller -> exit 0: there is no one left to serve;
- ``Welcome`` to an earlier Hello (the handshake says Hello again while the controller is
  slow to answer) -> ignored;
- anything else -> ``Error(code="bad_request")``. Undecodable frames are answered by the
  transport (``common/transport.py``) and counted in ``rejected``.

Fatal faults -- ``FATAL_AFTER`` internal errors in a row (a broken device stays broken),
an unexpected exception in this loop, SIGTERM / SIGINT -- send ``Error(code="fatal")`` so the
controller re-issues this service's work at once instead of waiting for the heartbeat
deadline, then exit (1 for a fault, 128 + the signal's number for a signal: 143 for SIGTERM).
The handshake, heartbeat timing, last words, signals and exit codes are the shell both
services share (``common/service.py``, which states the exit codes).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time

import msgspec
import zmq

from common.protocol import (
    Ack,
    Error,
    Hello,
    Message,
    RewardCapabilities,
    ScoredBatch,
    ScoreRequest,
    Shutdown,
    ShutdownAccepted,
    Welcome,
)
from common.service import (
    DEFAULT_RECONNECT_S,
    RECONNECT_SEND_S,
    STOP_SIGNALS,
    ExitCode,
    ServiceShell,
    signal_exit_code,
)
from common.transport import Endpoint, TransportError, default_name
from common.vllm_memory import EngineStartRefused
from reward_service.inputs import BadRequest
from reward_service.scorer import Scorer

log = logging.getLogger(__name__)

DRAIN_S = 30.0  # on Shutdown, queued work gets this long to finish
FATAL_AFTER = 3  # consecutive internal errors that make the service declare itself broken


class RewardServer:
    def __init__(
        self,
        scorer: Scorer,
        *,
        controller: str,
        name: str = "",
        heartbeat_s: float = 2.0,
        connect_timeout_s: float = 60.0,
        reconnect_timeout_s: float = DEFAULT_RECONNECT_S,
        max_pending: int = 64,
        capacity: int = 64,
        auth_dir: str | None = None,
    ) -> None:
        self.scorer = scorer
        self.controller = controller
        self.auth_dir = auth_dir or None
        self.name = name or default_name("reward")
        self.shell = ServiceShell(
            "reward",
            self.name,
            controller,
            heartbeat_s=heartbeat_s,
            connect_timeout_s=connect_timeout_s,
            reconnect_timeout_s=reconnect_timeout_s,
        )
        self.max_pending = max_pending
        self.capacity = capacity
        # Each request travels with the shell's session it arrived in: a reply for a controller
        # that has since gone (or forgotten us) is dropped, not sent to its successor.
        self._todo: queue.Queue[tuple[int, ScoreRequest] | None] = queue.Queue()
        self._done: queue.Queue[tuple[int, Message]] = queue.Queue()
        self._busy = 0  # requests taken by the scoring thread and not yet answered
        self._consecutive_internal = 0
        self._fatal: str | None = None  # set by the scoring thread: the main loop announces it
        # bad_requests / internal_errors: written by the scoring thread only; the others by the main thread.
        self.counters = {"bad_requests": 0, "internal_errors": 0, "overloaded": 0, "unhandled_messages": 0}
        self._ctx = zmq.Context.instance()
        self._wake_addr = f"inproc://reward-wake-{id(self)}"
        self._ep: Endpoint | None = None

    # ------------------------------------------------------------------ scoring thread
    def _score_loop(self) -> None:
        # inproc PAIR to the main thread: an empty message per finished request, only to wake
        # its poll; the replies themselves go through self._done. Sent NOBLOCK: if the pipe
        # is full (default HWM 1000) the main thread has wake-ups pending anyway, so a dropped
        # one loses nothing. Linger 0: nothing in it is worth waiting for at exit.
        wake = self._ctx.socket(zmq.PAIR)
        wake.connect(self._wake_addr)

        def poke() -> None:
            try:
                wake.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

        try:
            while True:
                item = self._todo.get()
                if item is None:
                    return
                session, req = item
                reply, fatal = self._answer(req)
                self._done.put((session, reply))
                if fatal:  # after the reply is queued: the main loop sends it before the notice
                    self._fatal = fatal
                poke()
        except Exception as e:  # a bug here must take the service down loudly
            log.exception("scoring thread crashed")
            self._fatal = f"scoring thread crashed: {type(e).__name__}: {e}"
            poke()
        finally:
            wake.close(0)

    def _answer(self, req: ScoreRequest) -> tuple[Message, str | None]:
        """The reply to ``req``, and a reason to go down if this failure makes the service fatal."""
        fatal = None
        out: ScoredBatch | Error
        try:
            out = self.scorer.score(req)
            self._consecutive_internal = 0
        except BadRequest as e:
            self.counters["bad_requests"] += 1
            log.warning("bad ScoreRequest (call %d): %s", req.call_id, e)
            out = Error(code="bad_request", message=str(e), prompt_ids=list(req.samples.prompt_ids))
        except Exception as e:  # the request failed, the service may live on
            self.counters["internal_errors"] += 1
            self._consecutive_internal += 1
            log.exception("scoring call %d failed", req.call_id)
            out = Error(
                code="internal",
                message=f"{self.name}: {type(e).__name__}: {e}",
                prompt_ids=list(req.samples.prompt_ids),
            )
            if self._consecutive_internal >= FATAL_AFTER:
                fatal = f"{FATAL_AFTER} scoring calls in a row failed; last: {type(e).__name__}: {e}"
        out.call_id = req.call_id
        return out, fatal

    # ------------------------------------------------------------------ main thread
    def run(self) -> int:
        """Serves until Shutdown, a fatal fault or a signal; returns the exit code."""
        self.shell.catch_signals()
        wake = self._ctx.socket(zmq.PAIR)
        wake.bind(self._wake_addr)
        ep = self._ep = Endpoint.connect(self.controller, name=self.name, auth_dir=self.auth_dir)
        worker = threading.Thread(target=self._score_loop, name="reward-score", daemon=True)
        try:
            try:
                welcome = self.shell.say_hello(ep, self.capabilities())
            except TransportError as e:  # never registered: nobody to announce anything to
                log.error("could not register with the controller: %s", e)
                return self.shell.no_controller_exit
            log.info("%s registered with the controller at %s as %s", self.name, self.controller, welcome.peer_id)
            worker.start()
            return self._loop(ep, wake)
        except Exception as e:
            log.exception("reward service failed")
            self.shell.send_last_words(ep, f"{self.name} failed: {type(e).__name__}: {e}")
            return ExitCode.FATAL
        finally:
            self._todo.put(None)
            if worker.is_alive():
                worker.join(timeout=5)
            self.scorer.close()
            ep.close()
            wake.close(0)

    def capabilities(self) -> RewardCapabilities:
        return msgspec.structs.replace(self.scorer.capabilities(), capacity=self.capacity, max_pending=self.max_pending)

    def _loop(self, ep: Endpoint, wake: zmq.Socket) -> int:
        poller = zmq.Poller()
        poller.register(ep.sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        drain_deadline: float | None = None
        shutdown_call: Shutdown | None = None
        while True:
            while not self._done.empty():
                session, msg = self._done.get()
                self._busy -= 1
                if session == self.shell.session:
                    self._send(ep, msg)
                else:
                    log.info("dropping the reply to call %d: asked by a controller that is gone", msg.call_id)
            if self._fatal:
                self.shell.send_last_words(ep, f"{self.name}: {self._fatal}")
                return ExitCode.FATAL
            if self.shell.stop_signal:
                self.shell.send_last_words(ep, self.shell.stop_signal, fault=False)
                return self.shell.signal_exit
            if drain_deadline is not None and (self._busy == 0 or time.monotonic() >= drain_deadline):
                if self._busy:
                    log.warning("shutting down with %d request(s) unanswered after %.0f s", self._busy, DRAIN_S)
                if shutdown_call is not None and shutdown_call.call_id:
                    self._send(ep, Ack(info=ShutdownAccepted(unanswered=self._busy), call_id=shutdown_call.call_id))
                return ExitCode.STOPPED
            if self.shell.lost:
                if self.shell.reconnect_expired():
                    return self.shell.no_controller_exit
                hello = self.shell.reconnect_hello(self.capabilities(), ep.core.new_call_id())
                if hello is not None and not self._send(ep, hello, timeout=RECONNECT_SEND_S):
                    self.shell.hello_unsent()
            elif self.shell.heartbeat_in() <= 0:
                self._send(ep, self.shell.heartbeat(self.stats()), timeout=self.shell.heartbeat_send_s)
            # Wake for the next heartbeat, and often enough to notice a signal.
            events = dict(poller.poll(timeout=int(min(self.shell.heartbeat_in(), 0.2) * 1000)))  # ms
            if wake in events:
                while wake.poll(0):
                    wake.recv()
            if ep.core.stash or ep.sock in events:
                got = ep.recv(timeout=0)
                if got is None:
                    continue
                msg = got[1]
                if isinstance(msg, Shutdown):
                    log.info(
                        "Shutdown from the controller (%s): finishing %d queued request(s)",
                        msg.reason or "no reason given",
                        self._busy,
                    )
                    shutdown_call, drain_deadline = msg, time.monotonic() + DRAIN_S
                elif drain_deadline is not None:
                    if isinstance(msg, ScoreRequest):
                        self._send(
                            ep,
                            Error(
                                code="shutting_down",
                                message=f"{self.name} is shutting down",
                                prompt_ids=list(msg.samples.prompt_ids),
                                call_id=msg.call_id,
                            ),
                        )
                else:
                    if self._handle(ep, msg) == "exit":
                        return ExitCode.STOPPED

    def _handle(self, ep: Endpoint, msg: Message) -> str | None:
        if isinstance(msg, ScoreRequest):
            if self._busy >= self.max_pending:
                self.counters["overloaded"] += 1
                self._send(
                    ep,
                    Error(
                        code="overloaded",
                        message=f"{self.name} has {self._busy} requests queued (--max_pending {self.max_pending})",
                        prompt_ids=list(msg.samples.prompt_ids),
                        call_id=msg.call_id,
                    ),
                )
                return None
            self._busy += 1
            self._todo.put((self.shell.session, msg))
        elif isinstance(msg, Error):
            if msg.code == "fatal":
                log.error("controller is going down (%s): exiting", msg.message)
                return "exit"
            if msg.code == "unknown_peer":  # declared dead (e.g. silent on an overloaded host)
                hello = self.shell.hello_again(self.capabilities(), ep.core.new_call_id())
                if hello is not None:
                    self._send(ep, hello)
                return None
            log.warning("controller sent error %s: %s", msg.code, msg.message)
        elif isinstance(msg, Welcome):
            if not self.shell.welcomed_again(msg):
                log.debug("ignoring a Welcome to an earlier Hello")
        else:
            self.counters["unhandled_messages"] += 1
            self._send(
                ep,
                Error(
                    code="bad_request",
                    message=f"{self.name} (a reward service) does not handle {type(msg).__name__}",
                    call_id=msg.call_id,
                ),
            )
        return None

    def _send(self, ep: Endpoint, msg: Message, timeout: float | None = None) -> bool:
        """Sends; a send that cannot leave means the controller is gone (no connection within
        the timeout): the shell starts reconnecting. False when it did not leave."""
        try:
            ep.send(msg, timeout=timeout)
            return True
        except TransportError as e:
            if not isinstance(msg, Hello):
                log.error("could not send %s: %s", type(msg).__name__, e)
                self.shell.controller_lost(f"could not send {type(msg).__name__}")
            return False

    def stats(self) -> dict[str, float]:
        """Heartbeat stats: the scorer's counters plus queue depth and error counts."""
        return {
            **self.scorer.stats(),
            **{k: float(v) for k, v in self.counters.items()},
            "in_flight": float(self._busy),
            "rejected": float(self._ep.stats["rejected"] if self._ep else 0),
        }


def serve(cfg) -> int:
    """Builds the Scorer from ``cfg`` and serves; returns the exit code."""
    from reward_service.func_reward import FuncLoadError
    from reward_service.reward_model import RewardModelError

    name = cfg.name or default_name("reward")
    cfg.name = name
    # Building the scorer starts processes (reward-function workers, a vLLM reference engine).
    # A SIGTERM/SIGINT meanwhile must not kill this process alone and leave them behind: it is
    # noted, and the scorer closed once built.
    stopped: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, _frame: stopped.append(signum))
    try:
        scorer = Scorer.from_config(cfg)
    except EngineStartRefused as e:  # one line naming the flag (common/vllm_memory.py)
        log.error("%s", e)
        return ExitCode.NO_START
    except (FuncLoadError, RewardModelError, OSError, ValueError) as e:
        log.error("reward service %s failed to start: %s", name, e)
        return ExitCode.NO_START
    if stopped:
        log.warning("%s: %s while starting; closing what was started", name, signal.Signals(stopped[0]).name)
        scorer.close()
        return signal_exit_code(stopped[0])  # as a signal while serving
    log.info("%s scoring with %s", name, scorer.capabilities().sources)
    return RewardServer(
        scorer,
        controller=cfg.controller,
        name=name,
        heartbeat_s=cfg.heartbeat_s,
        connect_timeout_s=cfg.connect_timeout_s,
        reconnect_timeout_s=cfg.reconnect_timeout_s,
        max_pending=cfg.max_pending,
        capacity=cfg.capacity,
        auth_dir=cfg.auth_dir,
    ).run()
