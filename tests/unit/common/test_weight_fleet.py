"""The fleet weight group: one transfer for every server, its membership, and failures in it.

The servers are in-process stand-ins running the real worker-side receive loop (the gloo relay
included), as in ``test_weight_sync.py``; ``helpers.rollout_fakes`` has them. The same push
through real vLLM servers is ``tests/unit/rollout_service/test_weight_fleet_servers.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

from common import protocol as P
from common.weights.gloo import GlooGroup
from common.weights.publisher import WeightPublisher, WeightSyncError
from helpers.rollout_fakes import FakeControl, FakeServer


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=300, dim=32):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(2))
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


@pytest.fixture
def sent(monkeypatch):
    """Bytes the learner (rank 0) puts on the wire, over every group."""
    count = {"bytes": 0}
    send, bcast = GlooGroup.send, GlooGroup.broadcast

    def counting_send(self, tensor, dst):
        if self.rank == 0:
            count["bytes"] += tensor.numel() * tensor.element_size()
        return send(self, tensor, dst)

    def counting_bcast(self, tensor, src=0):
        if self.rank == 0:
            count["bytes"] += tensor.numel() * tensor.element_size()
        return bcast(self, tensor, src)

    monkeypatch.setattr(GlooGroup, "send", counting_send)
    monkeypatch.setattr(GlooGroup, "broadcast", counting_bcast)
    return count


def _publisher(model, servers, fanout="fleet", timeout_s=10.0):
    pub = WeightPublisher(
        model, control=FakeControl(servers), backend="gloo", timeout_s=timeout_s, bucket_bytes=8192, fanout=fanout
    )
    pub.segment_bytes = 2048  # big tensors go out on their own: segments and pieces both exercised
    pub.sender.relay_chunk_bytes = 1000  # several pieces per segment, not aligned to tensors
    for s in servers:
        pub.connect(s.name, workers=1, dtype="float32")
    return pub


def _assert_has(server, model):
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(server.model.loaded[name], p.detach()), (server.name, name)


def test_fleet_push_costs_the_learner_one_copy_whatever_the_number_of_servers(sent):
    model = TinyLM()
    nbytes = sum(p.numel() * 4 for _, p in model.named_parameters(remove_duplicate=False))
    per_n = {}
    for n in (1, 2, 4):
        servers = [FakeServer(f"s{i}") for i in range(n)]
        pub = _publisher(model, servers)
        sent["bytes"] = 0
        report = pub.push(1)
        per_n[n] = sent["bytes"]
        assert sorted(report.updated) == sorted(s.name for s in servers) and not report.failed
        assert report.fleet == ([] if n == 1 else [s.name for s in servers])  # one server: its own group
        for s in servers:
            assert s.version == 1
            _assert_has(s, model)
        pub.close()
    assert per_n == {1: nbytes, 2: nbytes, 4: nbytes}

    servers = [FakeServer(f"p{i}") for i in range(4)]
    pub = _publisher(model, servers, fanout="per_server")  # the old design, for contrast
    sent["bytes"] = 0
    pub.push(1)
    assert sent["bytes"] == 4 * nbytes and pub.fleet is None
    pub.close()


def test_the_fleet_is_formed_again_only_when_its_membership_changes():
    model = TinyLM()
    a, b, c = FakeServer("a"), FakeServer("b"), FakeServer("c")
    pub = _publisher(model, [a, b])
    pub.control.servers["c"] = c
    pub.push(1)
    pub.push(2)
    assert pub.fleet.members == ["a", "b"] and pub.fleet_builds == 1  # same members: same group
    # A joiner between pushes is brought up to date alone, on its own group...
    pub.connect("c", workers=1)
    with torch.no_grad():
        model.layers[0].weight.add_(1.0)
    report = pub.push(2, ["c"])
    assert report.updated == ["c"] and report.fleet == [] and c.version == 2
    _assert_has(c, model)
    assert pub.fleet.members == ["a", "b"] and pub.fleet_builds == 1  # ...and waits for the next rebuild
    report = pub.push(3)
    assert sorted(report.fleet) == ["a", "b", "c"] and pub.fleet_builds == 2
    for s in (a, b, c):
        assert s.version == 3
        _assert_has(s, model)
    # A server that leaves takes the fleet group with it; the next push forms it without it.
    pub.disconnect("b")
    assert pub.fleet is None
    report = pub.push(4)
    assert report.fleet == ["a", "c"] and pub.fleet_builds == 3 and b.version == 3
    pub.close()


@pytest.mark.parametrize("behaviour", ["stall", "die"])
def test_a_server_failing_mid_push_aborts_only_that_push_and_only_for_itself(behaviour):
    """The bad server sits in the middle of the relay: the one before it passes on to a dead
    or stalled peer, the one after it is cut off. The bad one is named within about two
    timeouts; the one cut off is pushed to on its own in the same push -- and so, on gloo, is
    the one before it: a rank whose peer died or whose send timed out has every connection of
    its group closed, its receive from the learner included. The next push forms the fleet
    again without the bad one."""
    model = TinyLM(vocab=2000, dim=64)  # several buckets
    head, bad, tail = FakeServer("head"), FakeServer(f"bad-{behaviour}", behaviour), FakeServer("tail")
    pub = _publisher(model, [head, bad, tail], timeout_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"bad-{behaviour}") as err:
        pub.push(1)
    assert time.monotonic() - t0 < 30
    assert list(err.value.failures) == [bad.name]
    report = err.value.report
    assert sorted(report.updated) == ["head", "tail"] and "tail" in report.retried
    assert {"head", "tail"} <= set(report.fleet) | set(report.retried) and not set(report.fleet) & set(report.retried)
    for s in (head, tail):
        assert s.version == 1
        _assert_has(s, model)
    assert pub.servers == ["head", "tail"] and pub.fleet is None  # the broken group is dropped
    with torch.no_grad():
        model.layers[1].weight.mul_(2.0)
    report = pub.push(2)
    assert report.fleet == ["head", "tail"] and not report.retried and pub.fleet_builds == 2
    for s in (head, tail):
        assert s.version == 2
        _assert_has(s, model)
    pub.close()


def test_a_fleet_that_cannot_form_falls_back_to_each_servers_own_group():
    """A server refusing the fleet's WeightSyncInit (here: one that never answers it) costs the
    push the formation's timeout; the others are then updated on their own groups."""

    class RefusesFleets(FakeServer):
        def _handle(self, msg):
            if isinstance(msg, P.WeightSyncInit) and msg.init_info.get("relay"):
                raise RuntimeError("cannot join a fleet")
            return super()._handle(msg)

    model = TinyLM()
    a, b = FakeServer("a"), RefusesFleets("odd")
    pub = _publisher(model, [a, b], timeout_s=3.0)
    report = pub.push(1)
    assert sorted(report.updated) == ["a", "odd"] and report.fleet == [] and pub.fleet is None
    for s in (a, b):
        assert s.version == 1
        _assert_has(s, model)
    pub.close()


def test_connect_fails_fast_with_the_servers_error():
    class WrongBackend(FakeServer):
        def _handle(self, msg):
            if isinstance(msg, P.WeightSyncInit):
                raise ValueError("learner pushes weights over 'gloo', this server was started with nccl")
            return super()._handle(msg)

    pub = WeightPublisher(TinyLM(), control=FakeControl([WrongBackend("wb")]), backend="gloo", timeout_s=60.0)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="wb.*started with nccl"):
        pub.connect("wb", workers=1)
    assert time.monotonic() - t0 < 5  # not the 60 s timeout
    assert pub.servers == []
