"""vLLM's harmless messages are silenced, and only those: the rotary embeddings' reload warning
(every other module's still shows), the output handler's EngineDeadError at a clean stop
(the handler is cancelled before the engine stops); and no engine process is killed at a clean
stop: neither one still exiting (they get the time it takes) nor an EngineCore already on its
way out (the front end's SIGTERM killed it half-way). The real engine's log is checked in
tests/unit/rollout_service/test_rollout_service.py (its shutdown and SIGTERM tests)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from common.vllm_quiet import (
    ENGINE_EXIT_MARGIN_S,
    RELOAD_LOGGER,
    RELOAD_WARNING,
    WORKER_EXIT_ENV,
    WORKER_EXIT_S,
    allow_engine_exit_time,
    catches_sigterm,
    engine_exit_s,
    quiet_rotary_reload_warning,
    shutdown_async_llm,
    spare_stopping_engines,
)


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

    def shutdown(self, timeout: float | None = None) -> None:  # in a thread: the engine's processes are waited for
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

        def shutdown(self, timeout=None):
            self.stopped = timeout

    llm = NoRequests()
    asyncio.run(shutdown_async_llm(llm))
    assert llm.stopped == engine_exit_s()


CHILD = (
    "import signal, sys, time\n"
    "if sys.argv[1] == 'handler':  # a running EngineCore: vLLM's handler starts its shutdown\n"
    "    signal.signal(signal.SIGTERM, lambda *a: print('handled', flush=True))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


class EngineProc:
    """What ``spare_stopping_engines`` sees of an EngineCore: a multiprocessing Process's
    ``pid``, ``name`` and ``terminate``, here on a real child process."""

    def __init__(self, disposition: str) -> None:
        import subprocess
        import sys

        self.child = subprocess.Popen([sys.executable, "-c", CHILD, disposition], stdout=subprocess.PIPE, text=True)
        assert self.child.stdout.readline().strip() == "ready"
        self.pid, self.name, self.sent = self.child.pid, f"EngineCore-{disposition}", 0

    def terminate(self) -> None:
        self.sent += 1
        os.kill(self.pid, signal.SIGTERM)


def test_an_engine_core_stopping_of_its_own_accord_is_not_signalled_again():
    """A launcher's SIGTERM to the process group reaches the EngineCore too; vLLM then restores
    SIGTERM's default action for its teardown, and AsyncLLM.shutdown's own SIGTERM used to kill
    it half-way (its shared memory leaked). An EngineCore without a SIGTERM handler is spared
    that signal; one with its handler (running: shut down by this SIGTERM) still gets it."""
    running, stopping = EngineProc("handler"), EngineProc("default")
    try:
        assert catches_sigterm(running.pid) and not catches_sigterm(stopping.pid)
        llm = type("LLM", (), {})()
        llm.engine_core = type("Client", (), {})()
        llm.engine_core.resources = type("Resources", (), {})()
        llm.engine_core.resources.engine_manager = type("Manager", (), {"processes": [running, stopping]})()
        spare_stopping_engines(llm)
        for proc in (running, stopping):
            proc.terminate()  # as vLLM's process manager calls it
        assert running.sent == 1 and running.child.stdout.readline().strip() == "handled"
        assert stopping.sent == 0 and stopping.child.poll() is None  # not killed: left to end by itself
    finally:
        for proc in (running, stopping):
            proc.child.kill()
            proc.child.wait(10)
    assert not catches_sigterm(stopping.pid)  # gone (reaped): nothing to signal either


def test_the_engines_processes_get_the_time_their_exit_takes(monkeypatch):
    """vLLM gives its EngineCore 5 s to exit, and each worker 5 s, then kills them (and the
    killed EngineCore's shared memory is reported leaked): less than a CPU engine's exit on a
    busy host. A worker gets WORKER_EXIT_S (unless the user set vLLM's variable), the EngineCore
    that and its own margin, passed to AsyncLLM.shutdown."""
    monkeypatch.delenv(WORKER_EXIT_ENV, raising=False)
    allow_engine_exit_time()
    assert os.environ[WORKER_EXIT_ENV] == str(WORKER_EXIT_S) and WORKER_EXIT_S > 5
    assert engine_exit_s() == WORKER_EXIT_S + ENGINE_EXIT_MARGIN_S
    monkeypatch.setenv(WORKER_EXIT_ENV, "40")  # the user's own: kept, and the EngineCore waited for longer
    allow_engine_exit_time()
    assert os.environ[WORKER_EXIT_ENV] == "40" and engine_exit_s() == 40 + ENGINE_EXIT_MARGIN_S
