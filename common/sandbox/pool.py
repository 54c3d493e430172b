"""``Sandbox``: runs untrusted code in fresh, isolated, limited processes, ``workers`` kept warm.

    from common.sandbox import Sandbox, SandboxLimits

    sandbox = Sandbox(workers=4, limits=SandboxLimits(wall_s=5, memory_mb=256))
    result = await sandbox.run("print(input()[::-1])", stdin="abc")   # from any event loop
    result = sandbox.run_sync("print(1 + 1)")                           # from plain code
    result.stdout, result.reason, result.exit_code                      # "2\\n", "ok", 0
    sandbox.close()

Each call gets its own process (``runner.py``) in its own namespaces and work dir; the process
is started, isolated and waiting *before* the call (a warm worker), so a call costs a message
and the code's own run. ``workers`` calls run at once; each call that takes a warm worker starts
its replacement at once. The subprocess plumbing runs on the sandbox's own event-loop thread:
a caller's loop (a rollout server's, an environment worker's) only awaits a future.

A call's failure (timeout, memory, a fork bomb, too much output, an exception) is its result's
``reason``, never an exception; ``SandboxError`` is raised only for a misuse (bad arguments) or
when no worker can start at all (at construction).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from common.sandbox.result import SandboxLimits, SandboxResult

log = logging.getLogger(__name__)

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runner.py")
RC_PROCS, RC_MEMORY, RC_SETUP = 248, 249, 250  # runner.py's own exit codes
ISOLATION_MODES = ("auto", "namespaces", "namespaces-root", "namespaces-user", "process")
LANGUAGES = ("python",)  # a language is a runner; others (a compiler, then the binary) go here
UID_BASE = 1_000_000  # root: each live worker runs as its own uid above this (RLIMIT_NPROC is per uid)
_instances = itertools.count()


class SandboxError(RuntimeError):
    """The sandbox cannot be used as asked (bad arguments, no worker could start)."""


def default_ro_paths() -> list[str]:
    """What the code may read: the system's programs and libraries and the interpreter's files."""
    paths = ["/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/localtime"]
    exe_prefix = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, exe_prefix):
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q != "/" and q not in paths:
                paths.append(q)
    return paths


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process, reader, writer, uid: int | None, workdir: str) -> None:
        self.proc, self.reader, self.writer = proc, reader, writer
        self.uid, self.workdir = uid, workdir
        self.child_fd: int | None = None  # pidfd of C: a kill that cannot hit a reused pid
        self.mode = ""


class Sandbox:
    """A pool of warm sandbox workers (see the module docstring). Thread-safe; close() when done."""

    def __init__(
        self,
        workers: int = 4,
        limits: SandboxLimits | None = None,
        *,
        language: str = "python",
        isolation: str = "auto",
        ro_paths: Sequence[str] | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        if not isinstance(workers, int) or not 1 <= workers <= 100:
            raise SandboxError(f"Sandbox workers must be an int in 1..100, got {workers!r}")
        if language not in LANGUAGES:
            raise SandboxError(f"Sandbox language {language!r} is not supported; supported: {list(LANGUAGES)}")
        if isolation not in ISOLATION_MODES:
            raise SandboxError(f"Sandbox isolation {isolation!r} unknown; choose one of {list(ISOLATION_MODES)}")
        if isolation == "namespaces":
            isolation = "namespaces-root" if os.geteuid() == 0 else "namespaces-user"
        self.workers = workers
        self.limits = limits or SandboxLimits()
        self.language = language
        self.ro_paths = list(ro_paths) if ro_paths is not None else default_ro_paths()
        self.start_timeout_s = start_timeout_s
        self.site_paths = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
        self.isolation = isolation  # resolved by the first worker when "auto"
        n = next(_instances)
        self._uids = [UID_BASE + ((os.getpid() % 4000) * 16 + n % 16) * 256 + i for i in range(2 * workers + 2)]
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-loop", daemon=True)
        self._thread.start()
        try:
            self._submit(self._start()).result()
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    @classmethod
    def from_env(cls, **kw) -> Sandbox:
        """A sandbox sized by the environment the reward service sets for its function workers
        (``RAYLESS_SANDBOX_WORKERS``, from ``--sandbox_workers``); keyword arguments override."""
        kw.setdefault("workers", int(os.environ.get("RAYLESS_SANDBOX_WORKERS", "4")))
        return cls(**kw)

    # ------------------------------------------------------------------ public API
    async def run(
        self, code: str, *, stdin: str | bytes = "", timeout_s: float | None = None, limits: SandboxLimits | None = None
    ) -> SandboxResult:
        """Runs ``code`` (Python source) as ``__main__`` in a fresh sandbox; ``timeout_s`` is the
        call's wall-time limit (default ``limits.wall_s``)."""
        return await asyncio.wrap_future(self._submit(self._run(code, stdin, self._limits(limits, timeout_s))))

    def run_sync(
        self, code: str, *, stdin: str | bytes = "", timeout_s: float | None = None, limits: SandboxLimits | None = None
    ) -> SandboxResult:
        """``run`` for plain (non-async) code such as a ``reward_func``."""
        return self._submit(self._run(code, stdin, self._limits(limits, timeout_s))).result()

    def run_many_sync(
        self,
        calls: Sequence[tuple[str, str | bytes] | tuple[str, str | bytes, SandboxLimits]],
        *,
        timeout_s: float | None = None,
        limits: SandboxLimits | None = None,
    ) -> list[SandboxResult]:
        """``(code, stdin)`` or ``(code, stdin, limits)`` calls run concurrently (``workers`` at a
        time); results in order."""
        default = self._limits(limits, timeout_s)

        async def all_calls() -> list[SandboxResult]:
            return list(await asyncio.gather(*(self._run(c[0], c[1], c[2] if len(c) > 2 else default) for c in calls)))

        return self._submit(all_calls()).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            try:
                self._submit(self._stop()).result(10)
            except Exception as e:  # noqa: BLE001 - closing is best effort; say what was left
                log.warning("sandbox close: %s", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals (sandbox loop)
    def _submit(self, coro) -> Future:
        if self._closed and not coro.cr_code.co_name == "_stop":
            coro.close()
            raise SandboxError("this Sandbox is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _limits(self, limits: SandboxLimits | None, timeout_s: float | None) -> SandboxLimits:
        lim = limits or self.limits
        return lim.replace(wall_s=timeout_s) if timeout_s is not None else lim

    async def _start(self) -> None:
        self._warm: asyncio.Queue[_Worker] = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.workers)
        self._spawning = 0
        self._tasks: set[asyncio.Task] = set()
        first = await self._spawn()  # resolves "auto": every later worker uses the same mode
        if isinstance(first, str):
            raise SandboxError(f"no sandbox worker could start: {first}")
        self.isolation = first.mode
        log.info("sandbox: %d warm worker(s), isolation %s", self.workers, self.isolation)
        self._warm.put_nowait(first)
        self._refill()

    def _refill(self) -> None:
        while not self._closed and self._warm.qsize() + self._spawning < self.workers:
            self._spawning += 1
            task = asyncio.ensure_future(self._spawn_into_queue())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _spawn_into_queue(self) -> None:
        try:
            w = await self._spawn()
        finally:
            self._spawning -= 1
        if isinstance(w, str):
            log.warning("sandbox worker failed to start: %s", w)
            await asyncio.sleep(1.0)  # do not spin on a host that refuses every start
            self._refill()
        elif self._closed:
            await self._discard(w)
        else:
            self._warm.put_nowait(w)

    async def _spawn(self) -> _Worker | str:
        """A started, isolated, waiting worker, or why none could start."""
        if not self._uids:
            return "no free sandbox uid (more live workers than the pool allows)"
        uid = self._uids.pop()
        # process mode's work dir; the namespace modes make a tmpfs of their own
        workdir = tempfile.mkdtemp(prefix="rayless-sandbox-") if self.isolation in ("auto", "process") else ""
        cfg = {"mode": self.isolation, "uid": uid, "ro_paths": self.ro_paths, "workdir": workdir}
        cfg |= {"disk_mb": self.limits.disk_mb, "site_paths": self.site_paths}
        ours, theirs = socket.socketpair()
        w: _Worker | None = None
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-I", "-S", RUNNER, "--ctl", str(theirs.fileno()), json.dumps(cfg),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    pass_fds=(theirs.fileno(),), start_new_session=True,  # its own process group: killed whole
                )  # fmt: skip
            finally:
                theirs.close()
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            w = _Worker(proc, reader, writer, uid, workdir)
            while not w.mode:
                line = await asyncio.wait_for(reader.readline(), self.start_timeout_s)
                if not line:
                    raise EOFError
                msg = json.loads(line)
                if "child" in msg:
                    w.child_fd = os.pidfd_open(msg["child"])  # C is alive: it waits for its request
                elif "ready" in msg:
                    w.mode = msg["ready"]
                elif "error" in msg:
                    raise SandboxError(msg["error"])
        except (TimeoutError, EOFError, OSError, ValueError, SandboxError) as e:
            if w is None:
                ours.close()
                self._release(uid, workdir)
                return f"{type(e).__name__}: {e}"
            await self._discard(w)
            err = (await w.proc.stderr.read()).decode(errors="replace").strip() if w.proc.stderr else ""
            why = str(e) if isinstance(e, SandboxError) else f"{type(e).__name__} {e}".strip()
            return f"{why} (worker exit code {w.proc.returncode}){': ' + err[-500:] if err else ''}"
        except BaseException:  # cancelled (the sandbox is closing): leave nothing behind
            if w is not None:
                await asyncio.shield(self._discard(w))
            else:
                ours.close()
                self._release(uid, workdir)
            raise
        if w.mode != "process" and workdir:
            shutil.rmtree(workdir, ignore_errors=True)
            w.workdir = ""
        return w

    async def _take(self) -> _Worker | str:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            self._refill()
            try:
                w = await asyncio.wait_for(self._warm.get(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return f"no warm sandbox worker within {self.start_timeout_s:g} s"
            self._refill()  # its replacement starts now, while this call runs
            if w.proc.returncode is None:
                return w
            await self._discard(w)  # died while waiting (killed from outside): take another

    async def _run(self, code: str, stdin: str | bytes, lim: SandboxLimits) -> SandboxResult:
        if not isinstance(code, str):
            raise SandboxError(f"code must be a str, got {type(code).__name__}")
        t0 = time.monotonic()
        async with self._slots:
            w = await self._take()
            if isinstance(w, str):
                return SandboxResult("", "", None, "sandbox_error", w, time.monotonic() - t0)
            try:
                return await self._call(w, code, stdin.encode() if isinstance(stdin, str) else stdin, lim)
            finally:
                await self._discard(w)

    async def _call(self, w: _Worker, code: str, stdin: bytes, lim: SandboxLimits) -> SandboxResult:
        req = {"code": code, "cpu_s": lim.cpu_s, "memory_mb": lim.memory_mb, "max_procs": lim.max_procs}
        req |= {"file_mb": lim.file_mb, "open_files": lim.open_files}
        out = {"stdout": bytearray(), "stderr": bytearray()}
        over = asyncio.Event()
        t0 = time.monotonic()

        async def feed() -> None:
            assert w.proc.stdin is not None
            try:
                if stdin:
                    w.proc.stdin.write(stdin)
                    await w.proc.stdin.drain()
                w.proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the code exited without reading all of it

        async def drain(name: str, stream) -> None:
            while chunk := await stream.read(1 << 16):
                room = lim.max_output_bytes - len(out["stdout"]) - len(out["stderr"])
                out[name] += chunk[: max(room, 0)]
                if len(chunk) > room:
                    over.set()
                    return

        async def status() -> dict:
            while line := await w.reader.readline():
                msg = json.loads(line)
                if "exit" in msg or "signal" in msg:
                    return msg
            return {}

        w.writer.write((json.dumps(req) + "\n").encode())
        feeding = asyncio.ensure_future(feed())
        readers = [asyncio.ensure_future(drain(n, getattr(w.proc, n))) for n in ("stdout", "stderr")]
        ended = asyncio.ensure_future(status())
        overflow = asyncio.ensure_future(over.wait())
        done, _ = await asyncio.wait({ended, overflow}, timeout=lim.wall_s, return_when=asyncio.FIRST_COMPLETED)
        killed = "" if ended in done else ("output_limit" if overflow in done else "timeout")
        if killed:
            self._kill(w)
        try:  # the rest of its output: the pipes close when its last process is gone
            await asyncio.wait_for(asyncio.gather(*readers), 2.0)
        except TimeoutError:  # process mode: a process that left the group still holds a pipe
            self._kill(w)
        end = await ended if ended.done() else {}
        for t in (feeding, overflow, ended, *readers):
            t.cancel()
        wall = time.monotonic() - t0
        result = SandboxResult(
            stdout=out["stdout"].decode(errors="replace"),
            stderr=out["stderr"].decode(errors="replace"),
            exit_code=end.get("exit"),
            reason="ok",
            message="",
            wall_s=wall,
            cpu_s=end.get("cpu_s"),
            max_rss_mb=end.get("rss_mb"),
            truncated=over.is_set(),
            isolation=w.mode,
        )
        result.reason, result.message = _verdict(killed or over.is_set() and "output_limit", end, lim, wall)
        return result

    def _kill(self, w: _Worker) -> None:
        if w.child_fd is not None:
            try:  # PID 1 of its namespace: the kernel kills every process in it
                signal.pidfd_send_signal(w.child_fd, signal.SIGKILL)
            except OSError:
                pass  # already gone
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)  # W and, in process mode, what stayed in the group
        except OSError:
            pass

    async def _discard(self, w: _Worker) -> None:
        """Kills and reaps the worker; frees its uid and work dir."""
        self._kill(w)
        w.writer.close()
        if w.child_fd is not None:
            os.close(w.child_fd)
            w.child_fd = None
        try:
            await asyncio.wait_for(w.proc.wait(), 5)
        except TimeoutError:
            log.warning("sandbox worker %d did not exit after SIGKILL", w.proc.pid)
        self._release(w.uid, w.workdir)
        w.uid, w.workdir = None, ""

    def _release(self, uid: int | None, workdir: str) -> None:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            self._uids.append(uid)

    async def _stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while not self._warm.empty():
            await self._discard(self._warm.get_nowait())


def _verdict(killed: str | bool, end: dict, lim: SandboxLimits, wall: float) -> tuple[str, str]:
    if killed == "timeout":
        return "timeout", f"killed after {lim.wall_s:g} s wall time (the limit)"
    if killed == "output_limit":
        return "output_limit", f"killed: wrote more than {lim.max_output_bytes} bytes to stdout + stderr"
    sig, code = end.get("signal"), end.get("exit")
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and (end.get("cpu_s") or 0) >= int(lim.cpu_s)):
        return "cpu_time", f"stopped at its CPU-time limit ({lim.cpu_s:g} s)"
    if sig == signal.SIGXFSZ:
        return "file_size", f"stopped: wrote a file larger than {lim.file_mb} MiB"
    if sig is not None:
        return "signal", f"killed by signal {signal.Signals(sig).name}"
    if code == RC_MEMORY:
        return "memory", f"ran out of memory at its limit ({lim.memory_mb} MiB)"
    if code == RC_PROCS:
        return "processes", f"could not start a process or thread: its limit is {lim.max_procs}"
    if code == 0:
        return "ok", f"exited 0 in {wall:.2f} s"
    if code is None:
        return "sandbox_error", "the sandbox worker ended without reporting (killed from outside?)"
    return "exit", f"exited with code {code}"
