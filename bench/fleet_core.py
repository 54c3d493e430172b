"""The controller's own CPU per sample, without the machine's noise: ``bench/fleet.py --core``.

On a shared machine the multi-process runs of ``fleet_run.py`` wait for CPUs, and what they
measure moves with the load. Here the real data path (``Controller`` and ``OffPolicyFeed``,
sockets and codec included) runs on one thread with its stand-ins: N rollout and M reward
DEALER endpoints answer, with the stand-ins' own messages (``helpers.fleet_standins``),
*between* the controller's turns, and only the turns are timed (``time.thread_time``). What is
left is the main thread's cost per sample: receiving, routing, building score requests,
matching scores, turning prompts into ``ScoredSample`` s. ZeroMQ's IO thread (the kernel's
copies) is not in it: the multi-process runs give the whole process.
"""

from __future__ import annotations

import time
from typing import Any


def core_run(cfg) -> dict[str, Any]:
    """The controller's core without sockets (``fleet_run.process_body``)."""
    from dataclasses import asdict

    from common import protocol as P
    from common.transport import Endpoint
    from helpers.fleet_standins import VOCAB, sample_arrays, sample_batch, scored_batch
    from learner.controller.controller import Controller
    from learner.controller.feed import OffPolicyFeed
    from learner.controller.ledger import PromptLedger
    from learner.controller.pool import ServicePool
    from learner.controller.rollout_client import RolloutClient
    from learner.controller.types import PromptItem

    ep = Endpoint.bind("tcp://127.0.0.1:0")
    pool = ServicePool(ep, peer_timeout_s=3600.0)  # no heartbeats here: nobody is late
    ledger = PromptLedger(generate_timeout_s=3600.0, score_timeout_s=3600.0)
    c = Controller(RolloutClient(ep, pool), ledger, sampling=P.SamplingParams(n=cfg.group, max_new_tokens=cfg.tokens))
    rollouts = [Endpoint.connect(ep.address, name=f"rollout-{i:04d}") for i in range(cfg.servers)]
    rewards = [Endpoint.connect(ep.address, name=f"reward-{i:03d}") for i in range(cfg.rewards)]
    for svc, role, cap in [(s, "rollout", cfg.per_server) for s in rollouts] + [
        (s, "reward", cfg.reward_capacity) for s in rewards
    ]:
        svc.send(
            P.Hello(
                role=role,
                name=svc.name,
                capabilities=(P.RolloutCapabilities if role == "rollout" else P.RewardCapabilities)(capacity=cap),
                call_id=1,
            )
        )
        deadline = time.monotonic() + 30
        while svc.recv(timeout=0.001) is None:
            c.pump(0.001)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{svc.name}: no Welcome")
    ids, lps = sample_arrays(cfg.group, cfg.tokens)
    ref = sample_arrays(1, 16 * cfg.group * cfg.tokens, seed=1)[1] if cfg.ref_logprobs else None

    def answer() -> None:
        for svc in rollouts:
            while (got := svc.recv(timeout=0)) is not None:
                if isinstance(got[1], P.PromptBatch):
                    for pid in got[1].prompt_ids:
                        svc.send(sample_batch([pid], cfg.group, cfg.tokens, ids, lps, got[1].policy_version, svc.name))
        for svc in rewards:
            while (got := svc.recv(timeout=0)) is not None:
                if isinstance(got[1], P.ScoreRequest):
                    scored = scored_batch(got[1].samples, ref, svc.name)
                    scored.call_id = got[1].call_id
                    svc.send(scored)

    prompt = [(7 * i) % VOCAB for i in range(cfg.prompt_tokens)]

    def prompts():
        while True:
            yield PromptItem(tokens=prompt, text="x" * (4 * cfg.prompt_tokens), label="42")

    feed = OffPolicyFeed(c, prompts(), batch_groups=cfg.batch, max_staleness=cfg.staleness)
    profiler = None
    if cfg.profile:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)
    version, cpu, turns = 0, 0.0, 0
    start = time.monotonic()
    counted_from = None
    while time.monotonic() - start < cfg.warmup_s + cfg.duration_s:
        if counted_from is None and time.monotonic() - start >= cfg.warmup_s:
            counted_from, cpu, turns = ledger.counters["trained"], 0.0, 0
        if profiler is not None and counted_from is not None:
            profiler.enable()
        t0 = time.thread_time()
        feed.pump(0.0)
        batch = feed.take_batch(version)
        if batch is not None:
            feed.abort_stale(next_train_version=version + 1)
            version += 1
            pool.weights_pushed(version, [p.name for p in pool.alive("rollout")])
        cpu += time.thread_time() - t0
        if profiler is not None:
            profiler.disable()
        turns += 1
        time.sleep(0.001)  # ZeroMQ's IO threads deliver what was sent
        answer()
    samples = (ledger.counters["trained"] - (counted_from or 0)) * cfg.group
    if profiler is not None:
        profiler.dump_stats(cfg.profile)
    for s in rollouts + rewards:
        s.close(0)
    ep.close(0)
    return {
        "config": asdict(cfg),
        "core_samples": samples,
        "core_ms_per_sample": 1e3 * cpu / max(samples, 1),
        "core_turns": turns,
    }
