"""What ``bench/fleet.py`` measures with: a window of the controller process's CPU, bytes and
samples; the bytes through its socket; per-prompt latency (a timing ledger); the CPU of each of
the controller's turns; Python's garbage collections; warm-up then the window.

Each is the real object or a thin subclass that only records (``TimedLedger``,
``TimedController``); nothing here changes what the controller does.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import zmq


class Window:
    """CPU, bytes and samples of the controller's process between ``open`` and ``close``."""

    def __init__(self, byte_count, sample_count) -> None:
        self.byte_count = byte_count  # () -> (bytes in, bytes out) so far
        self.sample_count = sample_count  # () -> samples through the data path so far
        self.t0 = self.t1 = 0.0
        self.samples = 0

    @staticmethod
    def _cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    @staticmethod
    def _runqueue_s() -> float:
        """Seconds this thread has waited on a run queue (runnable, no CPU free): a starved
        controller on a shared machine shows here, not in its CPU time."""
        try:
            with open("/proc/thread-self/schedstat") as f:
                return int(f.read().split()[1]) / 1e9
        except OSError:
            return float("nan")

    def open(self) -> None:
        self.t0 = time.monotonic()
        self.cpu0, self.thread0, self.bytes0 = self._cpu(), time.thread_time(), self.byte_count()
        self.wait0 = self._runqueue_s()
        self.samples0 = self.sample_count()
        self.rss0 = _rss_mb()

    def close(self) -> dict[str, float]:
        self.t1 = time.monotonic()
        wall = self.t1 - self.t0
        cpu, thread = self._cpu() - self.cpu0, time.thread_time() - self.thread0
        b_in, b_out = (now - before for now, before in zip(self.byte_count(), self.bytes0, strict=True))
        self.samples = self.sample_count() - self.samples0
        n = max(self.samples, 1)
        return {
            "wall_s": wall,
            "samples": self.samples,
            "samples_per_s": self.samples / wall,
            "mb_per_s": (b_in + b_out) / wall / 1e6,
            "mb_in_per_s": b_in / wall / 1e6,
            "bytes_per_sample": (b_in + b_out) / n,
            "cpu_ms_per_sample": 1e3 * cpu / n,
            "thread_cpu_ms_per_sample": 1e3 * thread / n,
            # What one process could carry with a core for each of its threads: its busiest
            # thread's CPU per sample (the loop's; for the raw relay, ZeroMQ's IO thread).
            "ceiling_per_s": n / max(thread, cpu - thread, 1e-9),
            "cpu_util": cpu / wall,
            "runqueue_frac": (self._runqueue_s() - self.wait0) / wall,
            "rss_start_mb": self.rss0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Counting:
    """Bytes through the controller's ROUTER: a socket class that adds up what crosses it."""

    totals = {"in": 0, "out": 0}

    @staticmethod
    def size(frame: Any) -> int:
        return frame.nbytes if isinstance(frame, memoryview) else len(frame)


class CountingSocket(zmq.Socket):
    def send_multipart(self, msg_parts, *args, **kwargs):
        Counting.totals["out"] += sum(Counting.size(f) for f in msg_parts)
        return super().send_multipart(msg_parts, *args, **kwargs)

    def recv_multipart(self, *args, **kwargs):
        frames = super().recv_multipart(*args, **kwargs)
        Counting.totals["in"] += sum(Counting.size(f) for f in frames)
        return frames


class CountingContext(zmq.Context):
    _socket_class = CountingSocket


# --------------------------------------------------------------------------- the controller's side


def timed_ledger():
    from learner.controller.ledger import PromptLedger

    class TimedLedger(PromptLedger):
        """The real ledger, timing each prompt from its dispatch to its samples and to its scores."""

        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.dispatched: dict[int, float] = {}
            self.gen_lat: list[tuple[int, float, float]] = []  # (prompt id, dispatch time, s to its samples)
            self.done_lat: list[tuple[int, float, float]] = []  # (prompt id, dispatch time, s to its scores)

        def start_generation(self, prompt_ids, peer, version=0):
            prompt_ids = list(prompt_ids)
            super().start_generation(prompt_ids, peer, version)
            now = self.clock()
            for pid in prompt_ids:
                self.dispatched[pid] = now

        def generated(self, prompt_id, samples, peer):
            ok = super().generated(prompt_id, samples, peer)
            if ok:
                t = self.dispatched[prompt_id]
                self.gen_lat.append((prompt_id, t, self.clock() - t))
            return ok

        def scored(self, prompt_id, scores, peer):
            ok = super().scored(prompt_id, scores, peer)
            if ok:
                t = self.dispatched.pop(prompt_id)
                self.done_lat.append((prompt_id, t, self.clock() - t))
            return ok

    return TimedLedger


class GcPauses:
    """Python's garbage collections in this process: (start, generation, seconds) of each. A full
    collection walks every container the process holds (torch's modules, the samples' lists),
    and the controller's thread does nothing else meanwhile."""

    def __init__(self) -> None:
        import gc

        self.pauses: list[tuple[float, int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.monotonic()
        else:
            self.pauses.append((self._t0, info["generation"], time.monotonic() - self._t0))

    def summary(self, t0: float, t1: float) -> dict[str, float]:
        got = [(g, s) for t, g, s in self.pauses if t0 <= t <= t1]
        full = [s for g, s in got if g == 2]
        return {
            "gc_collections": len(got),
            "gc_full": len(full),
            "gc_full_max_ms": 1e3 * max(full, default=0.0),
            "gc_ms_per_s": 1e3 * sum(s for _, s in got) / max(t1 - t0, 1e-9),
        }


def timed_controller():
    from learner.controller.controller import Controller

    class TimedController(Controller):
        """The real controller, timing the CPU of each of its turns (``pump``): the work an
        arriving message may wait behind, whatever the machine's load."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.turns: list[tuple[float, float]] = []  # (start, CPU seconds)

        def pump(self, timeout: float = 0.05) -> None:
            t, cpu = time.monotonic(), time.thread_time()
            super().pump(timeout)
            self.turns.append((t, time.thread_time() - cpu))

    return TimedController


class Clock:
    """Warm-up, then the measured window (and the profiler, and the fault plan, armed with it)."""

    def __init__(self, cfg, window: Window, fault, profiler) -> None:
        self.cfg, self.window, self.fault, self.profiler = cfg, window, fault, profiler
        self.start = time.monotonic()
        self.measuring = False

    def running(self) -> bool:
        now = time.monotonic()
        if not self.measuring and now - self.start >= self.cfg.warmup_s:
            self.measuring = True
            self.window.open()
            if self.fault is not None:
                self.fault.arm(self.window.t0)
            if self.profiler is not None:
                self.profiler.enable()
        if self.measuring and now - self.window.t0 >= self.cfg.duration_s:
            if self.profiler is not None:
                self.profiler.disable()
            return False
        return True
