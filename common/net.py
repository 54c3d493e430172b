"""Network helpers that need nothing but the standard library.

Kept apart from ``common.transport`` (which imports pyzmq) so the learner's DeepSpeed set-up
can pick a rendezvous port on a machine that has torch and DeepSpeed but no ZeroMQ (the GPU
checks of docs/colocated.md ran on such a machine).
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it; another process may
    still take it before it is bound again, as with any such probe)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
