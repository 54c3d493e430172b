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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_WARNING = "%s: Failed to load weights"  # the call's format string, before its argument


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


async def shutdown_async_llm(llm: Any) -> None:
    """Stops an ``AsyncLLM``: its output handler first (a task on this loop), then the engine
    (in a thread: it waits for the engine's processes)."""
    handler = getattr(llm, "output_handler", None)  # None until the first request
    if handler is not None and not handler.done():
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)  # its end, whatever it was: not ours to raise
    await asyncio.to_thread(llm.shutdown)
