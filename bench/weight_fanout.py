"""Weight push time against the number of rollout servers: the fleet group vs one group per server.

Starts ``--servers`` (default 4) real rollout servers (``python -m rollout_service``, vLLM on
CPU, the harness of ``tests/helpers/rollout_harness.py``) on the tiny model, or on a random
Qwen2 of ``--model_mb`` MB (``bench/rollout.py``'s ``build_model``), and pushes the same weights
to the first 1, 2 and 4 of them, round after round, through each path:

- ``fleet``: one group over every target (gloo: the learner sends each bucket once, down a
  relay through the servers; ``common/weights/gloo.py``);
- ``per_server``: the old design, one group per server, the learner sending a copy to each.

Sizes and paths alternate within every round (the box's speed drifts), and each figure is the
median over the rounds after a warm-up round. Per push, from ``PushReport.seconds``:

- ``send``: the learner's own part: its bytes on the wire (what the fleet group keeps flat);
- ``push``: start + transfer + finish: everything the servers do too (the relay's tail, vLLM's
  load of the weights, the prefix-cache reset). Each timed push follows an untimed one to the
  same targets, so forming a group when the targets change is not counted (a run forms the
  fleet once per membership change, not per push) and every engine is awake.

The figure to read is push(4) / push(1) per path (goal for the fleet <= 1.5; per-server is
about 4 by construction where bytes dominate). On a host with fewer cores than servers, the
servers' loads and relays compete for the same cores: ``send`` then shows what the design
changes, ``push`` what the host allows.

Why a relay on gloo (``--raw_mb N``, no vLLM): gloo's broadcast versus the relay, in plain
processes, for 2, 3 and 5 ranks: how long the root is busy sending, and until every rank has
the bytes. gloo's broadcast is a binomial tree of whole-message hops (``gloo/broadcast.cc``), so
the root sends log2(n) copies; the relay sends one.

Run: ``flock /tmp/rayless-slow.lock python bench/weight_fanout.py [--rounds 5] [--model_mb 0]``
(prints a table, then a JSON summary line); ``--raw_mb 64 --raw_only`` for the gloo part alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _setup import prepare

REPO = prepare(tests=True)

PATHS = ("fleet", "per_server")


def _raw_rank(rank: int, world: int, port: int, nbytes: int, mode: str, reps: int, q) -> None:
    """One rank of the raw gloo comparison: ``bcast`` (gloo's broadcast) or ``relay`` (ours)."""
    import torch

    from common.weights.gloo import GlooGroup
    from common.weights.wire import DEFAULT_RELAY_CHUNK_BYTES, chunk_spans

    store = GlooGroup.host_store("127.0.0.1", world, 60.0, port) if rank == 0 else None
    g = GlooGroup.open("127.0.0.1", port, rank, world, timeout_s=60.0, label="raw", store=store)
    want = (torch.arange(nbytes, dtype=torch.int32) % 251).to(torch.uint8)
    buf = want.clone() if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    spans = chunk_spans(nbytes, DEFAULT_RELAY_CHUNK_BYTES)
    times = []
    for _ in range(reps + 1):
        if rank:
            buf.zero_()
        g.pg.barrier().wait()
        t0 = time.perf_counter()
        if mode == "bcast":
            g.broadcast(buf).wait()
        elif rank == 0:
            for w in [g.send(buf[o : o + n], 1) for o, n in spans]:
                w.wait()
        else:
            recvs = [g.recv(buf[o : o + n], rank - 1) for o, n in spans]
            sends = []
            for (o, n), r in zip(spans, recvs, strict=True):
                r.wait()
                if rank + 1 < world:
                    sends.append(g.send(buf[o : o + n], rank + 1))
            for w in sends:
                w.wait()
        own = time.perf_counter() - t0
        g.pg.barrier().wait()
        times.append((own, time.perf_counter() - t0))
    assert torch.equal(buf, want), f"rank {rank}: wrong bytes ({mode})"
    q.put((rank, times[1:]))


def raw_gloo(mb: int, reps: int = 5) -> dict:
    """gloo broadcast vs relay, world sizes 2/3/5: root busy (median) and all received (median), ms."""
    import multiprocessing as mp

    from common.transport import free_port

    ctx = mp.get_context("spawn")
    out = {}
    for mode in ("bcast", "relay"):
        for world in (2, 3, 5):
            q = ctx.Queue()
            port = free_port()
            procs = [
                ctx.Process(target=_raw_rank, args=(r, world, port, mb << 20, mode, reps, q)) for r in range(world)
            ]
            for p in procs:
                p.start()
            got = dict(q.get(timeout=600) for _ in procs)
            for p in procs:
                p.join(60)
            root = got[0]
            row = {
                "root_ms": round(statistics.median(t[0] for t in root) * 1e3, 1),
                "all_ms": round(statistics.median(t[1] for t in root) * 1e3, 1),
            }
            out[f"{mode}/{world}"] = row
            print(
                f"raw gloo {mode:<5} {world} ranks, {mb} MB: root busy {row['root_ms']:7.1f} ms, "
                f"all received {row['all_ms']:7.1f} ms",
                flush=True,
            )
    return out


def timed_push(ctrl, path: str, targets: list[str], version: int) -> dict[str, float]:
    """One push of ``version`` to ``targets`` through ``path``, right after an untimed one to the
    same targets: that one forms the group when the targets changed, and wakes every target's
    engine (an engine idle for a second sleeps on its queues; a push finding it asleep pays the
    wake-up, and which timed push that hit would depend on the order of the sizes)."""
    pub = ctrl.publisher
    pub.fanout = path
    pub.push(version, targets)
    ctrl.pump(0.2)
    report = pub.push(version, targets)
    assert sorted(report.updated) == sorted(targets) and not report.failed, report
    if path == "fleet" and len(targets) > 1:
        assert report.fleet == targets, f"expected one fleet transfer, got {report}"
    s = report.seconds
    return {"send": s["send"], "push": s["start"] + s["transfer"] + s["finish"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    ap.add_argument("--sizes", default="1,2,4", help="numbers of servers pushed to")
    ap.add_argument("--paths", default=",".join(PATHS), help="fleet, per_server or both")
    ap.add_argument("--model_mb", type=float, default=0, help="0: the tiny model; else a random Qwen2 of this size")
    ap.add_argument("--bucket_mb", type=int, default=64)
    # Each push wakes every engine, and an engine that has just worked spins for 1 s on its queues
    # (docs/rollout.md, Benchmarks): with 4 engines on 2 cores, a shorter gap times the spinning.
    ap.add_argument("--gap_s", type=float, default=2.5, help="idle time before each push (heartbeats pumped)")
    ap.add_argument(
        "--raw_mb", type=int, default=0, help="also compare gloo's broadcast with the relay on this many MB"
    )
    ap.add_argument("--raw_only", action="store_true", help="only the raw gloo comparison (no servers)")
    ap.add_argument("--out", default="", help="also write the JSON summary here")
    args = ap.parse_args()
    raw = raw_gloo(args.raw_mb) if args.raw_mb else None
    if args.raw_only:
        print("SUMMARY " + json.dumps({"raw_gloo": raw}), flush=True)
        return
    sizes = sorted(int(x) for x in args.sizes.split(","))
    paths = [p for p in args.paths.split(",") if p]
    if unknown := set(paths) - set(PATHS):
        ap.error(f"unknown path(s) {sorted(unknown)} (known: {', '.join(PATHS)})")

    import torch
    from rollout import build_model  # bench/rollout.py
    from transformers import AutoModelForCausalLM

    from common.tiny import build_tiny_model
    from helpers.rollout_harness import Controller

    work = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    model_dir = build_tiny_model(work / "tiny")
    if args.model_mb > 0:
        model_dir = build_model(work / "model", model_dir, args.model_mb)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ctrl = Controller(model, peer_timeout_s=300, weight_timeout_s=300, bucket_bytes=args.bucket_mb << 20)
    names = [f"fan{i}" for i in range(max(sizes))]
    summary: dict = {
        "host_cpus": os.cpu_count(),
        "load_avg_at_start": round(os.getloadavg()[0], 2),
        "mb": round(ctrl.publisher.source.nbytes() / 1e6, 2),
        "servers": len(names),
        "rounds": args.rounds,
        "raw_gloo": raw,
    }
    times: dict[tuple[str, int], list[dict[str, float]]] = {(p, n): [] for p in paths for n in sizes}
    try:
        t0 = time.monotonic()
        for n in names:
            ctrl.start(n, work, "--max_model_len", "256", "--max_num_seqs", "4")
        ctrl.wait_joined(names, timeout=1800)
        print(f"{len(names)} servers up in {time.monotonic() - t0:.0f} s; {summary['mb']} MB per push", flush=True)
        version = 0
        for r in range(args.rounds + 1):
            for path in paths:
                for n in sizes:
                    ctrl.pump(args.gap_s)
                    version += 1
                    t = timed_push(ctrl, path, names[:n], version)
                    if r > 0:  # round 0 warms every path and size up
                        times[(path, n)].append(t)
            print(f"round {r}/{args.rounds} done", flush=True)
    finally:
        ctrl.close()
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    rows = {}
    print(f"\n{'path':<11} {'servers':>7} {'send ms':>9} {'push ms':>9}   (median of {args.rounds} rounds)")
    for path in paths:
        for n in sizes:
            ts = times[(path, n)]
            row = {k: round(med(t[k] for t in ts) * 1e3, 1) for k in ("send", "push")}
            rows[f"{path}/{n}"] = row
            print(f"{path:<11} {n:>7} {row['send']:>9.1f} {row['push']:>9.1f}")
    lo, hi = min(sizes), max(sizes)
    for path in paths:
        # Per-round ratios, then their median: the load of the box drifts between rounds.
        for k in ("send", "push"):
            ratio = med(a[k] / b[k] for a, b in zip(times[(path, hi)], times[(path, lo)], strict=True))
            summary[f"{path}_{k}_ratio_{hi}_over_{lo}"] = round(ratio, 2)
        print(
            f"{path:<11} push({hi})/push({lo}): send {summary[f'{path}_send_ratio_{hi}_over_{lo}']:.2f}, "
            f"push {summary[f'{path}_push_ratio_{hi}_over_{lo}']:.2f}"
        )
    summary["medians_ms"] = rows
    summary["load_avg_at_end"] = round(os.getloadavg()[0], 2)
    line = json.dumps(summary)
    print("SUMMARY " + line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":  # vLLM spawns processes that re-import __main__
    main()
