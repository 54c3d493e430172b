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
import select
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
    """One forked worker W: its pid and pidfd, and the parent's ends of its four sockets."""

    def __init__(self, pid: int, pidfd: int, streams: dict, uid: int | None, workdir: str) -> None:
        self.pid, self.pidfd = pid, pidfd
        self.ctl_r, self.ctl_w = streams["ctl"]
        self.stdin = streams["stdin"][1]
        self.stdout, self.stderr = streams["stdout"][0], streams["stderr"][0]
        self.writers = [w for _, w in streams.values()]
        self.uid, self.workdir = uid, workdir
        self.child_fd: int | None = None  # pidfd of C: a kill that cannot hit a reused pid
        self.mode = ""

    def exited(self) -> bool:
        return bool(select.select([self.pidfd], [], [], 0)[0])  # a pidfd reads ready once its process is gone


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
        # warm + running + being reaped: at most 2 x workers + a few; 1024 per Sandbox instance
        self._uids = [UID_BASE + ((os.getpid() % 4000) * 16 + n % 16) * 1024 + i for i in range(4 * workers + 8)]
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
        if "workers" not in kw:
            raw = os.environ.get("RAYLESS_SANDBOX_WORKERS", "4")
            try:
                kw["workers"] = int(raw)
            except ValueError:
                raise SandboxError(f"RAYLESS_SANDBOX_WORKERS must be an integer, got {raw!r}") from None
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
        self._tasks: set[asyncio.Task] = set()  # workers starting
        self._reaping: set[asyncio.Task] = set()  # workers done with, being killed and reaped
        self._server: socket.socket | None = None
        self._server_proc: asyncio.subprocess.Process | None = None
        self._server_lock = asyncio.Lock()  # one request / answer at a time on the fork server's socket
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

    async def _fork_server(self) -> socket.socket:
        """The fork server's socket, (re)starting it when it is not running."""
        if self._server is not None and self._server_proc is not None and self._server_proc.returncode is None:
            return self._server
        if self._server is not None:
            self._server.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        base = {"mode": self.isolation, "ro_paths": self.ro_paths, "disk_mb": self.limits.disk_mb}
        base["site_paths"] = self.site_paths
        try:
            self._server_proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", RUNNER, "--ctl", str(theirs.fileno()), json.dumps(base),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )  # fmt: skip
        finally:
            theirs.close()
        ours.setblocking(False)
        self._server = ours
        loop = asyncio.get_running_loop()
        hello = await asyncio.wait_for(loop.sock_recv(ours, 1 << 16), self.start_timeout_s)
        if b"zygote" not in hello:
            raise SandboxError(f"the sandbox's fork server did not start (said {hello[:200]!r})")
        return ours

    async def _fork(self, cfg: dict, fds: list[int]) -> int:
        """Asks the fork server for a worker on ``fds`` (stdin, stdout, stderr, control); its pid."""
        async with self._server_lock:
            for attempt in (1, 2):  # a fork server that died (killed from outside) is restarted once
                server = await self._fork_server()
                try:
                    socket.send_fds(server, [json.dumps(cfg).encode()], fds)
                    answer = await asyncio.wait_for(
                        asyncio.get_running_loop().sock_recv(server, 1 << 16), self.start_timeout_s
                    )
                except (BrokenPipeError, ConnectionResetError):
                    answer = b""
                if answer:
                    msg = json.loads(answer)
                    if "pid" not in msg:
                        raise SandboxError(f"the sandbox's fork server refused: {msg.get('error')}")
                    return msg["pid"]
                if self._server_proc is not None and self._server_proc.returncode is None:
                    self._server_proc.kill()
                    await self._server_proc.wait()
                if attempt == 2:
                    raise SandboxError("the sandbox's fork server exited (see the log above)")
        raise AssertionError("unreachable")

    async def _spawn(self) -> _Worker | str:
        """A started, isolated, waiting worker, or why none could start."""
        if not self._uids:
            return "no free sandbox uid (more live workers than the pool allows)"
        uid = self._uids.pop()
        # process mode's work dir; the namespace modes make a tmpfs of their own
        workdir = tempfile.mkdtemp(prefix="rayless-sandbox-") if self.isolation in ("auto", "process") else ""
        pairs = {name: socket.socketpair() for name in ("stdin", "stdout", "stderr", "ctl")}
        theirs = [pairs[name][1] for name in ("stdin", "stdout", "stderr", "ctl")]
        w: _Worker | None = None
        try:
            try:
                pid = await self._fork(
                    {"uid": uid, "workdir": workdir, "mode": self.isolation}, [t.fileno() for t in theirs]
                )
                pidfd = os.pidfd_open(pid)  # W waits for its code: alive
            finally:
                for t in theirs:
                    t.close()
            streams = {name: await asyncio.open_unix_connection(sock=pairs[name][0]) for name in pairs}
            w = _Worker(pid, pidfd, streams, uid, workdir)
            while not w.mode:
                line = await asyncio.wait_for(w.ctl_r.readline(), self.start_timeout_s)
                if not line:
                    raise EOFError("its control socket closed")
                msg = json.loads(line)
                if "child" in msg:
                    w.child_fd = os.pidfd_open(msg["child"])  # C is alive: it waits for its request
                elif "ready" in msg:
                    w.mode = msg["ready"]
                elif "error" in msg:
                    raise SandboxError(msg["error"])
        except (TimeoutError, EOFError, OSError, ValueError, SandboxError) as e:
            why = str(e) if isinstance(e, SandboxError) else f"{type(e).__name__}: {e}"
            if w is None:
                for ours, _ in pairs.values():
                    ours.close()
                self._release(uid, workdir)
                return why
            err = ""
            try:
                err = (await asyncio.wait_for(w.stderr.read(4096), 0.5)).decode(errors="replace").strip()
            except (TimeoutError, OSError):
                pass
            await self._discard(w)
            return f"{why}{': ' + err[-500:] if err else ''}"
        except BaseException:  # cancelled (the sandbox is closing): leave nothing behind
            if w is not None:
                await asyncio.shield(self._discard(w))
            else:
                for ours, _ in pairs.values():
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
            if not w.exited():
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
            finally:  # in the background: the result need not wait for the reaping
                task = asyncio.ensure_future(self._discard(w))
                self._reaping.add(task)
                task.add_done_callback(self._reaping.discard)

    async def _call(self, w: _Worker, code: str, stdin: bytes, lim: SandboxLimits) -> SandboxResult:
        req = {"code": code, "cpu_s": lim.cpu_s, "memory_mb": lim.memory_mb, "max_procs": lim.max_procs}
        req |= {"file_mb": lim.file_mb, "open_files": lim.open_files}
        out = {"stdout": bytearray(), "stderr": bytearray()}
        over = asyncio.Event()
        t0 = time.monotonic()

        async def feed() -> None:
            try:
                if stdin:
                    w.stdin.write(stdin)
                    await w.stdin.drain()
                w.stdin.write_eof()  # its stdin ends here
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass  # the code exited without reading all of it

        async def drain(name: str, stream) -> None:
            while chunk := await stream.read(1 << 16):
                room = lim.max_output_bytes - len(out["stdout"]) - len(out["stderr"])
                out[name] += chunk[: max(room, 0)]
                if len(chunk) > room:
                    over.set()
                    return

        async def status() -> dict:
            while line := await w.ctl_r.readline():
                msg = json.loads(line)
                if "exit" in msg or "signal" in msg:
                    return msg
            return {}

        w.ctl_w.write((json.dumps(req) + "\n").encode())
        feeding = asyncio.ensure_future(feed())
        readers = [asyncio.ensure_future(drain(n, getattr(w, n))) for n in ("stdout", "stderr")]
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
        if not w.exited():  # while W lives its group id cannot be another's
            try:
                os.killpg(w.pid, signal.SIGKILL)  # W and, in process mode, what stayed in its group
            except OSError:
                pass

    async def _discard(self, w: _Worker) -> None:
        """Kills the worker and waits for it to be gone (the fork server reaps it); frees its uid and dir."""
        self._kill(w)
        for writer in w.writers:
            writer.close()
        if w.child_fd is not None:
            os.close(w.child_fd)
            w.child_fd = None
        if not w.exited():
            loop = asyncio.get_running_loop()
            gone = loop.create_future()

            def on_exit() -> None:
                if not gone.done():
                    gone.set_result(None)

            loop.add_reader(w.pidfd, on_exit)
            try:
                await asyncio.wait_for(gone, 5)
            except TimeoutError:
                log.warning("sandbox worker %d did not exit after SIGKILL", w.pid)
            finally:
                loop.remove_reader(w.pidfd)
        os.close(w.pidfd)
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
        await asyncio.gather(*self._tasks, *self._reaping, return_exceptions=True)
        while not self._warm.empty():
            await self._discard(self._warm.get_nowait())
        if self._server is not None:
            self._server.close()  # the fork server exits when its socket closes
        if self._server_proc is not None:
            try:
                await asyncio.wait_for(self._server_proc.wait(), 5)
            except TimeoutError:
                self._server_proc.kill()
                await self._server_proc.wait()


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
