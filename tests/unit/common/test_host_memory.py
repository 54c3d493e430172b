"""common/host_memory.py: with freed memory kept, a block freed and asked for again comes back
without page faults; with glibc's defaults it is unmapped and faulted in again. Each case runs
in a fresh interpreter, since mallopt changes the process for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.host_memory import MMAP_THRESHOLD, TRIM_THRESHOLD, _libc

pytestmark = pytest.mark.skipif(_libc() is None, reason="glibc only")

# Allocate 16 MiB, touch every page, free it; allocate and touch again: how many pages faulted
# the second time? (16 MiB is above glibc's default mmap threshold and below ours.)
PROBE = r"""
import ctypes, json, resource, sys
from common.host_memory import keep_freed_memory
done = {}
if sys.argv[1] == "keep":
    done = keep_freed_memory("probe")
elif sys.argv[1].startswith("learner:"):  # the learner's --host_malloc MODE
    from learner.runtime.engine import set_host_malloc
    set_host_malloc(sys.argv[1].split(":")[1])
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 16 << 20
def touch_free():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    libc.free(p)
    return after - before
first, second = touch_free(), touch_free()
print(json.dumps({"done": done, "first": first, "second": second, "pages": n // 4096}))
"""


def probe(mode: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kept_memory_comes_back_without_faults_and_glibc_default_faults_again():
    kept = probe("keep")
    assert kept["done"] == {"malloc_mmap_threshold": MMAP_THRESHOLD, "malloc_trim_threshold": TRIM_THRESHOLD}
    assert kept["first"] >= kept["pages"] * 0.9  # the first touch faults every page either way
    assert kept["second"] < kept["pages"] * 0.05, kept

    default = probe("default")
    assert default["second"] >= default["pages"] * 0.9, default  # munmapped, faulted in again


def test_settings_given_in_the_environment_are_left_alone():
    got = probe("keep", MALLOC_MMAP_THRESHOLD_="65536")
    assert got["done"] == {"malloc_trim_threshold": TRIM_THRESHOLD}


@pytest.mark.parametrize("mode, kept", [("auto", True), ("keep", True), ("default", False)])
def test_the_learner_keeps_freed_memory_when_training_on_cpu_unless_told_not_to(mode, kept):
    got = probe(f"learner:{mode}")
    assert (got["second"] < got["pages"] * 0.05) == kept, got


def test_set_host_malloc_rejects_an_unknown_mode():
    from learner.runtime.engine import set_host_malloc

    with pytest.raises(ValueError, match="--host_malloc: 'always' is not auto, keep or default"):
        set_host_malloc("always")


def test_the_environment_for_child_processes_keeps_what_the_user_set():
    from common.host_memory import keep_freed_memory_env

    env = {"MALLOC_TRIM_THRESHOLD_": "0"}
    assert keep_freed_memory_env(env) == {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    assert env == {"MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    # and a child started with it comes back without faults, as one that called mallopt itself
    got = probe("default", MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), MALLOC_TRIM_THRESHOLD_=str(TRIM_THRESHOLD))
    assert got["second"] < got["pages"] * 0.05, got
