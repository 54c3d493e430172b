"""vLLM's harmless messages are silenced, and only those: the rotary embeddings' reload warning
(every other module's still shows), and the output handler's EngineDeadError at a clean stop
(the handler is cancelled before the engine stops). The real engine's log is checked in
tests/unit/rollout_service/test_rollout_service.py (its last test)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from common.vllm_quiet import RELOAD_LOGGER, RELOAD_WARNING, quiet_rotary_reload_warning, shutdown_async_llm


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


@pytest.fixture
def reload_log():
    logger = logging.getLogger(RELOAD_LOGGER)
    before = list(logger.filters)
    records = Records()
    logger.addHandler(records)  # on the logger itself: vLLM's own logging config may stop propagation
    yield logger, records
    logger.removeHandler(records)
    logger.filters[:] = before


def test_only_the_rotary_embeddings_reload_warning_is_dropped(reload_log):
    logger, records = reload_log
    quiet_rotary_reload_warning()
    quiet_rotary_reload_warning()  # twice (a second worker extension import): one filter
    assert sum(type(f).__name__ == "RotaryReloadFilter" for f in logger.filters) == 1
    # as vLLM's finalize_layerwise_processing logs it: the format string, the class name apart
    for name in ("RotaryEmbedding", "Llama3RotaryEmbedding", "QKVParallelLinear", "VocabParallelEmbedding"):
        logger.warning(RELOAD_WARNING, name)
    logger.warning("%s: Delayed processing", "RotaryEmbedding")  # another message about it
    assert records.seen == [
        "QKVParallelLinear: Failed to load weights",
        "VocabParallelEmbedding: Failed to load weights",
        "RotaryEmbedding: Delayed processing",
    ]


class FakeAsyncLLM:
    """``AsyncLLM``'s shape at shutdown: an output handler task that logs any error it reads
    (vLLM's logs "AsyncLLM output_handler failed." with the traceback), and a ``shutdown`` that,
    as vLLM's, makes the handler read EngineDeadError when the handler is still there to read it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.failures: list[str] = []
        self.handler_done_at_shutdown: bool | None = None
        self.output_handler = loop.create_task(self._handler())

    async def _handler(self) -> None:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, Exception):
                    raise item
        except Exception as e:  # noqa: BLE001 - as vLLM's handler: logged, with its traceback
            self.failures.append(f"AsyncLLM output_handler failed: {e!r}")

    def shutdown(self) -> None:  # runs in a thread, as the engine's processes are waited for
        self.handler_done_at_shutdown = self.output_handler.done()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, RuntimeError("EngineDeadError"))


def test_the_output_handler_stops_before_the_engine_so_it_reads_no_engine_death():
    async def main():
        llm = FakeAsyncLLM(asyncio.get_running_loop())
        await asyncio.sleep(0)  # the handler is waiting on its queue, as while serving
        await shutdown_async_llm(llm)
        await asyncio.sleep(0.05)  # anything the shutdown queued has had its turn
        return llm

    llm = asyncio.run(main())
    assert llm.handler_done_at_shutdown is True and llm.output_handler.cancelled()
    assert llm.failures == []


def test_an_engine_that_served_nothing_has_no_handler_to_stop():
    class NoRequests:
        output_handler = None
        stopped = False

        def shutdown(self):
            self.stopped = True

    llm = NoRequests()
    asyncio.run(shutdown_async_llm(llm))
    assert llm.stopped
