"""One measured configuration of ``bench/fleet.py``, in a process of its own.

``controller_run`` is rank 0's data path exactly as a run builds it (``learner/rl/build.py``):
an ``Endpoint`` bound for the services, a ``ServicePool``, a ``RolloutClient``, a ``Controller``
with its ``PromptLedger`` and ``FleetWeights`` (no publisher: no model, so a push moves no bytes
and only advances the pool's version, as ``FleetWeights.push`` does after the bytes have gone).
Lockstep is ``Controller.collect`` of one batch after another; async is ``OffPolicyFeed`` with
the schedule's order of calls (``take_batch``, ``abort_stale``, push) and a learner that trains
in no time. Stand-in services (``tests/helpers/fleet_standins.py``) run in ``hosts`` processes.

The raw limit is ``fleet_relay.py``, the single-thread measure ``fleet_core.py``, the
instruments ``fleet_measure.py``. Each run puts one result dict on its queue, from a fresh
process, so that its CPU time and peak RSS are its own; the stand-ins' processes are its
children and count for nothing in ``RUSAGE_SELF``.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import queue
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from _setup import prepare

REPO = prepare(tests=True)
# bench/ comes first on sys.path (the script's folder), where bench/learner.py would shadow the
# learner package: the repository goes ahead of it.
sys.path.insert(0, str(REPO))

from fleet_measure import Clock, Counting, CountingContext, GcPauses, Window, pct, timed_controller, timed_ledger

from helpers.fleet_standins import VOCAB, Shape, modelled_gen_s, serve_host

log = logging.getLogger("bench.fleet")


@dataclass
class RunConfig:
    mode: str  # "lockstep" | "async" | "raw" (fleet_relay.py) | "core" (fleet_core.py)
    servers: int  # N rollout stand-ins
    tokens: int  # T, response tokens per sample
    group: int = 8  # G samples per prompt
    batch: int = 64  # B prompts (groups) per step
    staleness: int = 1  # async: --max_staleness K
    capacity: int = 0  # prompts in flight per server; 0: enough for the bound, ceil(bound / N)
    rewards: int = 4  # M reward stand-ins
    reward_capacity: int = 64  # reward_service's --capacity default
    hosts: int = 2  # processes the rollout stand-ins are spread over (faults: 4)
    engine_rate: float = 0.0  # samples/s per engine; 0: answer at once (the controller's ceiling)
    gen_jitter: float = 0.5  # per-prompt generation time within gen_s x (1 +- jitter)
    prompt_tokens: int = 256
    ref_logprobs: bool = True  # reward stand-ins return reference log-probs (T floats a sample)
    warmup_s: float = 2.0
    duration_s: float = 8.0
    heartbeat_s: float = 2.0  # the services' default
    peer_timeout_s: float = 30.0  # train_ppo's default
    faults: bool = False  # kill a quarter of the rollout stand-ins mid-run; as many join
    profile: str = ""  # write a cProfile of the measured window here
    gc_freeze: bool = False  # gc.freeze() in the controller's process after its imports

    @property
    def bound(self) -> int:
        """The most prompts the data path keeps out at once: a batch (lockstep), (K + 1) batches (async)."""
        return self.batch * (self.staleness + 1 if self.mode == "async" else 1)

    @property
    def per_server(self) -> int:
        return self.capacity or max(1, math.ceil(self.bound / self.servers))

    @property
    def gen_s(self) -> float:
        """Mean generation time of a prompt that makes the offered load N x engine_rate samples/s."""
        if self.engine_rate <= 0:
            return 0.0
        in_flight = min(self.servers * self.per_server, self.bound)
        return in_flight * self.group / (self.servers * self.engine_rate)

    def shape(self, role: str, stamp: bool = False) -> Shape:
        return Shape(
            tokens=self.tokens,
            gen_s=self.gen_s,
            gen_jitter=self.gen_jitter if self.gen_s else 0.0,
            capacity=self.per_server if role == "rollout" else self.reward_capacity,
            ref_logprobs=self.ref_logprobs,
            heartbeat_s=self.heartbeat_s,
            stamp=stamp,
            group=self.group,
        )


# --------------------------------------------------------------------------- stand-in processes


class Fleet:
    """The stand-in processes of one run: rollout hosts (a share of the N servers each) and one
    reward host. ``kill`` SIGKILLs a rollout host (a node lost), ``join`` starts another."""

    def __init__(self, address: str, cfg: RunConfig, *, raw: bool = False, stamp: bool = False) -> None:
        self.address, self.cfg, self.raw, self.stamp = address, cfg, raw, stamp
        self.ctx = mp.get_context("spawn")
        self.stop_evt = self.ctx.Event()
        self.out = self.ctx.Queue()
        self.procs: list[tuple[str, Any]] = []  # (role, process)
        self._next = 0

    def _start(self, role: str, names: list[str]) -> None:
        profile = f"{self.cfg.profile}.{names[0]}" if self.cfg.profile else ""
        p = self.ctx.Process(
            target=serve_host,
            args=(
                self.address,
                role,
                names,
                self.cfg.shape(role, self.stamp),
                self.raw,
                self.stop_evt,
                self.out,
                profile,
            ),
            daemon=True,
        )
        p.start()
        self.procs.append((role, p))

    def start(self) -> None:
        n, hosts = self.cfg.servers, min(self.cfg.hosts, self.cfg.servers)
        for h in range(hosts):
            self.join(n * (h + 1) // hosts - n * h // hosts)
        self._start("reward", [f"reward-{i:03d}" for i in range(self.cfg.rewards)])

    def join(self, count: int) -> list[str]:
        names = [f"rollout-{self._next + i:04d}" for i in range(count)]
        self._next += count
        self._start("rollout", names)
        return names

    def kill(self, index: int = 0) -> None:
        role, p = [rp for rp in self.procs if rp[0] == "rollout"][index]
        p.kill()
        p.join(10)

    def stop(self, timeout: float = 30.0) -> list[tuple[str, dict]]:
        """Stops every host still running; their totals (a killed host reports none)."""
        self.stop_evt.set()
        live = [p for _, p in self.procs if p.exitcode is None]
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < len(live) and time.monotonic() < deadline:
            try:
                got.append(self.out.get(timeout=1.0))
            except queue.Empty:  # a host still finishing
                if not any(p.is_alive() for p in live):
                    break
        for _, p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        return got


# --------------------------------------------------------------------------- the controller's side


class _Checks:
    """Fault mode: every sample reached its own prompt, every group is whole, steps are timed."""

    def __init__(self, cfg: RunConfig) -> None:
        self.group = cfg.group
        self.batch = cfg.batch
        self.problems: list[str] = []
        self.steps: list[tuple[float, float]] = []  # (end time, seconds) of every step
        self.trained: set[int] = set()  # prompt ids trained

    def step(self, seconds: float, samples: list[Any]) -> None:
        self.steps.append((time.monotonic(), seconds))
        by_prompt: dict[int, list[Any]] = {}
        for s in samples:
            by_prompt.setdefault(s.prompt_id, []).append(s)
        if len(by_prompt) != self.batch:
            self.problems.append(f"a step trained {len(by_prompt)} groups, not {self.batch}")
        for pid, group in by_prompt.items():
            if pid in self.trained:
                self.problems.append(f"prompt {pid} trained twice")
            self.trained.add(pid)
            idx = sorted(s.sample_index for s in group)
            if idx != list(range(self.group)):
                self.problems.append(f"prompt {pid}: sample indices {idx}")
            for s in group:
                if int(s.response[0]) != pid % VOCAB:
                    self.problems.append(f"prompt {pid}: holds a sample of prompt {int(s.response[0])}")


class _FaultPlan:
    """A third into the measured window: SIGKILL one rollout host (a quarter of the fleet), and
    start a host of as many new servers, which join the running controller."""

    def __init__(self, cfg: RunConfig, fleet: Fleet) -> None:
        self.cfg, self.fleet = cfg, fleet
        self.at: float | None = None
        self.killed_at: float | None = None
        self.joined: list[str] = []

    def arm(self, t0: float) -> None:
        self.at = t0 + self.cfg.duration_s / 3

    def tick(self, *_: Any) -> None:  # also Controller.collect's on_progress(done, total)
        if self.at is None or self.killed_at is not None or time.monotonic() < self.at:
            return
        self.killed_at = time.monotonic()
        self.fleet.kill(0)
        self.joined = self.fleet.join(self.cfg.servers // self.cfg.hosts)
        log.warning("killed %d rollout stand-ins; %d join", self.cfg.servers // self.cfg.hosts, len(self.joined))


def _push(pool, version: int) -> None:
    """A weight push without bytes: what ``FleetWeights.push`` records once the weights are sent."""
    pool.weights_pushed(version, [p.name for p in pool.alive("rollout")])


def _lockstep(cfg, controller, items, clock: Clock, checks: _Checks | None) -> dict[str, Any]:
    steps, version = [], 0
    timeout = 120.0 + 3 * cfg.peer_timeout_s
    while clock.running():
        measuring = clock.measuring
        t = time.monotonic()
        progress = clock.fault.tick if clock.fault is not None else None
        res = controller.collect(items(cfg.batch), timeout_s=timeout, on_progress=progress)
        dt = time.monotonic() - t
        if measuring:
            steps.append(dt)
        if checks is not None:
            if res.failed_groups:
                checks.problems.append(f"{res.failed_groups} group(s) failed scoring")
            checks.step(dt, res.rollout.samples)
        version += 1
        _push(controller.pool, version)
    out = clock.window.close()
    out["turns"] = controller.turns
    out["steps"] = len(steps)
    out["step_s_median"] = statistics.median(steps) if steps else float("nan")
    out["step_s_max"] = max(steps) if steps else float("nan")
    return out


def _async(cfg, controller, items, clock: Clock, checks: _Checks | None) -> dict[str, Any]:
    from learner.controller.feed import OffPolicyFeed

    def prompts():
        while True:
            yield from items(cfg.batch)

    feed = OffPolicyFeed(controller, prompts(), batch_groups=cfg.batch, max_staleness=cfg.staleness)
    version, steps = 0, []
    last = time.monotonic()
    turns: list[tuple[float, float]] = []  # (start, CPU seconds) of each of the feed's turns
    while clock.running():
        if clock.fault is not None:
            clock.fault.tick()
        t, cpu = time.monotonic(), time.thread_time()
        feed.pump(0.02)  # as the schedule's pump thread turns
        turns.append((t, time.thread_time() - cpu))
        batch = feed.take_batch(version)
        if batch is None:
            continue
        now = time.monotonic()
        samples = [s for g in batch for s in g.samples]
        if clock.measuring:
            steps.append(now - last)
        if checks is not None:
            checks.step(now - last, samples)
        last = now
        feed.abort_stale(next_train_version=version + 1)
        version += 1
        _push(controller.pool, version)
    out = clock.window.close()
    out["turns"] = turns
    feed.check_accounting()
    out["feed"] = feed.close()
    out["steps"] = len(steps)
    out["step_s_median"] = statistics.median(steps) if steps else float("nan")
    out["step_s_max"] = max(steps) if steps else float("nan")
    return out


def process_body(run: Callable[[RunConfig], dict[str, Any]], cfg: RunConfig, out) -> None:
    """A configuration's process (a fresh one each: its own CPU time and peak RSS): ``run(cfg)``'s
    result dict to ``out``, or the error the parent reports."""
    try:
        out.put(run(cfg))
    except BaseException as e:  # reported by the parent
        log.exception("%s failed", cfg.mode)
        out.put({"error": repr(e)})


def controller_run(cfg: RunConfig) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from common import protocol as P
    from common.transport import Endpoint
    from learner.controller.controller import Controller
    from learner.controller.pool import ServicePool
    from learner.controller.rollout_client import RolloutClient
    from learner.controller.types import PromptItem

    ep = Endpoint.bind("tcp://127.0.0.1:0", context=CountingContext())
    pool = ServicePool(ep, peer_timeout_s=cfg.peer_timeout_s)
    ledger = timed_ledger()(generate_timeout_s=600.0, score_timeout_s=600.0)
    sampling = P.SamplingParams(n=cfg.group, max_new_tokens=cfg.tokens)
    # Lockstep's turns are the controller's; async's are the feed's (its pump turns the
    # controller's and then turns finished prompts into samples), timed in ``_async``.
    make = timed_controller() if cfg.mode == "lockstep" else Controller
    controller = make(RolloutClient(ep, pool), ledger, sampling=sampling)
    fleet = Fleet(ep.address, cfg, stamp=cfg.faults)
    # Samples through the data path: prompts scored and taken out of the ledger, x G (in async
    # this includes groups the feed then drops as too stale: the controller carried them).
    window = Window(
        lambda: (Counting.totals["in"], Counting.totals["out"]), lambda: ledger.counters["trained"] * cfg.group
    )
    checks = _Checks(cfg) if cfg.faults else None
    fault = _FaultPlan(cfg, fleet) if cfg.faults else None
    fleet.start()
    gc_pauses = GcPauses()
    if cfg.gc_freeze:
        import gc

        gc.freeze()  # what the process holds after its imports is never walked by a collection again
    try:
        t = time.monotonic()
        controller.wait_for_services(cfg.servers, cfg.rewards, timeout_s=300)
        setup_s = time.monotonic() - t
        prompt = [(7 * i) % VOCAB for i in range(cfg.prompt_tokens)]
        text = "x" * (4 * cfg.prompt_tokens)  # about the characters of that many tokens

        def items(n: int) -> list[PromptItem]:
            return [PromptItem(tokens=prompt, text=text, label="42") for _ in range(n)]

        profiler = None
        if cfg.profile:
            import cProfile

            profiler = cProfile.Profile(time.thread_time)  # CPU time: a preempted function is not charged
        clock = Clock(cfg, window, fault, profiler)
        result = (_lockstep if cfg.mode == "lockstep" else _async)(cfg, controller, items, clock, checks)
        if profiler is not None:
            profiler.dump_stats(cfg.profile)
    finally:
        hosts = fleet.stop()
        ep.close(0)
    shape = cfg.shape("rollout")

    def overhead(rows, score_s: float) -> list[float]:
        """ms beyond the modelled generation (and scoring) time, of prompts dispatched in the window."""
        return [
            1e3 * (lat - modelled_gen_s(pid, shape) - score_s)
            for pid, t, lat in rows
            if window.t0 <= t and t + lat <= window.t1
        ]

    lat_gen, lat_done = overhead(ledger.gen_lat, 0.0), overhead(ledger.done_lat, shape.score_s)
    turns = [1e3 * cpu for t, cpu in result.pop("turns") if window.t0 <= t <= window.t1]
    standin_cpu = sum(h["process_cpu_s"] for _, h in hosts)
    standin_samples = sum(h["samples"] for role, h in hosts if role == "rollout")
    result.update(
        {
            "config": asdict(cfg),
            "setup_s": setup_s,
            "gen_s": cfg.gen_s,
            "per_server": cfg.per_server,
            "lat_gen_p50_ms": pct(lat_gen, 0.5),
            "lat_gen_p99_ms": pct(lat_gen, 0.99),
            "lat_done_p50_ms": pct(lat_done, 0.5),
            "lat_done_p99_ms": pct(lat_done, 0.99),
            "turn_cpu_p50_ms": pct(turns, 0.5),
            "turn_cpu_p99_ms": pct(turns, 0.99),
            "turn_cpu_max_ms": max(turns) if turns else float("nan"),
            "latency_prompts": len(lat_gen),
            **gc_pauses.summary(window.t0, window.t1),
            "standin_cpu_ms_per_sample": 1e3 * standin_cpu / max(standin_samples, 1),
            "pool": dict(pool.counters),
            "ledger": dict(ledger.counters),
            "controller": dict(controller.counters),
        }
    )
    if checks is not None:
        killed_at = fault.killed_at or float("inf")
        before = [d for t, d in checks.steps if t < killed_at]
        after = [d for t, d in checks.steps if t >= killed_at]
        # A step that lost servers waits out their silence (the peer timeout), then has their
        # prompts generated again (at most the longest modelled generation time).
        bound = (max(before) if before else 0.0) + cfg.peer_timeout_s + shape.gen_s * (1 + shape.gen_jitter) + 1.0
        result["faults"] = {
            "problems": checks.problems[:20],
            "n_problems": len(checks.problems),
            "killed": cfg.servers // cfg.hosts,
            "joined": len(fault.joined),
            "killed_at_s": (fault.killed_at - window.t0) if fault.killed_at else None,
            "steps_before_s": [round(d, 2) for d in before],
            "steps_after_s": [round(d, 2) for d in after],
            "stall_bound_s": bound,
            "stalled": bool(after) and max(after) > bound,
            "in_ledger_at_end": len(ledger.entries) if cfg.mode == "lockstep" else None,
        }
    return result
