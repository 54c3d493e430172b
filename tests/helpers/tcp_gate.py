"""A TCP port that leads nowhere until a test opens it, then forwards to a real one.

A service pointed at a gate's port starts its engine at once but cannot reach the controller
(ZeroMQ keeps retrying the connection) until ``open()``: the test decides when it joins
without waiting out the engine's start-up at that moment.
"""

from __future__ import annotations

import socket
import threading

from common.net import free_port


class TcpGate:
    def __init__(self, target_port: int, host: str = "127.0.0.1"):
        self.host, self.target_port = host, target_port
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def open(self) -> None:
        listener = socket.create_server((self.host, self.port))
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-gate").start()

    def close(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in ([self._listener] if self._listener else []) + socks:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                inner, _ = listener.accept()
                outer = socket.create_connection((self.host, self.target_port))
            except OSError:
                return
            with self._lock:
                self._socks += [inner, outer]
            for a, b in ((inner, outer), (outer, inner)):
                threading.Thread(target=_pump, args=(a, b), daemon=True, name="tcp-gate-pump").start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
