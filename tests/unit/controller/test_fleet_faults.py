"""The controller with a fleet: 64 stand-in rollout servers, a quarter lost mid-step (their
sockets closed without last words, as a SIGKILLed node) and as many new ones joining.

Nothing is lost (every step trains whole groups, each sample on its own prompt, none twice),
the accounting is exact (ledger and feed), and no step stalls much past the peer timeout:
prompts held by the lost servers come back when their silence passes it. The stand-ins are
``helpers/fleet_standins.py`` (the bench's, ``bench/fleet.py --faults``), in threads here.
"""

from __future__ import annotations

import time

import pytest

from common import protocol as P
from common.transport import Endpoint
from helpers.fleet_standins import VOCAB, Shape, StandInThread
from learner.controller.controller import Controller
from learner.controller.feed import OffPolicyFeed
from learner.controller.ledger import PromptLedger
from learner.controller.pool import ServicePool
from learner.controller.rollout_client import RolloutClient
from learner.controller.types import PromptItem

N, HOSTS, G, T = 64, 4, 2, 8
PEER_TIMEOUT_S = 1.5  # 7 heartbeats: a stand-in thread starved on a loaded machine is not a death
# A step that lost servers waits out their silence (the peer timeout, then one reap turn) and
# then generates what they held; the rest is this shared machine's scheduling.
STALL_BOUND_S = PEER_TIMEOUT_S + 2.0
SHAPE = Shape(tokens=T, gen_s=0.2, gen_jitter=0.5, capacity=2, heartbeat_s=0.2, stamp=True, ref_logprobs=True)


@pytest.fixture
def fleet():
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    pool = ServicePool(ep, peer_timeout_s=PEER_TIMEOUT_S)
    ledger = PromptLedger(generate_timeout_s=60, score_timeout_s=60)
    c = Controller(RolloutClient(ep, pool), ledger, sampling=P.SamplingParams(n=G, max_new_tokens=T))
    hosts: list[StandInThread] = []

    def start(role: str, names: list[str], shape: Shape = SHAPE) -> StandInThread:
        h = StandInThread(ep.address, role, names, shape)
        h.start()
        hosts.append(h)
        return h

    for h in range(HOSTS):
        start("rollout", [f"rollout-{h}-{i:02d}" for i in range(N // HOSTS)])
    start("reward", ["reward-0", "reward-1"], Shape(tokens=T, capacity=64, heartbeat_s=0.2))
    c.wait_for_services(N, 2, timeout_s=60)
    for h in hosts:
        h.wait_ready(30)
    yield c, hosts, start
    for h in hosts:
        h.stop()
    ep.close(0)


def items(n: int) -> list[PromptItem]:
    return [PromptItem(tokens=[5, 6, 7], text="p", label="l") for _ in range(n)]


def check_groups(samples, seen: set[int]) -> int:
    """Every group whole (sample indices 0..G-1), every sample on its own prompt (the stand-ins
    stamp a sample's first token with its prompt id), no prompt trained twice."""
    by_prompt: dict[int, list] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_id, []).append(s)
    for pid, group in by_prompt.items():
        assert pid not in seen, f"prompt {pid} trained twice"
        seen.add(pid)
        assert sorted(s.sample_index for s in group) == list(range(G)), pid
        assert all(s.response[0] == pid % VOCAB and len(s.response) == T for s in group), pid
    return len(by_prompt)


def lose_a_quarter(hosts, start) -> StandInThread:
    hosts[0].kill()
    return start("rollout", [f"joiner-{i:02d}" for i in range(N // HOSTS)])


def test_lockstep_loses_a_quarter_mid_step_and_takes_joiners(fleet):
    c, hosts, start = fleet
    B = 2 * N
    seen: set[int] = set()
    joiners = None

    def mid_step(done: int, total: int) -> None:
        nonlocal joiners
        if joiners is None and done >= total // 4:
            joiners = lose_a_quarter(hosts, start)

    steps = []
    for step in range(4):
        t = time.monotonic()
        res = c.collect(items(B), timeout_s=30, on_progress=mid_step if step == 1 else None)
        steps.append(time.monotonic() - t)
        assert res.failed_groups == 0
        assert check_groups(res.rollout.samples, seen) == B
        assert len(res.rollout) == B * G
    assert joiners is not None
    assert max(steps) < STALL_BOUND_S, steps
    # the lost quarter was declared dead, the joiners joined and took work
    assert c.pool.counters["died"] == N // HOSTS
    assert c.pool.counters["joined"] == N + 2 + N // HOSTS
    assert len(c.pool.alive("rollout")) == N
    assert c.ledger.counters["reissued"] > 0 and not c.ledger.entries
    assert c.ledger.counters["added"] == c.ledger.counters["trained"] == 4 * B
    joiners.stop()
    assert joiners.error is None and joiners.totals["prompts"] > 0


def test_async_feed_loses_a_quarter_and_takes_joiners(fleet):
    c, hosts, start = fleet
    B, K = N, 1
    feed = OffPolicyFeed(c, iter(items(10_000)), batch_groups=B, max_staleness=K)
    seen: set[int] = set()
    version, gaps, joiners = 0, [], None
    last = time.monotonic()
    deadline = last + 30
    while version < 6:
        assert time.monotonic() < deadline, f"feed stalled: {feed.counters}"
        if version == 2 and joiners is None and feed.counters["admitted"] > (version + 1) * B:
            joiners = lose_a_quarter(hosts, start)
        feed.pump(0.01)
        batch = feed.take_batch(version)
        if batch is None:
            continue
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        check_groups([s for g in batch for s in g.samples], seen)
        feed.abort_stale(next_train_version=version + 1)
        version += 1
        c.pool.weights_pushed(version, [p.name for p in c.pool.alive("rollout")])  # a push without bytes
    feed.check_accounting()
    assert max(gaps) < STALL_BOUND_S, gaps
    assert len(seen) == 6 * B
    assert c.pool.counters["died"] == N // HOSTS and len(c.pool.alive("rollout")) == N
    assert c.ledger.counters["reissued"] > 0  # the lost servers held prompts: generated elsewhere
    counters = feed.close()
    assert counters["trained"] == 6 * B
    joiners.stop()
    assert joiners.error is None and joiners.totals["prompts"] > 0
