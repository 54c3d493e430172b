"""Helpers for the worker processes a service runs user code in (reward functions, environments).

A child that runs user code is stopped from outside: terminate, a grace period, then kill, so a
child that ignores SIGTERM (a hung C extension, a handler that swallows it) is still gone. And
it asks Linux to kill it when its parent dies, so a service that crashes or is SIGKILLed never
leaves a hung environment or reward function behind, holding memory and cores.
"""

from __future__ import annotations

import subprocess


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (call it first thing in the child)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no glibc (other OSes): the parent's kill on shutdown still applies
        pass


def stop(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """Terminate ``proc``, kill it if it is still there after ``grace_s``, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)
