"""RewardClient over a ServicePool: matching replies to requests, errors, late answers,
lost work; and end to end, a reward service killed mid-request costs a resubmission."""

import threading
import time

import pytest
import torch

from common import protocol as P
from common.transport import Endpoint, RemoteError
from helpers.reward_controller import FakeController
from learner.controller.pool import ServicePool
from learner.controller.reward_client import RewardClient, build_score_request

FAULTY = "tests/helpers/reward_faulty.py"


def samples(pids, n=2):
    k = len(pids) * n
    return P.SampleBatch(
        prompt_ids=[p for p in pids for _ in range(n)],
        sample_indices=list(range(n)) * len(pids),
        response_lengths=[2] * k,
        response_ids=torch.arange(2 * k),
    )


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def fake():
    """A pool + client on a real ROUTER, and in-process 'reward services' (DEALERs)."""
    ctrl = Endpoint.bind("tcp://127.0.0.1:0")
    clock = Clock()
    pool = ServicePool(ctrl, peer_timeout_s=5.0, clock=clock)
    svcs = []

    def join(name):
        svc = Endpoint.connect(ctrl.address, name=name)
        svcs.append(svc)
        t = threading.Thread(
            target=lambda: svc.call(
                P.Hello(role="reward", name=name, capabilities=P.RewardCapabilities(capacity=4)), timeout=5
            )
        )
        t.start()
        ident, msg = ctrl.recv(timeout=5)
        assert pool.handle(ident, msg) is None
        t.join()
        return svc

    yield pool, RewardClient(pool, clock=clock), clock, join
    for s in svcs:
        s.close(0)
    ctrl.close(0)


def answer(svc, **kw):
    """The fake service answers the next ScoreRequest (a ScoredBatch unless kw says else)."""
    _, req = svc.recv(timeout=5)
    assert isinstance(req, P.ScoreRequest)
    n = len(req.samples)
    reply = kw.get("reply") or P.ScoredBatch(
        prompt_ids=req.samples.prompt_ids,
        sample_indices=req.samples.sample_indices,
        rewards=torch.ones(n),
        failed=[None] * n,
    )
    svc.reply(req, reply)
    return req


def pump(pool, client, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pool.endpoint.recv(timeout=0.1)
        if got and (msg := pool.handle(*got)) is not None and (out := client.on_message(got[0], msg)):
            return out
    raise TimeoutError


def test_build_score_request_fills_prompt_tokens():
    sb = samples([7, 9])
    req = build_score_request(sb, {7: [1, 2], 9: [3]}, prompts={7: "a", 9: "b"}, labels={7: "x", 9: None})
    assert req.samples.prompt_token_ids == [[1, 2], [1, 2], [3], [3]]
    assert req.prompts == ["a", "a", "b", "b"] and req.labels == ["x", "x", None, None]
    assert torch.equal(req.samples.response_ids, sb.response_ids)


def test_submit_match_and_errors(fake):
    pool, client, _, join = fake
    a, b = join("rw-a"), join("rw-b")
    p1 = client.submit(build_score_request(samples([1]), [[5]] * 2))
    p2 = client.submit(build_score_request(samples([2, 3]), [[5]] * 4))
    assert {p1.peer.name, p2.peer.name} == {"rw-a", "rw-b"}  # least-loaded: one each
    assert pool.peers[p2.peer.identity].in_flight == {2, 3}
    svc_of = {"rw-a": a, "rw-b": b}
    answer(svc_of[p1.peer.name])
    out = pump(pool, client)
    assert out.ok and out.request is p1.request and out.scored.rewards.tolist() == [1.0, 1.0]
    req2 = answer(svc_of[p2.peer.name], reply=P.Error(code="bad_request", message="nope", prompt_ids=[2, 3]))
    out = pump(pool, client)
    assert not out.ok and out.error.code == "bad_request" and out.request.call_id == req2.call_id
    assert client.in_flight == 0 and all(not p.in_flight for p in pool.peers.values())
    assert client.counters == {"sent": 2, "scored": 1, "errors": 1, "lost": 0, "late": 0}


def test_lost_requests_come_back_and_late_answers_are_dropped(fake):
    pool, client, clock, join = fake
    a = join("rw-a")
    p = client.submit(build_score_request(samples([1]), [[5]] * 2))
    clock.t = 6.0  # rw-a silent past the pool's 5 s deadline
    back = client.on_lost(pool.reap())
    assert len(back) == 1 and back[0] is p.request
    assert client.in_flight == 0
    b = join("rw-b")
    again = client.submit(back[0])
    answer(a)  # the declared-dead service answers after all: the pool drops it (and asks for a Hello)
    answer(b)
    out = pump(pool, client)
    assert out.ok and out.request is again.request and out.peer == "rw-b"
    with pytest.raises(TimeoutError):  # nothing else surfaces: rw-a's answer was never matched
        pump(pool, client, timeout=0.5)
    assert client.counters["lost"] == 1 and client.counters["scored"] == 1


def score(client: RewardClient, request: P.ScoreRequest, *, timeout_s: float, max_attempts: int = 3) -> P.ScoredBatch:
    """Sends ``request`` and pumps the pool's endpoint until it is scored, resubmitting it when
    the service holding it dies: what the controller's loop does, for one request."""
    pool = client.pool
    deadline = time.monotonic() + timeout_s
    attempts, ours = 0, None
    while True:
        if ours is None:
            assert attempts < max_attempts, f"ScoreRequest lost {attempts} times"
            ours = client.submit(request)
            attempts += ours is not None
        assert time.monotonic() < deadline, f"no ScoredBatch within {timeout_s} s"
        got = pool.endpoint.recv(timeout=0.1)
        if got is not None and (msg := pool.handle(*got)) is not None:
            out = client.on_message(got[0], msg)
            if out is not None and ours is not None and out.request is ours.request:
                if out.error is not None:
                    raise RemoteError(out.peer, out.error)
                return out.scored
        if ours is not None and any(r is request for r in client.on_lost(pool.reap())):
            ours = None


def test_killed_service_costs_a_resubmission_end_to_end(tmp_path):
    """rw-a (slow: 60 s timeout) takes the request and is SIGKILLed; the pool's heartbeat
    deadline returns the request and rw-b (1 s timeout) answers it with failed samples."""
    ctrl = FakeController(tmp_path)
    pool = ServicePool(ctrl.ep, peer_timeout_s=2.0)
    client = RewardClient(pool)
    try:
        slow, _ = ctrl.spawn("rw-a", "--reward_func", FAULTY, "--timeout_s", "60", "--heartbeat_s", "0.3")
        ctrl.spawn("rw-b", "--reward_func", FAULTY, "--timeout_s", "1", "--heartbeat_s", "0.3")
        deadline = time.monotonic() + 120
        while len(pool.alive("reward")) < 2:
            assert time.monotonic() < deadline, [p.returncode for p in ctrl.procs]
            assert all(p.poll() is None for p in ctrl.procs), (tmp_path / "rw-a.log").read_text()
            got = ctrl.ep.recv(timeout=0.5)
            if got:
                pool.handle(*got)
        sb = samples([1])
        req = build_score_request(sb, [[5]] * 2, prompts=["[sleep] q", "q"], queries=["[sleep] q r", "q r"])
        killer = threading.Timer(1.0, slow.kill)
        killer.start()
        t0 = time.monotonic()
        scored = score(client, req, timeout_s=30)
        killer.join()
        assert time.monotonic() - t0 < 15
        assert all("reward_func timed out after 1 s" in f for f in scored.failed), scored.failed
        assert scored.server == "rw-b" and client.counters["lost"] == 1 and client.counters["sent"] == 2
        ok = score(client, build_score_request(sb, [[5]] * 2, prompts=["q", "q"], queries=["q r", "q r"]), timeout_s=30)
        assert ok.rewards.tolist() == [0.0, 0.0] and ok.failed == [None, None]
        with pytest.raises(RemoteError, match="bad_request: ScoreRequest.prompts has 1 entries for 2 samples"):
            score(client, build_score_request(sb, [[5]] * 2, prompts=["q"]), timeout_s=30)
    finally:
        ctrl.stop()
