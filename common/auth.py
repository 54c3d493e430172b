"""ZeroMQ CURVE on the controller's sockets: keys for a run, and who may connect.

    python -m common.auth keygen DIR     # once per run (the Slurm scripts do it per job)

writes a key pair for the controller (``controller.key``, ``controller.key_secret``) and one
for the services (``peer.key``, ``peer.key_secret``), and puts the services' public key into
``DIR/authorized/``: the controller admits exactly the public keys in that folder. Every role
then takes ``--auth_dir DIR``: the controller's ROUTER is a CURVE server, every service's
DEALER a CURVE client that knows the controller's public key. Traffic is encrypted; a peer
without a key (plain ZMTP) or with a key not in ``authorized/`` is refused at the ZeroMQ
handshake -- it never gets to send a message -- and the refusal is logged with its key.

What CURVE does not cover: torch.distributed's rendezvous and weight-transfer ports (gloo /
NCCL TCP) are unauthenticated; keep them on a private network or fence them with a firewall
(docs/rollout.md, "Authentication"). Keep ``*.key_secret`` readable only by the job's user:
keygen writes them mode 0600, and anyone who can read them can join the run.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

CONTROLLER, PEER, AUTHORIZED = "controller", "peer", "authorized"


def keygen(directory: str | os.PathLike) -> Path:
    """Writes the run's key pairs into ``directory`` (created); refuses to overwrite keys."""
    d = Path(directory)
    if (d / f"{CONTROLLER}.key_secret").exists():
        raise FileExistsError(f"{d} already holds keys; use it as it is or choose an empty folder")
    d.mkdir(parents=True, exist_ok=True)
    for name in (CONTROLLER, PEER):
        _, secret = zmq.auth.create_certificates(str(d), name)
        os.chmod(secret, 0o600)
    (d / AUTHORIZED).mkdir(exist_ok=True)
    shutil.copy(d / f"{PEER}.key", d / AUTHORIZED / f"{PEER}.key")
    return d


def _load(directory: Path, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    path = directory / f"{name}.key_secret" if secret else directory / f"{name}.key"
    if not path.exists():
        raise FileNotFoundError(
            f"--auth_dir {directory}: {path.name} is missing (make the keys with `python -m common.auth keygen DIR`)"
        )
    return zmq.auth.load_certificate(str(path))


class _Admission:
    """The ZAP callback: admits the authorized public keys, logs each refused key (a refused
    peer retries its handshake, so each key is logged at most once a minute)."""

    def __init__(self, directory: Path) -> None:
        keys = zmq.auth.load_certificates(str(directory / AUTHORIZED))
        if not keys:
            raise FileNotFoundError(f"--auth_dir {directory}: no public keys in {AUTHORIZED}/")
        self.allowed = set(keys)
        self._logged: dict[bytes, float] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        now = time.monotonic()
        if now - self._logged.get(key, -120.0) >= 60.0:
            self._logged[key] = now
            log.warning("refused a connection: CURVE key %s is not in the run's authorized keys", key.decode())
        return False


_authenticators: dict[int, ThreadAuthenticator] = {}
_lock = threading.Lock()


def secure_server(sock: zmq.Socket, directory: str | os.PathLike) -> None:
    """Makes ``sock`` (before bind) a CURVE server admitting only ``directory``'s authorized keys.
    One ZAP handler thread per context serves every server socket of the process."""
    d = Path(directory)
    public, secret = _load(d, CONTROLLER, secret=True)
    admission = _Admission(d)
    with _lock:
        auth = _authenticators.get(id(sock.context))
        if auth is None:
            auth = _authenticators[id(sock.context)] = ThreadAuthenticator(sock.context, log=log)
            auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=admission)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, directory: str | os.PathLike) -> None:
    """Makes ``sock`` (before connect) a CURVE client of the run's controller."""
    d = Path(directory)
    public, secret = _load(d, PEER, secret=True)
    server_public, _ = _load(d, CONTROLLER, secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "keygen":
        print("usage: python -m common.auth keygen DIR", file=sys.stderr)
        return 2
    try:
        d = keygen(args[1])
    except FileExistsError as e:
        print(f"common.auth: {e}", file=sys.stderr)
        return 1
    print(f"keys written to {d} (pass --auth_dir {d} to every role)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
