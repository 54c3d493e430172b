"""Network helpers that import nothing but the standard library at load time.

Kept apart from ``common.transport`` (which imports pyzmq) so the learner's DeepSpeed set-up
can pick a rendezvous port on a machine that has torch and DeepSpeed but no ZeroMQ (the GPU
checks of docs/colocated.md ran on such a machine).

Which interface a listening socket binds (docs/security.md). torch.distributed's ``TCPStore``
listens on every interface whatever host it is given (its servers bind the wildcard address;
torch 2.13's libuv and legacy backends alike), and answers any client that reaches it. The one
way to narrow it is to hand it a socket already listening where we choose (``master_listen_fd``):
``tcp_store_server`` does that, on the address ``bind_address`` derives from the one peers are
told to connect to.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from typing import Any

WILDCARDS = ("", "*", "0.0.0.0", "::")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it; another process may
    still take it before it is bound again, as with any such probe)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """``host`` names this machine only: ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_address(host: str) -> str:
    """The address to listen on for peers told to connect to ``host``: ``host`` itself when it is
    an IP address (a loopback one: only this machine can connect), ``127.0.0.1`` for
    ``localhost``, else ``""`` (every interface). A host name is not resolved here: it may resolve
    to another address on this host than at the peers (Debian maps a machine's own name to
    127.0.1.1), and a socket bound there would turn every peer away. Give an IP address to bind
    one interface."""
    if host == "localhost":
        return "127.0.0.1"
    if host in WILDCARDS:
        return ""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return ""


def listening_socket(host: str, port: int = 0, backlog: int = 1024) -> socket.socket:
    """A TCP socket listening on ``bind_address(host)`` at ``port`` (0: one the OS picks).
    The backlog is deep, as TCPStore's own: every rank connects at once."""
    address = bind_address(host)
    try:
        if address:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            return socket.create_server((address, port), family=family, backlog=backlog)
        if socket.has_dualstack_ipv6():  # every interface, IPv4 and IPv6 (as TCPStore's own)
            return socket.create_server(("", port), family=socket.AF_INET6, backlog=backlog, dualstack_ipv6=True)
        return socket.create_server(("", port), backlog=backlog)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {address or '*'}:{port}: {e.strerror}") from None


def tcp_store_server(host: str, port: int = 0, *, timeout_s: float, world_size: int | None = None) -> Any:
    """A ``torch.distributed.TCPStore`` server for peers that connect to ``host``, listening on
    ``bind_address(host)`` only (see the module docstring). ``port`` 0: one the OS picks
    (``store.port`` says which). It does not wait for clients. torch is imported here, not at
    module load."""
    from torch.distributed import TCPStore

    sock = listening_socket(host, port)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here: it closes it when destroyed
    try:
        return TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        socket.close(fd)  # as vLLM's create_tcp_store: a store that failed to start did not take it
        raise
