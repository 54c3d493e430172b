"""Function rewards: a user's ``reward_func`` run in worker processes, with a deadline.

The contract is OpenRLHF's ``--remote_rm_url file.py``, so existing reward files work::

    def reward_func(queries, prompts, labels, **kw):
        # queries: list[str], prompt + response text; prompts: list[str]; labels: list (None if none)
        return rewards                      # (N,) list / tensor / array
        # or {"rewards": (N,), "scores": (N,), "extra_logs": {"name": (N,)}}

OpenRLHF calls it with the three positional arguments; here it may also take, by name,
any of ``responses`` (the response text alone), ``prompt_ids``, ``sample_indices``,
``finish_reasons``: they are passed only when its signature asks for them (or has ``**kw``).

Each of ``--func_workers`` workers is a child process (``func_worker.py``); a batch is split
into contiguous slices, one per worker, run in parallel. A call that raises, returns a bad
shape, or runs past ``--timeout_s`` fails the samples of its slice with the reason; a worker
that hung or died is killed and restarted for the next call. The service never waits on
user code without a deadline.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import msgspec

from common.child_process import stop as stop_process
from reward_service import func_worker
from reward_service.results import SourceResult, from_raw

log = logging.getLogger(__name__)

KWARGS = ("responses", "prompt_ids", "sample_indices", "finish_reasons")


class FuncLoadError(RuntimeError):
    """The reward file cannot be used; the message names the file and what is wrong."""


class CallFailed(RuntimeError):
    pass


class FuncWorker:
    """One child process running ``reward_func`` from ``path``. Not thread-safe: one caller."""

    def __init__(self, path: str, *, start_timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        self.path = os.path.abspath(path)
        self.start_timeout_s = start_timeout_s
        self.env = {**os.environ, **env} if env else None  # None: the service's own
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.restarts = -1  # the first start is not a restart
        self._tracebacks_logged = 0
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()

    def start(self) -> None:
        """Starts the child and waits until it has loaded the file; raises FuncLoadError."""
        self.stop()
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, func_worker.__file__, "--fd", str(theirs.fileno()), self.path],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.restarts += 1
        if not self.conn.poll(self.start_timeout_s):
            self.stop()
            raise FuncLoadError(
                f"{self.path}: reward function worker did not load the file within "
                f"{self.start_timeout_s:.0f} s (does importing it hang?)"
            )
        try:
            msg = self._dec.decode(self.conn.recv_bytes())
        except (EOFError, OSError):
            code = self.proc.wait(5)
            self.stop()
            raise FuncLoadError(
                f"{self.path}: reward function worker exited with code {code} while loading "
                "the file (see its output above)"
            ) from None
        if "error" in msg:
            self.stop()
            raise FuncLoadError(msg["error"])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def call(self, payload: dict, n: int, timeout_s: float):
        """The raw result of ``reward_func`` for ``n`` samples; raises CallFailed with the reason."""
        if not self.alive():
            try:
                self.start()
            except FuncLoadError as e:
                raise CallFailed(f"reward_func worker could not restart: {e}") from None
        conn = self.conn
        assert conn is not None  # a live worker has its connection: start() sets both, stop() clears both
        t0 = time.monotonic()
        try:
            conn.send_bytes(self._enc.encode(payload))
            ready = conn.poll(timeout_s)
        except OSError as e:  # the child closed its end: it died
            ready = True
            log.debug("send to reward_func worker failed: %s", e)
        if not ready:
            self.stop()
            raise CallFailed(
                f"reward_func timed out after {timeout_s:g} s on {n} samples (worker killed and restarted)"
            )
        try:
            msg = self._dec.decode(conn.recv_bytes())
        except (EOFError, OSError):
            code = self.proc.wait(5) if self.proc else None
            self.stop()
            raise CallFailed(
                f"reward_func worker died (exit code {code}) after {time.monotonic() - t0:.1f} s"
            ) from None
        if "error" in msg:
            if msg.get("traceback") and self._tracebacks_logged < 5:  # enough to debug, not a flood
                self._tracebacks_logged += 1
                log.warning("%s: %s\n%s", self.path, msg["error"], msg["traceback"])
            raise CallFailed(msg["error"])
        return msg["result"]

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


class FunctionReward:
    """Reward source "func": ``reward_func`` from a .py file, in ``workers`` processes."""

    needs_text = True

    def __init__(
        self,
        path: str,
        *,
        timeout_s: float = 30.0,
        workers: int = 1,
        start_timeout_s: float | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if not os.path.isfile(path):
            raise FuncLoadError(f"reward function file {path} does not exist")
        self.path = os.path.abspath(path)
        self.name = f"func:{os.path.basename(path)}"
        self.timeout_s = timeout_s
        start_timeout_s = start_timeout_s if start_timeout_s is not None else max(60.0, timeout_s)
        self.workers = [FuncWorker(path, start_timeout_s=start_timeout_s, env=env) for _ in range(workers)]
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward-func")
        self._lock = threading.Lock()  # one batch at a time owns the workers
        try:
            for w in self.workers:  # in turn: a broken file fails fast at the first one
                w.start()
        except BaseException:
            self.close()
            raise
        log.info("reward function %s loaded in %d worker(s)", self.path, workers)

    def __call__(self, queries: list[str], prompts: list[str], labels: list, **kw) -> SourceResult:
        n = len(queries)
        if n == 0:
            return SourceResult(rewards=[], failed=[])
        k = min(len(self.workers), n)
        bounds = [(j * n // k, (j + 1) * n // k) for j in range(k)]
        with self._lock:
            futs = [
                self._pool.submit(self._slice, self.workers[j], queries, prompts, labels, kw, lo, hi)
                for j, (lo, hi) in enumerate(bounds)
            ]
            return SourceResult.concat([f.result() for f in futs])

    def _slice(self, worker: FuncWorker, queries, prompts, labels, kw, lo: int, hi: int) -> SourceResult:
        payload = {
            "queries": queries[lo:hi],
            "prompts": prompts[lo:hi],
            "labels": labels[lo:hi],
            "kw": {k: v[lo:hi] for k, v in kw.items() if k in KWARGS and v is not None},
        }
        try:
            raw = worker.call(payload, hi - lo, self.timeout_s)
        except CallFailed as e:
            log.warning("%s: samples %d..%d failed: %s", self.name, lo, hi - 1, str(e).splitlines()[0])
            return SourceResult.all_failed(hi - lo, str(e))
        return from_raw(raw, hi - lo, self.name)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
