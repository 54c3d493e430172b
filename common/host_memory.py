"""How glibc's malloc hands freed memory back to the kernel, and a setting that keeps it.

A training step on CPU allocates and frees the same activation and gradient tensors every
micro-batch. glibc's defaults serve blocks above a dynamic threshold (128 KiB, growing up to
the largest block freed) with their own ``mmap`` and ``munmap`` them at ``free``, and give
the top of the heap back once 128 KiB or more of it is free. Each time the memory comes
back it is faulted in again page by page: inside a lockstep run the SmolLM2 learner spent
30% of its CPU in the kernel, at 43 k minor faults a second (``docs/performance.md``).

``keep_freed_memory()`` sets a fixed mmap threshold of 32 MiB (glibc's maximum on 64-bit;
larger blocks are still mapped on their own) and a trim threshold of 2 GiB, so tensors up
to 32 MiB are reused from the heap instead of being faulted in again. The price: the
process keeps up to its peak heap instead of returning it between steps.

glibc only; elsewhere (musl, macOS) it does nothing and says so. Environment variables
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` set by the user win: they are left
alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from common.config import flag

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "host_malloc_flag", "keep_freed_memory", "keep_freed_memory_env"]

log = logging.getLogger("rayless.host_memory")

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc refuses more than HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int

# (environment variable that would set it at start-up, mallopt parameter, value)
_SETTINGS = (
    ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    # glibc only: musl has mallopt but ignores these
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory(who: str = "") -> dict[str, int]:
    """Keep freed blocks up to 32 MiB in this process (see the module doc). Returns what was set.

    Safe to call more than once. Settings already given through the environment are left as
    they are; a refused ``mallopt`` is logged, never raised.
    """
    libc = _libc()
    prefix = f"{who}: " if who else ""
    if libc is None:
        log.info("%snot glibc: malloc left at its defaults", prefix)
        return {}
    done: dict[str, int] = {}
    for env, param, value in _SETTINGS:
        if env in os.environ:
            continue
        if libc.mallopt(param, value) == 1:
            done[env.strip("_").lower()] = value
        else:
            log.warning("%smallopt(%d, %d) refused: malloc keeps its default for %s", prefix, param, value, env)
    if done:
        log.info(
            "%sglibc keeps freed memory: mmap threshold %d MiB, trim threshold %d MiB (--host_malloc default: glibc's own)",
            prefix,
            MMAP_THRESHOLD >> 20,
            TRIM_THRESHOLD >> 20,
        )
    return done


def keep_freed_memory_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The same settings for processes started from here (vLLM's engine core and workers): glibc
    reads ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` when a process starts.
    Sets them in ``env`` (default ``os.environ``) where they are not set; returns what it set."""
    target: MutableMapping[str, str] = os.environ if env is None else env
    if _libc() is None:
        return {}
    added = {name: str(value) for name, _, value in _SETTINGS if name not in target}
    target.update(added)
    return added


def host_malloc_flag(group: str, **kw: Any) -> Any:
    """The trainers' ``--host_malloc`` flag (``learner.runtime.engine.set_host_malloc`` acts on it)."""
    return flag(
        "auto",
        "how glibc treats freed host memory: keep (blocks up to 32 MiB stay in the process instead of being "
        "unmapped and faulted in again every micro-batch; docs/performance.md), default (glibc's own), "
        "auto (keep when training on CPU)",
        choices=("auto", "keep", "default"),
        group=group,
        **kw,
    )
