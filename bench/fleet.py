"""The controller at fleet scale: the real rank-0 data path against N stand-in rollout servers.

Every sample of a run passes through one process, the controller on learner rank 0. This
measures it: the real ``Controller`` (ledger, pool, rollout and reward clients, weight fleet),
in lockstep (``Controller.collect``) and async (``OffPolicyFeed``), against N stand-in rollout
servers and M stand-in reward services that speak the real protocol over real ZeroMQ sockets,
heartbeat at the real cadence, and answer with samples of T tokens (int32 ids, float32
log-probs; float32 reference log-probs back from scoring). The stand-ins are
``tests/helpers/fleet_standins.py``; the measured processes are ``bench/fleet_run.py``.

Per configuration: samples/s and MB/s through the controller (in + out of its socket),
dispatch-to-result latency beyond the modelled generation time (p50/p99, to the samples and
to their scores), the controller process's CPU per sample (its ZMQ IO thread included), its
peak RSS, and the limit: the same stand-in processes and message sizes through a bare ZeroMQ
ROUTER relay, in the same run, and the controller's share of that limit.

By default the stand-ins answer at once (``--engine_rate 0``), so the figures are the
controller's ceiling; ``--half_load`` then runs the largest fleet again at half the ceiling it
measured (engines producing ``0.5 x ceiling / N`` samples/s each), where latency means something.
``--faults`` kills a quarter of a 64-server fleet mid-run (SIGKILL of one of 4 host processes)
and starts as many new servers, then checks that every step trained whole groups, each
sample on its own prompt, nothing twice, and that no step stalled past the peer timeout.

Run: ``python bench/fleet.py`` (N in {8, 256} x T in {1k, 16k} x {lockstep, async}, the raw
limit, the single-thread core measure, half load and faults: 11 minutes under a load of 10 on
2 cores, less on a quiet machine); ``--full`` adds
N = 1 and 64; ``--servers``, ``--tokens``, ``--modes`` (none: raw and core only) narrow it;
``--json PATH`` keeps every figure; ``--profile DIR`` writes a cProfile (CPU time) of each run.
Figures are noisy on a shared machine: read the ratios against the limit of the same run, the
CPU per sample, and the ``wait`` column (how long the controller waited for a CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import sys
from dataclasses import asdict, replace

from fleet_core import core_run
from fleet_relay import relay_run
from fleet_run import RunConfig, controller_run, process_body

DEFAULT_SERVERS = [8, 256]
FULL_SERVERS = [1, 8, 64, 256]
TOKENS = [1024, 16384]


def run_one(cfg: RunConfig, timeout_s: float) -> dict:
    """One configuration in a fresh process (its own CPU time and peak RSS)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    run = {"raw": relay_run, "core": core_run}.get(cfg.mode, controller_run)
    p = ctx.Process(target=process_body, args=(run, cfg, out))
    p.start()
    try:
        res = out.get(timeout=timeout_s)
    except queue.Empty:
        res = {"error": f"no result within {timeout_s:.0f} s"}
    res.setdefault("config", asdict(cfg))
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join(5)
    return res


def _fmt(x: float, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}"


HEADER = (
    f"{'mode':<9}{'N':>5}{'T':>7}{'G':>3}{'rate/eng':>9} {'samples/s':>10}{'MB/s':>7}{'CPU ms':>8}{'ceiling':>8} "
    f"{'raw s/s':>8}{'raw MB/s':>9}{'raw ceil':>9} {'vs raw':>11} {'gen p50/p99 ms':>15} {'done p50/p99 ms':>16}"
    f"{'util':>5}{'wait':>5}{'RSS MB':>7}{'stand-in':>9}{'core ms':>8}"
)
LEGEND = (
    "samples/s, MB/s: through the controller (MB in + out of its socket); CPU ms: its process's CPU per sample; "
    "ceiling: samples/s at one core per thread (1 / its busiest thread's CPU per sample); raw: the same bytes "
    "through a bare ZeroMQ relay; vs raw: samples/s and ceiling against raw's; gen/done: ms from dispatch to the "
    "samples / their scores beyond the modelled generation time; util: CPU / wall; wait: time runnable but not "
    "running (a starved controller); stand-in: the stand-ins' CPU per sample; core ms: the controller's "
    "main-thread CPU per sample with the stand-ins on its thread, answering between its turns (bench/fleet_core.py)."
)


def row(res: dict, raw: dict | None) -> str:
    c = res["config"]
    if "error" in res:
        return f"{c['mode']:<9}{c['servers']:>5}{c['tokens']:>7}  ERROR {res['error']}"
    ok_raw = raw if raw and "error" not in raw else {}
    r_sps, r_mbs, r_ceil = (ok_raw.get(k) for k in ("samples_per_s", "mb_per_s", "ceiling_per_s"))
    vs = f"{_fmt(res['samples_per_s'] / r_sps, 2)}/{_fmt(res['ceiling_per_s'] / r_ceil, 2)}" if r_sps else "-"
    rate = c["engine_rate"]
    return (
        f"{c['mode']:<9}{c['servers']:>5}{c['tokens']:>7}{c['group']:>3}{_fmt(rate, 2) if rate else 'max':>9} "
        f"{res['samples_per_s']:>10.0f}{res['mb_per_s']:>7.0f}{res['cpu_ms_per_sample']:>8.3f}"
        f"{res['ceiling_per_s']:>8.0f} {_fmt(r_sps, 0):>8}{_fmt(r_mbs, 0):>9}{_fmt(r_ceil, 0):>9} {vs:>11} "
        f"{_fmt(res['lat_gen_p50_ms']):>7}/{_fmt(res['lat_gen_p99_ms']):<7} "
        f"{_fmt(res['lat_done_p50_ms']):>8}/{_fmt(res['lat_done_p99_ms']):<7}"
        f"{res['cpu_util']:>5.2f}{res['runqueue_frac']:>5.2f}{res['peak_rss_mb']:>7.0f}"
        f"{res['standin_cpu_ms_per_sample']:>9.3f}{_fmt(res.get('core_ms_per_sample'), 3):>8}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--servers", type=int, nargs="+", default=None, help=f"N rollout stand-ins (default {DEFAULT_SERVERS})"
    )
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="T response tokens per sample")
    ap.add_argument(
        "--modes",
        nargs="*",
        default=["lockstep", "async"],
        choices=["lockstep", "async"],
        help="none: raw and core only",
    )
    ap.add_argument("--group", type=int, default=8, help="G samples per prompt")
    ap.add_argument("--batch", type=int, default=64, help="B prompts per step")
    ap.add_argument("--staleness", type=int, default=1, help="async: --max_staleness K")
    ap.add_argument("--capacity", type=int, default=0, help="prompts in flight per server (0: ceil(bound / N))")
    ap.add_argument("--rewards", type=int, default=4, help="M reward stand-ins")
    ap.add_argument("--hosts", type=int, default=2, help="processes the rollout stand-ins are spread over")
    ap.add_argument("--engine_rate", type=float, default=0.0, help="samples/s per engine (0: answer at once)")
    ap.add_argument("--prompt_tokens", type=int, default=256)
    ap.add_argument("--no_ref_logprobs", action="store_true", help="reward stand-ins return no reference log-probs")
    ap.add_argument("--warmup_s", type=float, default=1.5)
    ap.add_argument("--duration_s", type=float, default=5.0, help="measured window per configuration")
    ap.add_argument(
        "--half_load",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the largest N again at half the samples/s it measured (latency)",
    )
    ap.add_argument(
        "--faults",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the fault run (kill a quarter, others join)",
    )
    ap.add_argument("--fault_servers", type=int, default=64)
    ap.add_argument("--no_raw", action="store_true", help="skip the raw ZeroMQ limit")
    ap.add_argument("--no_core", action="store_true", help="skip the single-thread measure of the controller's CPU")
    ap.add_argument("--full", action="store_true", help=f"N in {FULL_SERVERS}")
    ap.add_argument(
        "--gc_freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.freeze() in the controller's process after its imports, as learner/rl/run.py does before training",
    )
    ap.add_argument("--json", default="", help="write every result here")
    ap.add_argument("--profile", default="", help="folder for a cProfile of each configuration")
    args = ap.parse_args()
    servers = args.servers or (FULL_SERVERS if args.full else DEFAULT_SERVERS)
    half_load, faults = args.half_load, args.faults
    base = RunConfig(
        mode="lockstep",
        servers=1,
        tokens=1024,
        group=args.group,
        batch=args.batch,
        staleness=args.staleness,
        capacity=args.capacity,
        rewards=args.rewards,
        hosts=args.hosts,
        engine_rate=args.engine_rate,
        prompt_tokens=args.prompt_tokens,
        ref_logprobs=not args.no_ref_logprobs,
        warmup_s=args.warmup_s,
        duration_s=args.duration_s,
        gc_freeze=args.gc_freeze,
    )
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    timeout = 300 + 3 * (args.warmup_s + args.duration_s)
    print(
        f"fleet bench: G={args.group}, B={args.batch} prompts/step, K={args.staleness}, M={args.rewards} reward "
        f"stand-ins, prompts of {args.prompt_tokens} tokens, ref log-probs {'off' if args.no_ref_logprobs else 'on'}, "
        f"{args.duration_s:.0f} s windows; host load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    print(LEGEND)
    print(HEADER, flush=True)
    results: list[dict] = []
    ceilings: dict[tuple[str, int], dict] = {}
    for tokens in args.tokens:
        for n in servers:
            raw = core = None
            if not args.no_raw:
                raw = run_one(replace(base, mode="raw", servers=n, tokens=tokens), timeout)
                results.append(raw)
            if not args.no_core:
                core_cfg = replace(base, mode="core", servers=n, tokens=tokens)
                if args.profile:
                    core_cfg = replace(core_cfg, profile=os.path.join(args.profile, f"core-N{n}-T{tokens}.prof"))
                core = run_one(core_cfg, timeout)
                results.append(core)
                if "error" in core:
                    print(f"core N={n} T={tokens}: ERROR {core['error']}", flush=True)
            for mode in args.modes:
                cfg = replace(base, mode=mode, servers=n, tokens=tokens)
                if args.profile:
                    cfg = replace(cfg, profile=os.path.join(args.profile, f"{mode}-N{n}-T{tokens}.prof"))
                res = run_one(cfg, timeout)
                res.setdefault("config", asdict(cfg))
                res["raw"] = (
                    {k: raw.get(k) for k in ("samples_per_s", "mb_per_s", "ceiling_per_s", "error")} if raw else None
                )
                res["core_ms_per_sample"] = core.get("core_ms_per_sample") if core else None
                results.append(res)
                ceilings[(mode, tokens)] = res if n == max(servers) else ceilings.get((mode, tokens), res)
                print(row(res, raw), flush=True)
        if half_load:
            n = max(servers)
            for mode in args.modes:
                top = ceilings.get((mode, tokens))
                if not top or "error" in top:
                    continue
                rate = 0.5 * top["samples_per_s"] / n
                res = run_one(replace(base, mode=mode, servers=n, tokens=tokens, engine_rate=rate), timeout)
                res["half_load_of"] = top["samples_per_s"]
                results.append(res)
                print(row(res, None) + "   <- at half the samples/s above", flush=True)
    if faults:
        for mode in args.modes:
            cfg = replace(
                base,
                mode=mode,
                servers=args.fault_servers,
                tokens=min(args.tokens),
                hosts=4,
                faults=True,
                heartbeat_s=1.0,
                peer_timeout_s=4.0,
                duration_s=max(args.duration_s, 12.0),  # the kill at a third, then peer timeout and recovery
                engine_rate=args.engine_rate or 8.0,  # 1 s a prompt: steps of about 1.5 s
            )
            res = run_one(cfg, timeout)
            results.append(res)
            print(row(res, None), flush=True)
            print("  faults:", _fault_summary(res), flush=True)
    _summary(results, servers)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "results": results}, f, indent=1, default=str)
        print(f"wrote {args.json}")


def _fault_summary(res: dict) -> str:
    if "error" in res:
        return f"ERROR {res['error']}"
    f = res["faults"]
    ok = f["n_problems"] == 0 and res["pool"]["died"] == f["killed"] and not f["stalled"] and f["steps_after_s"]
    return (
        f"{f['killed']} killed at {_fmt(f['killed_at_s'])} s into the window, {f['joined']} joined; pool "
        f"{res['pool']}; ledger {res['ledger']}; problems {f['n_problems']} {f['problems'][:3]}; steps (s) before "
        f"{f['steps_before_s']}, after {f['steps_after_s']} (bound {f['stall_bound_s']:.1f}: slowest before + peer "
        f"timeout + longest generation + 1) -> {'OK' if ok else 'FAILED'}"
    )


def _summary(results: list[dict], servers: list[int]) -> None:
    """The goals' ratios: the largest fleet against N = 8, against the raw limit, and its
    latency at half load. Measured samples/s and the CPU ceiling are both given: on a shared
    machine the first depends on what else runs, the second much less."""
    done = [r for r in results if "error" not in r and r["config"]["mode"] not in ("raw", "core")]
    by = {
        (r["config"]["mode"], r["config"]["tokens"], r["config"]["servers"]): r
        for r in done
        if not r["config"]["engine_rate"]
    }
    top = max(servers)
    lines = []
    for (mode, tokens, n), r in sorted(by.items()):
        if n != top:
            continue
        small = by.get((mode, tokens, 8))
        if small and n != 8:
            lines.append(
                f"{mode} T={tokens}: N={n} / N=8: samples/s {r['samples_per_s'] / small['samples_per_s']:.2f}, "
                f"ceiling {r['ceiling_per_s'] / small['ceiling_per_s']:.2f} (goal >= 0.8)"
            )
        raw = r.get("raw") or {}
        if raw.get("samples_per_s"):
            lines.append(
                f"{mode} T={tokens} N={n}: of the raw ZeroMQ limit: samples/s {r['samples_per_s'] / raw['samples_per_s']:.2f}, "
                f"ceiling {r['ceiling_per_s'] / raw['ceiling_per_s']:.2f}{' (goal >= 0.5)' if tokens >= 16384 else ''}; "
                f"{r['cpu_ms_per_sample']:.3f} ms CPU per sample"
            )
    for r in done:
        if "half_load_of" in r:
            c = r["config"]
            lines.append(
                f"{c['mode']} T={c['tokens']} N={c['servers']} at {r['samples_per_s']:.0f} samples/s (half of "
                f"{r['half_load_of']:.0f}): p99 dispatch-to-samples {r['lat_gen_p99_ms']:.1f} ms beyond generation "
                f"(goal < 10); the controller's turns: CPU p99 {r['turn_cpu_p99_ms']:.1f} ms, max {r['turn_cpu_max_ms']:.1f}; "
                f"{r['gc_full']} full garbage collections, the longest {r['gc_full_max_ms']:.0f} ms"
            )
    if lines:
        print("\n".join(["", *lines]))


if __name__ == "__main__":
    main()
