"""Build a directory aside and rename it into place, safe against concurrent builders.

Used by ``common.tiny`` and ``common.smollm2``: readers never see half a model, and when two
processes build the same directory at once the loser keeps the winner's build.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def publish_dir(out_dir: Path, build: Callable[[Path], None], is_complete: Callable[[], bool]) -> Path:
    """Runs ``build(tmp)`` into a private directory beside ``out_dir``, then renames it into
    place (an existing ``out_dir`` is moved aside and removed: rename cannot replace a non-empty
    directory). A rename that fails because another builder got there first is fine when
    ``is_complete()`` says so; any other failure is raised."""
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
        if out_dir.exists():
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
    except OSError:
        if not is_complete():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir
