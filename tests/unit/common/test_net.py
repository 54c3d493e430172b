"""common/net.py: which address a listening socket binds, and a TCPStore that listens only there
(a plain one listens on every interface, whatever host it is given: the reason for the rest)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from common.net import bind_address, is_loopback, listening_socket, tcp_store_server
from helpers.listening import listeners


def _listening_on(port: int) -> set[str]:
    return {lst.host for lst in listeners([os.getpid()]) if lst.port == port}


def test_bind_address_binds_ip_addresses_and_never_resolves_a_name():
    assert bind_address("127.0.0.1") == "127.0.0.1" and bind_address("localhost") == "127.0.0.1"
    assert bind_address("10.1.2.3") == "10.1.2.3" and bind_address("::1") == "::1"
    for everywhere in ("0.0.0.0", "*", "", "::"):
        assert bind_address(everywhere) == "", everywhere
    # A host name may resolve to 127.0.1.1 here and to 10.x at the peers: every interface.
    assert bind_address("node1") == "" and bind_address("vm.cluster.local") == ""
    assert is_loopback("localhost") and is_loopback("127.0.1.1") and is_loopback("::1")
    assert not is_loopback("10.1.2.3") and not is_loopback("node1") and not is_loopback("0.0.0.0")


def test_a_plain_tcp_store_listens_on_every_interface_whatever_its_host():
    """The premise: if torch ever binds the host it is given, tcp_store_server is no longer needed."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    assert _listening_on(store.port) <= {"0.0.0.0", "::"} and _listening_on(store.port), _listening_on(store.port)
    del store


def test_tcp_store_server_listens_on_loopback_only_and_serves_its_clients():
    from torch.distributed import TCPStore

    store = tcp_store_server("127.0.0.1", timeout_s=10, world_size=2)
    assert _listening_on(store.port) == {"127.0.0.1"}
    for host in ("127.0.0.1", "localhost"):
        client = TCPStore(host, store.port, 2, False, timedelta(seconds=10))
        client.set(f"from-{host}", "x")
        assert store.get(f"from-{host}") == b"x"
        del client
    port = store.port
    del store  # it owned the listening descriptor: closed with it
    assert not _listening_on(port)


def test_a_port_in_use_is_named():
    with listening_socket("127.0.0.1") as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            tcp_store_server("127.0.0.1", port, timeout_s=5)
