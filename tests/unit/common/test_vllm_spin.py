"""common.vllm_spin: the idle spin of vLLM's workers, which both services' worker extensions
shorten (``rollout_service --idle_spin_s``, ``reward_service --ref_idle_spin_s``)."""

from __future__ import annotations

import subprocess
import sys

from helpers.paths import ROOT

_SPIN_CHECK = r"""
import logging, sys
import zmq
from vllm.distributed.device_communicators import shm_broadcast
from common.vllm_spin import shorten_idle_spin
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
ctx = zmq.Context()
print("before", shm_broadcast.SpinCondition(True, ctx, "ipc:///tmp/rayless-spin-a").busy_loop_s)
print("none", shorten_idle_spin(None), shm_broadcast.SpinCondition.__init__.__defaults__)
print("set", shorten_idle_spin(0.05), shm_broadcast.SpinCondition(True, ctx, "ipc:///tmp/rayless-spin-b").busy_loop_s)
class Other:  # a vLLM whose SpinCondition changed shape
    def __init__(self, is_reader, context, notify_address, busy_loop_s=1, jitter=0): ...
shm_broadcast.SpinCondition = Other
print("other", shorten_idle_spin(0.05), Other.__init__.__defaults__)
"""


def test_idle_spin_becomes_the_default_of_the_workers_queues_or_is_left_alone():
    """shorten_idle_spin (run in a fresh interpreter: it changes vLLM's class): queues made after
    it spin that long; None leaves vLLM's 1 s; a SpinCondition of another shape is left alone
    with a warning."""
    out = subprocess.run(
        [sys.executable, "-c", _SPIN_CHECK], capture_output=True, text=True, timeout=120, cwd=ROOT
    ).stdout.splitlines()
    assert out[:3] == ["before 1", "none None (1,)", "set 0.05 0.05"], out
    assert "idle spin 0.05 s ignored" in out[3] and out[4] == "other None (1, 0)", out
