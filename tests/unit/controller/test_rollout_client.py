"""RolloutClient over real sockets with scripted services (no vLLM): dispatch by capacity, replies
routed to the waiting call while other traffic is kept, dead servers named fast, lost work."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from common import protocol as P
from common.transport import Endpoint, PeerUnavailable, RemoteError
from learner.controller.pool import ServicePool
from learner.controller.rollout_client import RolloutClient
from learner.controller.weight_fleet import FleetWeights


class Scripted:
    """A rollout service on a thread: answers GetHealth, echoes each prompt as a one-token sample."""

    def __init__(self, address: str, name: str, capacity: int) -> None:
        self.name, self.capacity = name, capacity
        self.ep = Endpoint.connect(address, name=name)
        self.got: list[int] = []
        self.stop = threading.Event()
        self.mute = False  # stop answering calls (but keep heartbeating)
        self.refuse_weights = ""  # answer WeightSyncInit with this error (a server that cannot join)
        self.hold = False  # take prompts, never answer them (a server mid-generation)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self) -> Scripted:
        self.ep.call(
            P.Hello(
                role="rollout", name=self.name, capabilities=P.RolloutCapabilities(capacity=self.capacity, workers=1)
            ),
            timeout=10,
        )
        self.thread.start()
        return self

    def run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            self.ep.send(P.Heartbeat(name=self.name, seq=seq))
            seq += 1
            got = self.ep.recv(timeout=0.05)
            if got is None:
                continue
            msg = got[1]
            if isinstance(msg, P.PromptBatch):
                self.got.extend(msg.prompt_ids)
                for pid in [] if self.hold else msg.prompt_ids:
                    self.ep.send(
                        P.SampleBatch(
                            prompt_ids=[pid],
                            sample_indices=[0],
                            response_lengths=[1],
                            response_ids=np.array([pid], dtype=np.int32),
                            finish_reasons=["length"],
                            policy_versions=[0],
                            server=self.name,
                        )
                    )
            elif isinstance(msg, P.GetHealth) and not self.mute:
                self.ep.reply(msg, P.Health(name=self.name, state="serving"))
            elif isinstance(msg, P.Pause) and not self.mute:
                self.ep.reply(msg, P.Error(code="bad_request", message="no"))
            elif isinstance(msg, P.WeightSyncInit) and self.refuse_weights:
                self.ep.reply(msg, P.Error(code="internal", message=self.refuse_weights))

    def freeze(self) -> None:
        """Hung process: the connection stays up, nothing more is said."""
        self.stop.set()
        self.thread.join(5)

    def die(self, announce: bool) -> None:
        self.freeze()
        if announce:
            self.ep.send(P.Error(code="fatal", message=f"{self.name}: engine died"))
        self.ep.close(0)


@pytest.fixture
def ctl():
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    pool = ServicePool(ep, peer_timeout_s=1.0)
    client = RolloutClient(ep, pool, call_timeout_s=5.0)
    fleet = FleetWeights(pool)  # no publisher: a joiner is ready once it is taken
    services: list[Scripted] = []

    def join(name, capacity):
        s = Scripted(ep.address, name, capacity)
        t = threading.Thread(target=s.start)
        t.start()
        deadline = time.monotonic() + 10
        while name not in client.servers() and time.monotonic() < deadline:
            client.poll(0.05)
            fleet.sync_joiners()
        t.join(10)
        services.append(s)
        return s

    yield client, join
    for s in services:
        if not s.stop.is_set():
            s.die(announce=False)
    ep.close(0)


def test_submit_spreads_by_capacity_and_poll_returns_samples(ctl):
    client, join = ctl
    a, b = join("a", 4), join("b", 4)
    unplaced = client.submit(list(range(10)), [[1, 2]] * 10, P.SamplingParams())
    assert unplaced == [8, 9]  # 4 + 4 fit
    assert len(client.peer("a").in_flight) == 4 and len(client.peer("b").in_flight) == 4
    results = {}
    deadline = time.monotonic() + 10
    while len(results) < 8 and time.monotonic() < deadline:
        for ident, msg in client.poll(0.05):
            results.update({pid: ident for pid in msg.prompt_ids})
    assert sorted(results) == list(range(8))
    assert not client.peer("a").in_flight and not client.peer("b").in_flight  # done: room again
    assert not client.submit([8, 9], [[1]] * 2, P.SamplingParams())
    deadline = time.monotonic() + 5
    while len(a.got + b.got) < 10 and time.monotonic() < deadline:
        client.poll(0.05)
    assert sorted(a.got + b.got) == list(range(10))


def test_calls_get_their_reply_while_other_traffic_is_kept(ctl):
    client, join = ctl
    join("a", 8)
    client.submit([1, 2, 3], [[5]] * 3, P.SamplingParams())
    health = client.call("a", P.GetHealth())  # samples arrive meanwhile: kept for poll, not lost
    assert isinstance(health, P.Health) and health.name == "a"
    with pytest.raises(RemoteError, match="a answered bad_request"):
        client.call("a", P.Pause())
    got = []
    deadline = time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < deadline:
        got += [m for _, m in client.poll(0.05) if isinstance(m, P.SampleBatch)]
    assert sorted(m.prompt_ids[0] for m in got) == [1, 2, 3]


def test_a_dead_server_is_named_fast_and_its_prompts_come_back(ctl):
    client, join = ctl
    a, b = join("a", 2), join("b", 2)
    a.mute = b.mute = True
    a.hold = b.hold = True
    client.submit(list(range(4)), [[1]] * 4, P.SamplingParams())
    held_b = set(client.peer("b").in_flight)
    assert len(held_b) == 2
    # b hangs (no fatal notice): a call to it fails at the heartbeat deadline, not the call's.
    b.freeze()
    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable, match="b is gone"):
        client.call("b", P.GetHealth(), timeout=30)
    assert time.monotonic() - t0 < 5
    lost = client.reap()
    assert [(lw.peer.name, set(lw.keys)) for lw in lost] == [("b", held_b)]
    with pytest.raises(PeerUnavailable, match="b"):  # and a gone socket fails at once
        b.ep.close(0)
        time.sleep(0.2)
        client.call("b", P.GetHealth(), timeout=30)
    # a announces a fatal error: declared dead at once.
    a.die(announce=True)
    deadline = time.monotonic() + 5
    while client.servers() and time.monotonic() < deadline:
        client.poll(0.05)
    assert client.servers() == []
    assert [(lw.reason, len(lw.keys)) for lw in client.reap()] == [("announced a fatal error: a: engine died", 2)]


def test_a_controller_busy_past_the_peer_timeout_reads_the_heartbeats_waiting_for_it_first(ctl):
    """The learner trains for longer than the peer timeout (a big model's step) and reads nothing
    meanwhile; its servers heartbeat all along, into the socket. Its next call (a weight push's
    WeightUpdateStart) reads what waited before it judges anyone's silence: the servers are
    alive, and the call gets its reply. (It once declared the whole fleet dead there, and the
    push failed for every server.) A server that really went silent is still declared dead."""
    client, join = ctl
    join("a", 2)
    b = join("b", 2)
    b.freeze()  # hung: silent from here on
    time.sleep(1.5)  # the controller is busy: peer timeout 1.0 s, a's heartbeats wait in the socket
    assert isinstance(client.call("a", P.GetHealth(), timeout=5), P.Health)
    assert client.peer("a").alive
    # b's last heartbeats were read just now too: its silence counts from there.
    deadline, lost = time.monotonic() + 5, []
    while not lost and time.monotonic() < deadline:
        client.poll(0.05)
        lost = client.reap()
    assert [lw.peer.name for lw in lost] == ["b"] and client.servers() == ["a"]


def test_a_joiner_that_answers_its_weight_group_with_an_error_fails_at_once_with_its_message():
    """The publisher's rendezvous would wait out its whole timeout (60 s here) for workers that
    will never join: the server's Error reply ends it at once, quoted, and the server is
    declared dead with it (it says Hello again to retry)."""
    from common.weights.publisher import WeightPublisher
    from helpers.rollout_fakes import TinyLM

    ep = Endpoint.bind("tcp://127.0.0.1:0")
    pool = ServicePool(ep, peer_timeout_s=30.0)
    client = RolloutClient(ep, pool, call_timeout_s=5.0)
    fleet = FleetWeights(pool, WeightPublisher(TinyLM(), control=client, backend="gloo", timeout_s=60.0))
    s = Scripted(ep.address, "refuser", 4)
    s.refuse_weights = "this server pushes weights over nccl, the learner over gloo"
    starter = threading.Thread(target=s.start)
    starter.start()
    deadline = time.monotonic() + 10
    while not pool.peers and time.monotonic() < deadline:
        client.poll(0.05)
    starter.join(10)
    t0 = time.monotonic()
    assert fleet.sync_joiners() == []
    assert time.monotonic() - t0 < 5  # not the 60 s rendezvous timeout
    peer = client.peer("refuser")
    assert not peer.alive and not peer.ready
    [lost] = client.reap()
    assert lost.peer is peer and "refuser answered internal: this server pushes weights over nccl" in lost.reason
    assert fleet.publisher.servers == []
    s.die(announce=False)
    ep.close(0)
