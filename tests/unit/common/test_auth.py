"""ZeroMQ CURVE on the controller socket (common/auth.py): a keyed service joins; a keyless
one and one with the wrong key are refused -- and logged -- while the run goes on; without
--auth_dir nothing changes (the rest of the suite)."""

from __future__ import annotations

import logging
import os
import stat
import threading

import pytest
import zmq.auth

from common import auth
from common import protocol as P
from common.auth import keygen, main
from common.transport import CallTimeout, Endpoint, PeerUnavailable, handshake


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
    with pytest.raises((CallTimeout, PeerUnavailable)):
        handshake(keyless, "rollout", {}, timeout=1.5)
    keyless.close(0)

    intruder_keys = keygen(tmp_path / "other")  # a valid pair, just not this run's
    (intruder_keys / "controller.key").write_bytes((keys / "controller.key").read_bytes())
    intruder = Endpoint.connect(ctrl.address, name="intruder", auth_dir=str(intruder_keys))
    with pytest.raises((CallTimeout, PeerUnavailable)):
        handshake(intruder, "rollout", {}, timeout=1.5)
    intruder.close(0)
    wrong_key = zmq.auth.load_certificate(str(intruder_keys / "peer.key"))[0].decode()
    assert f"CURVE key {wrong_key} is not in the run's authorized keys" in caplog.text

    member = Endpoint.connect(ctrl.address, name="member", auth_dir=str(keys))
    assert handshake(member, "rollout", {}, timeout=10).peer_id == "member"  # the run goes on
    member.close(0)


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
