"""Code that runs inside vLLM's worker processes (named as vLLM's ``worker_extension_cls``).

vLLM imports this class in every worker before the model loads and before the worker creates
its message queues. Two things happen on the way:

* registering our weight-transfer receivers (``rollout_service.weight_receiver``) puts them
  where the worker's ``load_model`` looks for the engine named by
  ``weight_transfer_config.backend``: this is the one place registration can happen;
* ``shorten_idle_spin``: the rollout server's ``--idle_spin_s``, passed in the environment
  (``IDLE_SPIN_ENV``).
"""

from __future__ import annotations

import inspect
import logging
import os

from rollout_service.config import IDLE_SPIN_ENV
from rollout_service.weight_receiver import register

log = logging.getLogger(__name__)


def shorten_idle_spin(seconds: float | None) -> float | None:
    """After its engine core's last message, a vLLM worker keeps polling its shared-memory queue
    with ``sched_yield`` for ``SpinCondition.busy_loop_s`` (1 s in vLLM 0.32) before it sleeps
    on a socket. While steps come back to back that spin is what makes the next one start at
    once; once generation is over it takes a core for a second, from the learner on a host
    whose cores the roles share (lockstep's training phase on a CPU box). ``seconds`` becomes
    the default of every SpinCondition made after this call: within a generation the worker
    reads far more often than that and still spins. vLLM's constructor is checked first, and
    a vLLM whose SpinCondition looks otherwise is left alone, with a warning. Returns the spin
    in force (None: vLLM's own, untouched)."""
    if seconds is None:
        return None
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError as e:
        log.warning("--idle_spin_s %s ignored: vLLM's SpinCondition is gone (%s)", seconds, e)
        return None
    init = SpinCondition.__init__
    names = [p.name for p in inspect.signature(init).parameters.values() if p.default is not inspect.Parameter.empty]
    if names != ["busy_loop_s"] or init.__defaults__ is None or len(init.__defaults__) != 1:
        log.warning("--idle_spin_s %s ignored: vLLM's SpinCondition takes %s, not (busy_loop_s=...)", seconds, names)
        return None
    init.__defaults__ = (float(seconds),)
    return float(seconds)


def idle_spin_from_env() -> float | None:
    value = os.environ.get(IDLE_SPIN_ENV, "")
    return shorten_idle_spin(float(value)) if value else None


register()
idle_spin_from_env()


class RolloutWorkerExtension:
    """Methods vLLM mixes into its Worker class; callable through ``collective_rpc``."""

    def rayless_weight_transfer_engine(self) -> str:
        """The class name of this worker's weight-transfer engine ("" if none): lets the server
        check at start-up that the backend it asked for is the one that loaded."""
        engine = getattr(self, "weight_transfer_engine", None)
        return type(engine).__name__ if engine is not None else ""

    def rayless_idle_spin_s(self) -> float | None:
        """The idle spin this worker's queues were made with (``shorten_idle_spin``; None: a
        vLLM whose SpinCondition has another shape)."""
        try:
            from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

            (spin,) = SpinCondition.__init__.__defaults__
            return float(spin)
        except (ImportError, TypeError, ValueError):
            return None
