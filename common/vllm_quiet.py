"""vLLM's messages that read as faults and are not, silenced where they start.

* ``quiet_rotary_reload_warning()`` (in vLLM's worker processes, ``rollout_service.worker_ext``):
  every weight push logs ``RotaryEmbedding: Failed to load weights`` once per attention layer
  (301 times in one demo). A rotary embedding has no weights, only its ``cos_sin_cache``
  buffer, computed from the config; vLLM's layerwise reload (vLLM 0.32:
  ``model_loader/reload/layerwise.py``, ``finalize_layerwise_processing``) counts buffers as
  loadable, warns for a module none of whose "weights" arrived -- which for a buffer-only
  module is every push -- and puts its buffers back as they were. Only that message, for
  rotary embeddings (every variant's class name ends so), is dropped: the same warning for any
  other module still means a weight the push did not carry.
* ``shutdown_async_llm(llm)`` (the rollout server's last step): ``AsyncLLM.shutdown`` stops the
  engine core first and cancels its own output handler after; the handler, still reading, gets
  ``EngineDeadError`` and logs it as a failure with its traceback after every clean stop. The
  handler is cancelled first here, then the engine stopped.
* ``allow_engine_exit_time()`` (before the engine starts) and ``shutdown_async_llm``'s timeout:
  vLLM gives its engine's processes 5 s to exit, then logs ``[shutdown] Process manager: force
  killing remaining process EngineCore`` (and ``force killing sub process VLLM::Worker``), and the
  killed EngineCore's shared memory is reported by the resource tracker as ``leaked
  shared_memory``. Nothing hangs: on a loaded CPU host the processes just need longer than that
  to end. Each one's exit is mostly the interpreter's finalization collecting and freeing the
  whole heap (torch, vLLM, the model: ~700 k objects, which vLLM unfreezes at shutdown,
  ``gc.unfreeze()`` in ``Worker.shutdown`` and ``EngineCore.shutdown``), and the EngineCore
  begins its own only after its worker's has ended: measured on a 2-core host under a load of
  7, the worker took 9 s, the EngineCore 9 s more. (Not the worker's gloo weight group: a
  server that never formed one was killed the same way.) So the
  deadlines are lengthened, not the messages hidden: a worker gets ``WORKER_EXIT_S`` (vLLM's
  ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, unless the user set it), the EngineCore that plus
  ``ENGINE_EXIT_MARGIN_S`` (the front end's wait, ``AsyncLLM.shutdown(timeout)``); an engine that
  really hangs is still killed, later. (vLLM's own fix for the same walk, ``gc.freeze()`` before
  exiting, which it applies on ROCm only, would make the exit fast but makes triton's nanobind
  module print hundreds of "leaked" lines at exit instead.)
* ``shutdown_async_llm`` also spares an EngineCore that is already stopping the SIGTERM
  ``AsyncLLM.shutdown`` sends it. A launcher signals the server's whole process group
  (launch.local, Slurm, systemd): the EngineCore gets that SIGTERM too, and vLLM's
  ``run_engine_core`` restores SIGTERM's default action before its teardown, so the front end's
  own SIGTERM, arriving during that teardown, killed it half-way: no message, but its shared
  memory was never unlinked (``leaked shared_memory`` again). An EngineCore whose SIGTERM
  handler is gone (``/proc/PID/status``, read just before the signal would be sent) is on its
  way out: it is waited for, not signalled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

log = logging.getLogger(__name__)

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_WARNING = "%s: Failed to load weights"  # the call's format string, before its argument
WORKER_EXIT_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"  # read by the EngineCore, for its workers
WORKER_EXIT_S = 15  # vLLM's default is 5: less than a worker's exit on a busy CPU host
ENGINE_EXIT_MARGIN_S = 10.0  # the EngineCore's own teardown and exit, after its workers'


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's reload warning for a rotary embedding (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        rotary = len(args) == 1 and str(args[0]).endswith("RotaryEmbedding")
        return not (record.msg == RELOAD_WARNING and rotary)


def quiet_rotary_reload_warning() -> None:
    """Installs ``RotaryReloadFilter`` on vLLM's reload logger (once; imports nothing of vLLM)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(RotaryReloadFilter())


def allow_engine_exit_time() -> None:
    """Gives the workers of engines started after this call ``WORKER_EXIT_S`` to exit at
    shutdown, unless ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` is set (the EngineCore reads it from
    the environment it inherits)."""
    os.environ.setdefault(WORKER_EXIT_ENV, str(WORKER_EXIT_S))


def engine_exit_s() -> float:
    """How long the front end waits for the EngineCore to exit before killing it: its workers'
    time (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``) and its own."""
    try:
        workers = float(os.environ.get(WORKER_EXIT_ENV, WORKER_EXIT_S))
    except ValueError:
        workers = WORKER_EXIT_S
    return workers + ENGINE_EXIT_MARGIN_S


def catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM: False once it has exited or restored
    the default action; True where ``/proc`` cannot tell (then it is signalled as vLLM would)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except FileNotFoundError:
        return not os.path.exists("/proc/self/status")  # gone, unless there is no /proc at all
    except (OSError, ValueError, IndexError):
        pass
    return True


def spare_stopping_engines(llm: Any) -> None:
    """Makes ``AsyncLLM.shutdown``'s SIGTERM skip an EngineCore that is already stopping (see the
    module docstring): each EngineCore process's ``terminate`` first asks ``catches_sigterm``.
    Nothing changes where vLLM keeps its processes elsewhere."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    for proc in getattr(manager, "processes", None) or []:
        send = proc.terminate

        def terminate(proc: Any = proc, send: Any = send) -> None:
            if proc.pid is None or catches_sigterm(proc.pid):
                send()
            else:
                log.info("%s (pid %d) is stopping already (a signal of its own): waiting for it", proc.name, proc.pid)

        proc.terminate = terminate


async def shutdown_async_llm(llm: Any) -> None:
    """Stops an ``AsyncLLM``: its output handler first (a task on this loop), then the engine
    (in a thread: it waits up to ``engine_exit_s()`` for the engine's processes to exit), not
    signalling an EngineCore that is stopping already (``spare_stopping_engines``)."""
    handler = getattr(llm, "output_handler", None)  # None until the first request
    if handler is not None and not handler.done():
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)  # its end, whatever it was: not ours to raise
    spare_stopping_engines(llm)
    await asyncio.to_thread(llm.shutdown, timeout=engine_exit_s())
