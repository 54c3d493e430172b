"""The service shell (common/service.py) over real sockets, with the test as the controller:
last words within their deadline and only once, Hello said again until welcomed, a missing
controller named, signals turned into last words and their exit code, the exit-code rule in
words, heartbeat numbering and timing. Each server's use of it is tested beside the server."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from common import protocol as P
from common.service import FATAL_SEND_S, STOP_SIGNALS, ExitCode, ServiceShell, describe_exit, signal_exit_code
from common.transport import AsyncEndpoint, Endpoint, TransportError, free_port
from helpers.fake_controller import IdleScorer


def shell(controller: str, **kw) -> ServiceShell:
    args = dict(heartbeat_s=0.2, connect_timeout_s=10.0)
    return ServiceShell("reward", "svc", controller, **{**args, **kw})


@pytest.fixture
def router():
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    yield ep
    ep.close(0)


def nobody() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


# ---------------------------------------------------------------------------- last words


def test_last_words_reach_the_controller_once(router):
    sh = shell(router.address)
    ep = Endpoint.connect(router.address, name="svc")
    try:
        assert sh.send_last_words(ep, "svc: engine died")
        assert not sh.send_last_words(ep, "svc: engine died again")  # one set of last words
        _, msg = router.recv(timeout=5)
        assert isinstance(msg, P.Error) and (msg.code, msg.message, msg.call_id) == ("fatal", "svc: engine died", 0)
        assert router.recv(timeout=0.3) is None
    finally:
        ep.close(0)


def test_a_requested_stop_is_said_as_info_and_announced_as_a_fault_is(router, caplog):
    """A signal is a stop that was asked for: the log says so at INFO, not as ``announcing
    fatal`` at ERROR; the controller gets the same notice as for a fault (the service is going,
    its work is re-issued at once)."""
    sh = shell(router.address)
    ep = Endpoint.connect(router.address, name="svc")
    try:
        with caplog.at_level("INFO", logger="common.service"):
            assert sh.send_last_words(ep, "svc stopping on SIGTERM", fault=False)
        _, msg = router.recv(timeout=5)
        assert isinstance(msg, P.Error) and (msg.code, msg.message) == ("fatal", "svc stopping on SIGTERM")
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", "svc stopping on SIGTERM; telling the controller")
        ]
    finally:
        ep.close(0)


def test_last_words_give_up_after_their_deadline_when_nobody_listens():
    sh = shell(nobody())
    ep = Endpoint.connect(sh.controller, name="svc")
    try:
        t0 = time.monotonic()
        assert sh.send_last_words(ep, "svc stopping on SIGTERM")  # said, though nobody heard
        # FATAL_SEND_S, not the socket's 10 s send timeout: a supervisor waits for the exit
        assert FATAL_SEND_S - 0.1 <= time.monotonic() - t0 < FATAL_SEND_S + 1.0
    finally:
        ep.close(0)


def test_async_last_words_give_up_after_their_deadline_too():
    async def main() -> float:
        sh = shell(nobody())
        ep = AsyncEndpoint(sh.controller, name="svc")
        try:
            t0 = time.monotonic()
            assert await sh.asend_last_words(ep, "svc: engine died")
            elapsed = time.monotonic() - t0
            assert not await sh.asend_last_words(ep, "svc: again")
            return elapsed
        finally:
            ep.close(0)

    assert FATAL_SEND_S - 0.1 <= asyncio.run(main()) < FATAL_SEND_S + 1.0


# ---------------------------------------------------------------------------- handshake


def answer_second_hello(router: Endpoint, seen: list[P.Hello]) -> threading.Thread:
    """A controller slow to answer: the first Hello goes unanswered, the second is welcomed."""

    def run() -> None:
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            got = router.recv(timeout=0.1)
            if got and isinstance(got[1], P.Hello):
                seen.append(got[1])
                if len(seen) == 2:
                    router.reply(got[1], P.Welcome(peer_id="svc", policy_version=7), to=got[0])

    t = threading.Thread(target=run)
    t.start()
    return t


def test_hello_is_said_again_until_welcomed(router):
    sh, seen = shell(router.address, hello_attempt_s=0.5), []
    ep = Endpoint.connect(router.address, name="svc")
    t = answer_second_hello(router, seen)
    try:
        welcome = sh.say_hello(ep, P.RewardCapabilities(capacity=4))
        assert welcome.policy_version == 7 and len(seen) == 2
        assert seen[0].call_id != seen[1].call_id and seen[1].capabilities == P.RewardCapabilities(capacity=4)
        assert seen[1].role == "reward" and seen[1].name == "svc"
    finally:
        t.join(10)
        ep.close(0)


def test_async_hello_is_said_again_until_welcomed(router):
    sh, seen = shell(router.address, hello_attempt_s=0.5), []
    t = answer_second_hello(router, seen)

    async def main() -> P.Welcome:
        ep = AsyncEndpoint(router.address, name="svc")
        try:
            return await sh.asay_hello(ep, None)
        finally:
            ep.close(0)

    try:
        assert asyncio.run(main()).policy_version == 7 and len(seen) == 2
    finally:
        t.join(10)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_no_welcome_names_the_controller_within_the_connect_timeout(flavour):
    sh = shell(nobody(), connect_timeout_s=1.0, hello_attempt_s=0.4)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=rf"svc: no Welcome from the controller at {sh.controller} within 1 s"):
        if flavour == "sync":
            ep = Endpoint.connect(sh.controller, name="svc")
            try:
                sh.say_hello(ep, None)
            finally:
                ep.close(0)
        else:

            async def main() -> None:
                ep = AsyncEndpoint(sh.controller, name="svc")
                try:
                    await sh.asay_hello(ep, None)
                finally:
                    ep.close(0)

            asyncio.run(main())
    assert time.monotonic() - t0 < 4.0  # the deadline, plus at most one last attempt's second


# ---------------------------------------------------------------------------- signals


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_signal_is_recorded_for_the_serving_loop(sig, restore_signal_handlers):
    sh = shell(nobody())
    sh.catch_signals()
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + 5
    while sh.stop_signal is None and time.monotonic() < deadline:
        time.sleep(0.01)  # Python runs the handler between bytecodes of the main thread
    assert sh.stop_signal == f"svc stopping on {signal.Signals(sig).name}"
    assert sh.signal_exit == 128 + sig == {signal.SIGTERM: 143, signal.SIGINT: 130}[sig]


def test_a_signal_runs_the_callback_on_the_event_loop():
    sh, heard = shell(nobody()), []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sh.catch_signals(loop, then=heard.append)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                if heard:
                    break
                await asyncio.sleep(0.01)
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    asyncio.run(main())
    assert heard == ["svc stopping on SIGTERM"] and sh.stop_signal == heard[0]


def test_outside_the_main_thread_signals_are_left_alone(restore_signal_handlers):
    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=shell(nobody()).catch_signals)  # in-process servers in tests
    t.start()
    t.join(5)
    assert signal.getsignal(signal.SIGTERM) is before


# ---------------------------------------------------------------------------- heartbeats


def test_heartbeats_are_numbered_and_due_every_period():
    sh = shell(nobody(), heartbeat_s=0.2)
    assert sh.heartbeat_in() == 0  # the first at once
    first = sh.heartbeat({"in_flight": 2.0}, policy_version=3)
    assert (first.name, first.seq, first.policy_version, first.stats) == ("svc", 0, 3, {"in_flight": 2.0})
    assert 0.1 < sh.heartbeat_in() <= 0.2
    time.sleep(0.25)
    assert sh.heartbeat_in() == 0 and sh.heartbeat({}).seq == 1


def test_exit_codes_keep_their_numbers():
    # launch.local, Slurm and the docs read these numbers.
    assert (ExitCode.STOPPED, ExitCode.FATAL, ExitCode.NO_START, ExitCode.NO_CONTROLLER) == (0, 1, 2, 3)
    assert signal_exit_code(signal.SIGTERM) == 143 and signal_exit_code(signal.SIGINT) == 130  # as a shell reads them


@pytest.mark.parametrize(
    "code, words",
    [
        (0, "stopped by the controller"),
        (1, "it broke; its log says why"),
        (2, "it could not start"),
        (3, "no controller answered it in time"),
        (143, "stopped by SIGTERM"),  # the service's own exit after its last words
        (130, "stopped by SIGINT"),
        (-9, "killed by SIGKILL"),  # subprocess: ended by a signal it did not handle
        (7, "exit code 7"),
    ],
)
def test_exit_codes_read_in_words(code, words):
    assert describe_exit(code).startswith(words)


def test_the_shell_imports_no_role_package():
    tree = ast.parse((Path(__file__).resolve().parents[3] / "common/service.py").read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not imported & {"learner", "rollout_service", "reward_service", "launch"}


# ---------------------------------------------------------------------------- the controller goes away


def test_a_lost_controller_gets_a_hello_per_period_until_welcomed_in_a_new_session():
    sh = shell(nobody(), heartbeat_s=0.2, reconnect_timeout_s=60.0)
    assert not sh.lost and sh.session == 0
    sh.controller_lost("could not send Heartbeat")
    sh.controller_lost("could not send SampleBatch")  # still the same loss
    assert sh.lost
    first = sh.reconnect_hello(P.RewardCapabilities(capacity=4), call_id=11)
    assert (first.role, first.name, first.capabilities, first.call_id) == (
        "reward",
        "svc",
        P.RewardCapabilities(capacity=4),
        11,
    )
    assert sh.reconnect_hello(None, call_id=12) is None  # the first may still be answered
    sh.hello_unsent()  # it never left: the next may go at once
    again = sh.reconnect_hello(None, call_id=13)
    assert again.call_id == 13
    assert not sh.welcomed_again(P.Welcome(peer_id="svc", call_id=11))  # answers a Hello that never left
    assert sh.lost
    assert sh.welcomed_again(P.Welcome(peer_id="svc", call_id=13, policy_version=5))
    assert not sh.lost and sh.session == 1  # work of the old controller is now dropped


def test_a_lost_controller_is_given_up_after_the_reconnect_timeout():
    sh = shell(nobody(), reconnect_timeout_s=0.3)
    assert not sh.reconnect_expired()  # not lost: nothing to give up
    sh.controller_lost("test")
    assert not sh.reconnect_expired()
    time.sleep(0.35)
    assert sh.reconnect_expired()


def test_a_heartbeat_that_cannot_leave_for_a_few_periods_means_the_controller_is_gone():
    sh = shell(nobody(), heartbeat_s=0.2)
    assert sh.heartbeat_send_s == pytest.approx(max(3 * 0.2, 1.0))
    ep = Endpoint.connect(sh.controller, name="svc")  # nobody bound: no connection
    try:
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            ep.send(sh.heartbeat({}), timeout=sh.heartbeat_send_s)
        assert time.monotonic() - t0 < sh.heartbeat_send_s + 1.0
    finally:
        ep.close(0)


def _welcome_first_hello(router: Endpoint, timeout_s: float = 15.0) -> tuple[bytes, P.Hello]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = router.recv(timeout=0.1)
        if got is not None and isinstance(got[1], P.Hello):
            router.reply(got[1], P.Welcome(peer_id=got[1].name, policy_version=3), to=got[0])
            return got
    raise AssertionError("no Hello")


def test_a_reward_service_outlives_its_controller_and_joins_the_restarted_one():
    """A real RewardServer (in a thread, real sockets): the controller's socket closes (a killed
    learner), the service notices within a few heartbeats, says Hello to the controller bound
    again at the same address, and serves it: heartbeats, then Shutdown -> exit 0."""
    from reward_service.server import RewardServer

    address = nobody()
    first = Endpoint.bind(address)
    srv = RewardServer(IdleScorer(), controller=address, name="rw-outlive", heartbeat_s=0.2, reconnect_timeout_s=60.0)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", srv.run()))
    t.start()
    try:
        _welcome_first_hello(first)
        assert first.recv(timeout=5) is not None  # serving: a heartbeat
        first.close(0)  # the learner is killed
        deadline = time.monotonic() + 10
        while not srv.shell.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.shell.lost and t.is_alive()
        second = Endpoint.bind(address)  # the restarted learner's controller
        try:
            ident, hello = _welcome_first_hello(second)
            assert hello.name == "rw-outlive" and hello.role == "reward"
            got = second.recv(timeout=5)
            assert got is not None and isinstance(got[1], P.Heartbeat)
            assert not srv.shell.lost and srv.shell.session == 1
            assert isinstance(second.call(P.Shutdown(reason="test"), to=ident, timeout=10), P.Ack)
            t.join(10)
            assert result["rc"] == ExitCode.STOPPED
        finally:
            second.close(0)
    finally:
        t.join(10)


def test_a_reward_service_gives_up_after_its_reconnect_timeout():
    from reward_service.server import RewardServer

    address = nobody()
    first = Endpoint.bind(address)
    srv = RewardServer(IdleScorer(), controller=address, name="rw-giveup", heartbeat_s=0.2, reconnect_timeout_s=1.0)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", srv.run()))
    t.start()
    try:
        _welcome_first_hello(first)
        assert first.recv(timeout=5) is not None  # welcomed (closing at once could drop the Welcome)
        first.close(0)
        t.join(15)
        assert not t.is_alive() and result["rc"] == ExitCode.NO_CONTROLLER
    finally:
        t.join(10)
