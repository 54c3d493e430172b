"""Which TCP addresses a set of processes listens on, read from /proc (Linux).

A socket's inode links a process's ``/proc/PID/fd`` entry to its row in ``/proc/net/tcp`` and
``tcp6`` (state ``0A``: LISTEN). ``Watch`` samples a process tree while a run goes on: sockets
come and go (a weight group's store lives as long as its group).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    pid: int
    cmd: str  # the first words of the process's command line

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback


def _address(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    # /proc/net/tcp6 prints the address as four host-order 32-bit words
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def listeners(pids: list[int]) -> set[Listener]:
    """The listening TCP sockets the processes ``pids`` hold now."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == LISTEN and cols[9] in owner:
                pid = owner[cols[9]]
                try:
                    cmd = " ".join(Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:4]).strip()
                except OSError:
                    cmd = "?"
                found.add(Listener(*_address(cols[1]), pid, cmd))
    return found


class Watch:
    """Samples the listening sockets of ``root``'s process tree every ``every_s`` until stopped;
    ``seen`` is every one found. Use as a context manager around a run."""

    def __init__(self, root: int, every_s: float = 0.5) -> None:
        self.root, self.every_s = root, every_s
        self.seen: set[Listener] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="listening-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen |= listeners(process_tree(self.root))
            self._stop.wait(self.every_s)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
