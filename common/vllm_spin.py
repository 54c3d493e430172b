"""vLLM's idle spin: how long a worker keeps polling its queue after its last step.

After its engine core's last message, a vLLM worker keeps polling its shared-memory queue with
``sched_yield`` for ``SpinCondition.busy_loop_s`` (1 s in vLLM 0.32) before it sleeps on a
socket. While steps come back to back that spin is what makes the next one start at once;
once a phase of work is over it takes a core for a second, from the learner on a host whose
cores the roles share (lockstep's training phase on a CPU box, ``launch.local --cpu_cores
phases``). Both services that run vLLM shorten it the same way, from the module their
``worker_extension_cls`` names (imported in every worker before its queues exist):
``rollout_service.worker_ext`` (``--idle_spin_s``) and ``reward_service.ref_worker_ext``
(``--ref_backend vllm``'s ``--ref_idle_spin_s``). The value travels in ``IDLE_SPIN_ENV``, set
by the service from its flag or by a launcher for every service.

Imports nothing at module level beyond the standard library: the services' configs read
``IDLE_SPIN_ENV`` before vLLM is imported.
"""

from __future__ import annotations

import inspect
import logging
import os

__all__ = ["IDLE_SPIN_ENV", "shorten_idle_spin", "idle_spin_from_env", "idle_spin_in_force"]

log = logging.getLogger(__name__)

IDLE_SPIN_ENV = "RAYLESS_VLLM_IDLE_SPIN_S"


def shorten_idle_spin(seconds: float | None) -> float | None:
    """Makes ``seconds`` the default spin of every SpinCondition created after this call (within
    a generation the worker reads far more often than that, so it still spins there). vLLM's
    constructor is checked first, and a vLLM whose SpinCondition looks otherwise is left alone,
    with a warning. Returns the spin in force (None: vLLM's own, untouched)."""
    if seconds is None:
        return None
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError as e:
        log.warning("idle spin %s s ignored: vLLM's SpinCondition is gone (%s)", seconds, e)
        return None
    init = SpinCondition.__init__
    names = [p.name for p in inspect.signature(init).parameters.values() if p.default is not inspect.Parameter.empty]
    if names != ["busy_loop_s"] or init.__defaults__ is None or len(init.__defaults__) != 1:
        log.warning("idle spin %s s ignored: vLLM's SpinCondition takes %s, not (busy_loop_s=...)", seconds, names)
        return None
    init.__defaults__ = (float(seconds),)
    return float(seconds)


def idle_spin_from_env() -> float | None:
    """``shorten_idle_spin`` with ``IDLE_SPIN_ENV``'s value, if set (a worker extension's import)."""
    value = os.environ.get(IDLE_SPIN_ENV, "")
    return shorten_idle_spin(float(value)) if value else None


def idle_spin_in_force() -> float | None:
    """The spin this process's queues are made with (None: a vLLM whose SpinCondition has
    another shape). A worker extension's answer to ``collective_rpc("rayless_idle_spin_s")``."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        (spin,) = SpinCondition.__init__.__defaults__
        return float(spin)
    except (ImportError, TypeError, ValueError):
        return None
