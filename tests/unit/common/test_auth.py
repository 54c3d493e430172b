"""ZeroMQ CURVE on the controller socket (common/auth.py): a keyed service joins; a keyless
one and one with the wrong key are refused -- and logged -- while the run goes on, and each is
told why (the handshake failed, the keys may not match), not "no controller"; without
--auth_dir nothing changes (the rest of the suite). Keys are born 0600."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import threading

import pytest
import zmq.auth

from common import auth
from common import protocol as P
from common.auth import keygen, main
from common.service import ServiceShell
from common.transport import AsyncEndpoint, Endpoint, HandshakeFailed, TransportError, ahandshake, handshake


def _serve_hellos(ctrl: Endpoint, stop: threading.Event) -> None:
    while not stop.is_set():
        got = ctrl.recv(timeout=0.1)
        if got is not None and isinstance(got[1], P.Hello):
            ctrl.reply(got[1], P.Welcome(peer_id=got[1].name), to=got[0])


@pytest.fixture
def secured(tmp_path):
    keys = keygen(tmp_path / "keys")
    ctrl = Endpoint.bind("tcp://127.0.0.1:0", auth_dir=str(keys))
    stop = threading.Event()
    t = threading.Thread(target=_serve_hellos, args=(ctrl, stop), daemon=True)
    t.start()
    yield ctrl, keys
    stop.set()
    t.join(5)
    ctrl.close(0)


def test_keyed_service_joins_keyless_and_wrong_key_are_refused_and_logged(secured, tmp_path, caplog):
    ctrl, keys = secured
    caplog.set_level(logging.WARNING, logger="common.auth")
    keyless = Endpoint.connect(ctrl.address, name="keyless")
    with pytest.raises(HandshakeFailed, match="the controller requires CURVE keys: give this service --auth_dir"):
        handshake(keyless, "rollout", None, timeout=1.5)
    keyless.close(0)

    intruder_keys = keygen(tmp_path / "other")  # a valid pair, just not this run's
    (intruder_keys / "controller.key").unlink()
    shutil.copy(keys / "controller.key", intruder_keys / "controller.key")
    intruder = Endpoint.connect(ctrl.address, name="intruder", auth_dir=str(intruder_keys))
    with pytest.raises(
        HandshakeFailed, match=r"CURVE handshake .* failed: it refused this service's key \(ZAP status 400\)"
    ):
        handshake(intruder, "rollout", None, timeout=1.5)
    intruder.close(0)
    wrong_key = zmq.auth.load_certificate(str(intruder_keys / "peer.key"))[0].decode()
    assert f"CURVE key {wrong_key} is not in the run's authorized keys" in caplog.text

    member = Endpoint.connect(ctrl.address, name="member", auth_dir=str(keys))
    assert handshake(member, "rollout", None, timeout=10).peer_id == "member"  # the run goes on
    assert member.handshake_failure() is None and member.watch.closed  # proven keys: no more events
    member.close(0)


def test_a_service_holding_another_runs_keys_is_told_the_keys_may_not_match(secured, tmp_path, caplog):
    """Two key folders: the service's controller.key is another run's controller. The controller
    cannot even read its HELLO and drops the connection; the service must not report that as a
    dead controller ("not connected or not reading")."""
    ctrl, _ = secured
    other = keygen(tmp_path / "other")
    svc = Endpoint.connect(ctrl.address, name="stranger", auth_dir=str(other))
    with pytest.raises(HandshakeFailed) as err:
        handshake(svc, "rollout", None, timeout=1.5)
    text = str(err.value)
    assert f"the CURVE handshake with the controller at {ctrl.address} failed" in text
    assert f"the keys may not match -- the controller.key in this service's --auth_dir {other}" in text
    assert "not connected or not reading" not in text
    svc.close(0)

    # The same through the service shell (what a rollout server or reward service runs): its
    # one-line exit names the handshake, and each failed Hello is a warning, not "not answering".
    caplog.set_level(logging.INFO, logger="common.service")
    svc = Endpoint.connect(ctrl.address, name="stranger-2", auth_dir=str(other))
    shell = ServiceShell(
        "rollout",
        svc.name,
        ctrl.address,
        heartbeat_s=1.0,
        connect_timeout_s=2.0,
        hello_attempt_s=1.0,
    )
    with pytest.raises(
        TransportError, match=r"no Welcome .* within 2 s: stranger-2: the CURVE handshake .* keys may not"
    ):
        shell.say_hello(svc, None)
    assert "controller not answering yet" not in caplog.text
    assert any(r.levelno == logging.WARNING and "CURVE handshake" in r.message for r in caplog.records)
    svc.close(0)

    async def asyncio_service() -> str:
        ep = AsyncEndpoint(ctrl.address, name="stranger-3", auth_dir=str(other))
        try:
            await ahandshake(ep, "reward", None, timeout=1.5)
        except HandshakeFailed as e:
            return str(e)
        finally:
            ep.close(0)
        return "welcomed"

    assert "the keys may not match" in asyncio.run(asyncio_service())


def test_a_keyed_service_at_a_keyless_controller_is_told_so(tmp_path):
    keys = keygen(tmp_path / "keys")
    ctrl = Endpoint.bind("tcp://127.0.0.1:0")
    svc = Endpoint.connect(ctrl.address, name="keyed", auth_dir=str(keys))
    with pytest.raises(HandshakeFailed, match="holds CURVE keys .* and the controller runs without"):
        handshake(svc, "rollout", None, timeout=1.5)
    svc.close(0)
    ctrl.close(0)


def test_keygen_refuses_to_overwrite_and_a_missing_key_names_the_file(tmp_path, capsys):
    assert main(["keygen", str(tmp_path / "k")]) == 0
    assert main(["keygen", str(tmp_path / "k")]) == 1
    assert "already holds keys" in capsys.readouterr().err
    (tmp_path / "k" / "peer.key_secret").unlink()
    with pytest.raises(FileNotFoundError, match="peer.key_secret is missing"):
        Endpoint.connect("tcp://127.0.0.1:1", name="x", auth_dir=str(tmp_path / "k"))
    assert main(["oops"]) == 2


def test_secret_keys_are_born_0600_under_a_permissive_umask(tmp_path, monkeypatch):
    """Not chmod-ed after the fact: each file's mode is read the moment it is created, before a
    byte of it is written, with a umask that narrows nothing."""
    born: dict[str, int] = {}
    fdopen = os.fdopen

    def spying_fdopen(fd, *args, **kwargs):
        born[os.readlink(f"/proc/self/fd/{fd}")] = stat.S_IMODE(os.fstat(fd).st_mode)
        assert os.fstat(fd).st_size == 0
        return fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(auth.os, "fdopen", spying_fdopen)
    old = os.umask(0)
    try:
        keys = keygen(tmp_path / "k")
    finally:
        os.umask(old)
    secrets = {p: m for p, m in born.items() if p.endswith(".key_secret")}
    assert sorted(os.path.basename(p) for p in secrets) == ["controller.key_secret", "peer.key_secret"]
    assert set(secrets.values()) == {0o600}, born
    assert {m for p, m in born.items() if p.endswith(".key")} == {0o644}, born
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("controller", "peer"):
        assert stat.S_IMODE((keys / f"{name}.key_secret").stat().st_mode) == 0o600
        public, secret = zmq.auth.load_certificate(str(keys / f"{name}.key_secret"))
        assert zmq.auth.load_certificate(str(keys / f"{name}.key"))[0] == public and secret
    assert zmq.auth.load_certificates(str(keys / "authorized")) == {
        zmq.auth.load_certificate(str(keys / "peer.key"))[0]: True
    }


def test_help_exits_0_and_says_how(capsys):
    for flag in ("--help", "-h"):
        assert main([flag]) == 0
        out = capsys.readouterr().out
        assert "usage: python -m common.auth keygen DIR" in out and "0600" in out
    assert main([]) == 2
    assert "usage:" in capsys.readouterr().err
