"""Build a directory aside and rename it into place, safe against concurrent builders.

Used by ``common.tiny`` and ``common.smollm2``: readers never see half a model, and when two
processes build the same directory at once the loser keeps the winner's build. Trainer
checkpoints (``learner.runtime.checkpoint``) are written by several ranks at once, so they build
the directory themselves and only ``commit_dir`` it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def publish_dir(out_dir: Path, build: Callable[[Path], object], is_complete: Callable[[], bool]) -> Path:
    """Runs ``build(tmp)`` into a private directory beside ``out_dir``, then renames it into
    place (an existing ``out_dir`` is moved aside and removed: rename cannot replace a non-empty
    directory). A rename that fails because another builder got there first is fine when
    ``is_complete()`` says so; any other failure is raised."""
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
        commit_dir(tmp, out_dir)
    except OSError:
        if not is_complete():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def commit_dir(tmp: Path, out_dir: Path) -> Path:
    """Renames the finished directory ``tmp`` to ``out_dir`` (same filesystem). An existing
    ``out_dir`` is moved aside first and removed after: rename cannot replace a non-empty
    directory, and a crash in between leaves either the old or the new one under a name a
    reader skips, never a mix. The parent is fsynced so the rename survives a host crash."""
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    try:
        if out_dir.exists():
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        fd = os.open(out_dir.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir
