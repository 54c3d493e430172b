"""RewardServer in-process on a stand-in scorer: how it wears the service shell (signal ->
last words -> exit 0, no Welcome -> exit 1, a late Welcome ignored). Fast: no models, no
subprocess; the process-level tests are in test_reward_service.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from common import protocol as P
from common.service import STOP_SIGNALS, ExitCode
from common.transport import Endpoint, free_port
from helpers.fake_controller import IdleScorer, welcome_then
from reward_service.server import RewardServer


@pytest.fixture
def router():
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    yield ep
    ep.close(0)


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_signal_says_last_words_and_exits_128_plus_its_number(router, sig, restore_signal_handlers):
    seen: list[P.Message] = []
    t = welcome_then(router, lambda _r, _ident: os.kill(os.getpid(), sig), seen)
    srv = RewardServer(IdleScorer(), controller=router.address, name="rw-sig", heartbeat_s=0.2)
    try:
        rc = srv.run()  # in the main thread: only there does Python deliver signals
    finally:
        t.join(20)
    fatal = [m for m in seen if isinstance(m, P.Error)]
    assert rc == 128 + sig and len(fatal) == 1  # not 0: a supervisor must count it as gone
    assert fatal[0].code == "fatal" and fatal[0].message == f"rw-sig stopping on {signal.Signals(sig).name}"


def test_a_signal_while_the_scorer_starts_closes_it_and_exits_143(monkeypatch, restore_signal_handlers):
    """Building the scorer starts processes (reward-function workers, a vLLM reference engine):
    a SIGTERM meanwhile is acted on once it is built -- closed, exit 143 as while serving, no Hello."""
    from reward_service import server as server_module
    from reward_service.config import parse_config

    events = []

    class StartingScorer:
        def close(self) -> None:
            events.append("closed")

    def from_config(cfg):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # still building
        events.append("built")
        return StartingScorer()

    def no_server(*a, **k):
        raise AssertionError("the service said Hello after a SIGTERM during start-up")

    monkeypatch.setattr(server_module.Scorer, "from_config", staticmethod(from_config))
    monkeypatch.setattr(server_module, "RewardServer", no_server)
    cfg = parse_config(["--controller", "tcp://127.0.0.1:1", "--reward_func", "f.py"])
    assert server_module.serve(cfg) == 143
    assert events == ["built", "closed"]


def test_a_welcome_to_an_earlier_hello_is_ignored(router):
    """The handshake says Hello again when the controller is slow; the Welcome to the first
    Hello may come late and must not be answered as a bad request."""
    srv = RewardServer(IdleScorer(), controller=router.address, name="rw-late", heartbeat_s=0.2)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", srv.run()))
    t.start()
    try:
        ident, hello = router.recv(timeout=10)
        router.reply(hello, P.Welcome(peer_id="rw-late"), to=ident)
        router.send(P.Welcome(peer_id="rw-late", call_id=hello.call_id + 1000), to=ident)  # a late one
        assert isinstance(router.call(P.Shutdown(reason="test"), to=ident, timeout=10), P.Ack)
        t.join(10)
        rest = []
        while (got := router.recv(timeout=0.2)) is not None:
            rest.append(got[1])
        assert result["rc"] == 0 and srv.counters["unhandled_messages"] == 0
        assert not [m for m in rest if isinstance(m, P.Error)], rest
    finally:
        t.join(10)


def test_no_welcome_exits_3_naming_the_controller(caplog):
    address = f"tcp://127.0.0.1:{free_port()}"
    srv = RewardServer(IdleScorer(), controller=address, name="rw-alone", connect_timeout_s=1.0)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", srv.run()))
    t0 = time.monotonic()
    t.start()
    t.join(10)
    assert result["rc"] == ExitCode.NO_CONTROLLER == 3 and time.monotonic() - t0 < 5
    assert f"no Welcome from the controller at {address} within 1 s" in caplog.text


def test_forgotten_by_the_controller_it_says_hello_again_once(router):
    """The controller declared the service dead (silent on an overloaded host) and answers its
    heartbeats with ``unknown_peer``: the service introduces itself again -- one Hello, not
    one per refusal -- and is known again after the Welcome."""
    srv = RewardServer(IdleScorer(), controller=router.address, name="rw-forgot", heartbeat_s=0.1)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", srv.run()))
    t.start()
    try:
        ident, hello = router.recv(timeout=10)
        router.reply(hello, P.Welcome(peer_id="rw-forgot"), to=ident)
        hellos = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # refuse every heartbeat for a while
            got = router.recv(timeout=0.1)
            if got is None:
                continue
            if isinstance(got[1], P.Hello):
                hellos.append(got[1])
            else:
                router.send(P.Error(code="unknown_peer", message="say Hello first (or again)"), to=ident)
        assert len(hellos) == 1 and hellos[0].name == "rw-forgot" and hellos[0].role == "reward"
        router.reply(hellos[0], P.Welcome(peer_id="rw-forgot"), to=ident)
        assert isinstance(router.call(P.Shutdown(reason="test"), to=ident, timeout=10), P.Ack)
        t.join(10)
        assert result["rc"] == 0 and srv.counters["unhandled_messages"] == 0
    finally:
        t.join(10)
