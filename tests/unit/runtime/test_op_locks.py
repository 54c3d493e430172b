"""A JIT-build lock left by a killed build is removed (it would hang every DeepSpeed start)."""

import os
import time

from learner.runtime.engine import clear_stale_op_locks


def test_stale_lock_removed_fresh_lock_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock"
    for f in (stale, fresh):
        f.parent.mkdir()
        f.touch()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert clear_stale_op_locks(max_age_s=600) == [str(stale)]
    assert not stale.exists() and fresh.exists()  # a build in progress keeps its lock
