"""ServicePool: handshake, dispatch by load, and lost work when a peer dies or restarts."""

import pytest

from common import protocol as P
from common.transport import Endpoint
from learner.controller.pool import ServicePool


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def setup():
    ctrl = Endpoint.bind("tcp://127.0.0.1:0")
    clock = Clock()
    pool = ServicePool(ctrl, peer_timeout_s=5.0, clock=clock)
    svcs = []
    yield ctrl, pool, clock, svcs
    for s in svcs:
        s.close(0)
    ctrl.close(0)


def join(ctrl, pool, svcs, name, role="rollout", capacity=2, version=P.PROTOCOL_VERSION):
    import threading

    svc = Endpoint.connect(ctrl.address, name=name)
    svcs.append(svc)
    out = {}

    def run():
        try:
            out["w"] = svc.call(
                P.Hello(
                    role=role,
                    name=name,
                    protocol_version=version,
                    capabilities=P.RolloutCapabilities(capacity=capacity)
                    if role == "rollout"
                    else P.RewardCapabilities(capacity=capacity),
                ),
                timeout=5,
            )
        except Exception as e:  # noqa: BLE001 - surfaced below
            out["e"] = e

    t = threading.Thread(target=run)
    t.start()
    ident, msg = ctrl.recv(timeout=5)
    assert pool.handle(ident, msg) is None
    t.join()
    return svc, ident, out


def test_join_dispatch_and_complete(setup):
    ctrl, pool, clock, svcs = setup
    _, a, out = join(ctrl, pool, svcs, "a", capacity=2)
    assert isinstance(out["w"], P.Welcome)
    _, b, _ = join(ctrl, pool, svcs, "b", capacity=1)
    assert pool.pick("rollout") is None  # rollout peers need weights first
    for p in pool.take_joined():
        p.ready = True
    picks = []
    for key in range(3):
        peer = pool.pick("rollout")
        picks.append(peer.name)
        assert pool.send_work(peer, P.PromptBatch(prompt_ids=[key], token_ids=[[1]]), [key])
    # a: 0/2 -> b: 0/1 ... least relative load, ties by name
    assert picks == ["a", "b", "a"]
    assert pool.pick("rollout") is None  # everybody full
    pool.complete(b, [1])
    assert pool.pick("rollout").name == "b"


def test_silent_peer_is_reaped_with_its_work(setup):
    ctrl, pool, clock, svcs = setup
    _, a, _ = join(ctrl, pool, svcs, "a", role="reward", capacity=4)
    peer = pool.pick("reward")
    pool.send_work(peer, P.Shutdown(), ["r1", "r2"])
    clock.t = 4.0
    assert pool.reap() == []
    pool.handle(a, P.Heartbeat(name="a"))  # keeps it alive
    clock.t = 8.0
    assert pool.reap() == []
    clock.t = 9.5
    lost = pool.reap()
    assert len(lost) == 1 and sorted(lost[0].keys) == ["r1", "r2"] and "no message for 5.5 s" in lost[0].reason
    assert pool.pick("reward") is None and pool.counters["lost_keys"] == 2


def test_fatal_error_and_restart_release_work(setup):
    ctrl, pool, clock, svcs = setup
    _, a, _ = join(ctrl, pool, svcs, "a", role="reward")
    pool.send_work(pool.pick("reward"), P.Shutdown(), [7])
    pool.handle(a, P.Error(code="fatal", message="CUDA OOM"))
    (lost,) = pool.reap()
    assert lost.keys == [7] and "CUDA OOM" in lost.reason
    # it comes back under the same identity: welcomed again, holding nothing
    _, a2, _ = join(ctrl, pool, svcs, "a", role="reward")
    assert pool.pick("reward").name == "a"
    pool.send_work(pool.pick("reward"), P.Shutdown(), [8])
    _, a3, _ = join(ctrl, pool, svcs, "a", role="reward")  # restarted again before we noticed
    (lost,) = pool.reap()
    assert lost.keys == [8] and "restarted" in lost.reason


def test_version_mismatch_rejected(setup):
    ctrl, pool, clock, svcs = setup
    _, _, out = join(ctrl, pool, svcs, "old", version=P.PROTOCOL_VERSION + 1)
    assert "speaks protocol" in str(out["e"])
    assert pool.alive() == [] and pool.counters["rejected_hello"] == 1


def test_the_runs_own_check_refuses_a_peer_and_says_why(setup):
    ctrl, _, clock, svcs = setup

    def admit(hello):
        return P.Error(code="bad_request", message=f"{hello.name} runs no agent") if hello.role == "rollout" else None

    pool = ServicePool(ctrl, peer_timeout_s=5.0, clock=clock, admit=admit)
    _, _, out = join(ctrl, pool, svcs, "r0")
    assert "r0 runs no agent" in str(out["e"])
    assert pool.alive() == [] and pool.refused == {"r0": "r0 runs no agent"}
    join(ctrl, pool, svcs, "rw0", role="reward")
    assert [p.name for p in pool.alive()] == ["rw0"]


def test_results_from_unknown_peer_are_not_returned(setup):
    ctrl, pool, clock, svcs = setup
    assert pool.handle(b"ghost", P.Heartbeat(name="ghost")) is None


def test_a_heartbeats_capacity_is_what_the_peer_is_sent(setup):
    # a rollout server whose environment workers died says so: capacity 0 gets it no work,
    # and its capacity comes back with them
    ctrl, pool, clock, svcs = setup
    _, a, _ = join(ctrl, pool, svcs, "a", capacity=4)
    for p in pool.take_joined():
        p.ready = True
    pool.handle(a, P.Heartbeat(name="a", stats={"capacity": 0.0}))
    assert pool.pick("rollout") is None
    pool.handle(a, P.Heartbeat(name="a", stats={"capacity": 2.0}))
    peer = pool.pick("rollout")
    assert peer.name == "a" and peer.capacity == 2 and peer.load == 0
