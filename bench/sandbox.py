"""Sandbox calls/s and latency vs a bare ``subprocess`` Python call, measured in the same run.

The same small program (read a number from stdin, print a sum) runs ``--calls`` times with
``--concurrency`` calls outstanding at once (64: a batch of code-reward tests), two ways:

- **baseline**: ``asyncio.create_subprocess_exec(python, -I, -c, CODE)``: a fresh interpreter per
  call, no isolation, no limits (what a reward function that shells out does);
- **sandbox**: ``common.sandbox.Sandbox(workers=--workers)``: a fresh, isolated, limited process per
  call, started before the call arrives (namespaces, new root, uid drop, rlimits).

Each is also timed one call at a time (``--serial`` calls), the latency a lone tool call sees.
Prints calls/s, p50 and p99 latency (from a call's submission to its result, queueing included),
and the sandbox / baseline ratios.

Run: ``python bench/sandbox.py [--calls 256] [--concurrency 64] [--workers 8] [--serial 20]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import _setup

_setup.prepare()

from common.sandbox import Sandbox  # noqa: E402

CODE = "n = int(input())\nprint(sum(i * i for i in range(n)))\n"
STDIN = "1000\n"
WANT = f"{sum(i * i for i in range(1000))}\n"


async def baseline_call() -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", CODE,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate(STDIN.encode())
    assert out.decode() == WANT and proc.returncode == 0, (out, proc.returncode)
    return time.perf_counter() - t0


async def sandbox_call(sb: Sandbox) -> float:
    t0 = time.perf_counter()
    r = await sb.run(CODE, stdin=STDIN)
    assert r.ok and r.stdout == WANT, r
    return time.perf_counter() - t0


async def wave(call, calls: int, concurrency: int) -> tuple[float, list[float]]:
    """``calls`` calls, ``concurrency`` outstanding at once; (wall seconds, per-call latencies)."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> float:
        async with gate:
            return await call()

    t0 = time.perf_counter()
    lat = await asyncio.gather(*(one() for _ in range(calls)))
    return time.perf_counter() - t0, list(lat)


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


async def main_async(args) -> None:
    sb = Sandbox(workers=args.workers)
    try:
        print(f"sandbox isolation: {sb.isolation}, {args.workers} warm workers; python {sys.version.split()[0]}")
        await wave(lambda: sandbox_call(sb), args.workers, args.workers)  # warm-up: every worker used once
        await wave(baseline_call, 4, 4)
        rows = {}
        for name, call in (("baseline", baseline_call), ("sandbox", lambda: sandbox_call(sb))):
            wall, lat = await wave(call, args.calls, args.concurrency)
            _, serial = await wave(call, args.serial, 1)
            rows[name] = (args.calls / wall, statistics.median(lat), p99(lat), statistics.median(serial))
    finally:
        sb.close()
    print(f"{args.calls} calls, {args.concurrency} at once; then {args.serial} one at a time")
    print(f"{'':10s} {'calls/s':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'serial p50 ms':>14s}")
    for name, (cps, p50, p99_, ser) in rows.items():
        print(f"{name:10s} {cps:9.1f} {p50 * 1e3:8.1f} {p99_ * 1e3:8.1f} {ser * 1e3:14.1f}")
    (b, s) = rows["baseline"], rows["sandbox"]
    print(
        f"ratio sandbox/baseline: calls/s {s[0] / b[0]:.2f}x, p99 latency {s[2] / b[2]:.2f}x, "
        f"serial latency {s[3] / b[3]:.2f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workers", type=int, default=8, help="the sandbox's warm workers (--sandbox_workers)")
    p.add_argument("--serial", type=int, default=20)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
