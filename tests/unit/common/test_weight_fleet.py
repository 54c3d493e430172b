"""The fleet weight group: one transfer for every server, its membership, and failures in it.

The servers are in-process stand-ins running the real worker-side receive loop (the gloo relay
included), as in ``test_weight_sync.py``; ``helpers.rollout_fakes`` has them. The same push
through real vLLM servers is in ``tests/unit/rollout_service/test_rollout_service.py`` (parity).
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from common import protocol as P
from common.weights.gloo import GlooGroup
from common.weights.publisher import WeightPublisher, WeightSyncError
from helpers.rollout_fakes import FakeControl, FakeServer, TinyLM


@pytest.fixture(autouse=True)
def _fakes_leave_their_groups(monkeypatch):
    """Every stand-in made by a test leaves its group when the test ends. Left to the garbage
    collector, a gloo group can be torn down in the middle of the next test, holding the GIL
    while it does, and stall that test's stand-ins (seen: a connect timing out)."""
    made = []
    init = FakeServer.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(FakeServer, "__init__", recording_init)
    yield
    for s in made:
        s.engine.shutdown()
    gc.collect()


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
    model = TinyLM(vocab=300, dim=32)
    nbytes = sum(p.numel() * 4 for p in model.parameters())  # the tied lm_head is not sent again
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
    model = TinyLM(vocab=300, dim=32)
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
    or stalled peer, the one after it is cut off. The bad one is named within about a timeout
    and a margin; the one cut off is pushed to on its own in the same push -- and so, on gloo, is
    the one before it: a rank whose peer died or whose send timed out has every connection of
    its group closed, its receive from the learner included. The next push forms the fleet
    again without the bad one."""
    model = TinyLM(vocab=2000, dim=64)  # several buckets
    head, bad, tail = FakeServer("head"), FakeServer(f"bad-{behaviour}", behaviour), FakeServer("tail")
    pub = _publisher(model, [head, bad, tail], timeout_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"bad-{behaviour}") as err:
        pub.push(1)
    assert time.monotonic() - t0 < 25  # timeout 5 s: naming within ~10, the retry's pushes after
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


@pytest.mark.parametrize("how", ["refuses", "silent"])
def test_a_fleet_that_cannot_form_falls_back_to_each_servers_own_group(how):
    """A server refusing the fleet's WeightSyncInit, or never answering it, costs the push at
    most the formation's timeouts; every server is then updated on its own group."""
    from concurrent.futures import Future

    class NoFleets(FakeServer):
        def handle(self, msg):
            if isinstance(msg, P.WeightSyncInit) and msg.init_info.get("relay") and how == "silent":
                return Future()  # never answers, never joins
            return super().handle(msg)

        def _handle(self, msg):
            if isinstance(msg, P.WeightSyncInit) and msg.init_info.get("relay"):
                raise RuntimeError("cannot join a fleet")
            return super()._handle(msg)

    model = TinyLM(vocab=300, dim=32)
    a, b = FakeServer("a"), NoFleets("odd")
    pub = _publisher(model, [a, b], timeout_s=4.0)
    t0 = time.monotonic()
    report = pub.push(1)
    assert time.monotonic() - t0 < 25
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

    pub = WeightPublisher(
        TinyLM(vocab=300, dim=32), control=FakeControl([WrongBackend("wb")]), backend="gloo", timeout_s=60.0
    )
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="wb.*started with nccl"):
        pub.connect("wb", workers=1)
    assert time.monotonic() - t0 < 5  # not the 60 s timeout
    assert pub.servers == []


class _Recording(FakeControl):
    """FakeControl that keeps every WeightSyncInit's init_info, per server."""

    def __init__(self, servers):
        super().__init__(servers)
        self.inits: dict[str, list[dict]] = {s.name: [] for s in servers}

    def request(self, server, msg):
        if isinstance(msg, P.WeightSyncInit):
            self.inits[server].append(dict(msg.init_info))
        return super().request(server, msg)


def test_each_server_is_told_its_ranks_in_the_fleet_group():
    servers = [FakeServer(f"s{i}") for i in range(3)]
    pub = WeightPublisher(TinyLM(vocab=300, dim=32), control=_Recording(servers), backend="gloo", timeout_s=10.0)
    for s in servers:
        pub.connect(s.name, workers=1)
    pub.push(1)
    fleet_inits = [pub.control.inits[s.name][-1] for s in servers]
    assert [i["rank_offset"] for i in fleet_inits] == [1, 2, 3]
    assert {i["world_size"] for i in fleet_inits} == {4} and all(i["relay"] for i in fleet_inits)
    assert len({i["master_port"] for i in fleet_inits}) == 1  # one store, one group
    # Own groups (connect) are not relays, and their workers wait twice the learner's timeout.
    own = pub.control.inits["s0"][0]
    assert own["world_size"] == 2 and not own["relay"] and own["timeout_s"] == 20.0
    assert fleet_inits[0]["timeout_s"] == 10.0
    pub.close()


def test_nccl_fleet_init_info_is_vllms_with_the_fleets_world_size():
    """NCCL: the workers run vLLM's own engine, which takes a rank offset and a world size;
    the group is formed only on a GPU host (not here), but what the servers are told is not."""
    from common.weights.nccl import NcclSender

    rv = NcclSender(host="127.0.0.1", bucket_bytes=1 << 20, timeout_s=5.0).listen(1 + 2 + 2, fleet=True)
    assert rv.init_info["world_size"] == 5 and rv.init_info["rank_offset"] == 1 and rv.init_info["packed"]
    assert "relay" not in rv.init_info  # vLLM's NCCL engine rejects fields it does not know


def test_fanout_is_checked():
    with pytest.raises(ValueError, match="unknown fanout 'tree'.*fleet, per_server"):
        WeightPublisher(TinyLM(vocab=300, dim=32), backend="gloo", fanout="tree")


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["", "die"])
def test_zero3_fleet_push_keeps_every_rank_in_step(tiny_model_dir, bad):
    """Two DeepSpeed ZeRO-3 ranks push to three stand-in servers through the fleet group. With a
    server failing in it, rank 0 makes a second pass for the ones it cut off, and rank 1 (told
    so) gathers along: nobody hangs, the good servers get the full checkpoint."""
    import json
    import os
    import subprocess
    import sys

    from common.transport import free_port
    from helpers.paths import HELPERS

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = [sys.executable, str(HELPERS / "rollout_zero3_push.py"), str(tiny_model_dir), "--servers", "3"]
    procs = [
        subprocess.Popen(
            # A dead peer is found when the publisher's timeout runs out; a good push takes ~1 s.
            args + (["--bad", bad, "--timeout_s", "15"] if bad else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(o[-3000:] for o in outs)
    (line,) = [ln for ln in outs[0].splitlines() if ln.startswith("FLEET ")]
    result = json.loads(line[len("FLEET ") :])
    if bad:
        assert result["updated"] == ["r0", "r1"] and result["failed"] == ["r2"] and result["retried"]
    else:
        assert result["fleet"] == ["r0", "r1", "r2"] and result["failed"] == []
    assert result["equal"]


def test_nccl_fleet_push_is_one_broadcast_per_bucket_for_every_server(monkeypatch):
    """The NCCL path, with the communicator faked (no GPU here): the publisher forms one group
    over the three servers (each told its rank offset), then sends every bucket once, as one
    broadcast -- what vLLM's packed NCCL consumer in each worker expects."""
    from concurrent.futures import Future

    from common.weights.base import Rendezvous
    from common.weights.nccl import NcclSender
    from common.weights.wire import bucket_plan
    from helpers.rollout_fakes import _Reply

    broadcasts, worlds = [], []

    class FakeComm:
        def broadcast(self, tensor, src=0):
            broadcasts.append(tensor.numel())

            class Done:
                def wait(self):
                    pass

            return Done()

        def close(self):
            pass

    real_listen = NcclSender.listen

    def listen(self, world_size, *, fleet=False):
        rv = real_listen(self, world_size, fleet=fleet)
        worlds.append((world_size, fleet))
        return Rendezvous(rv.init_info, lambda label: FakeComm())

    monkeypatch.setattr(NcclSender, "listen", listen)

    class AckAll:
        def __init__(self):
            self.inits = {}

        def request(self, server, msg):
            if isinstance(msg, P.WeightSyncInit):
                self.inits.setdefault(server, []).append(msg.init_info)
            fut = Future()
            fut.set_result(P.Ack())
            return _Reply(fut, server, type(msg).__name__)

    model = TinyLM(vocab=300, dim=32)
    pub = WeightPublisher(model, control=AckAll(), backend="nccl", timeout_s=5.0, bucket_bytes=8192)
    for name, workers in (("g0", 1), ("g1", 2), ("g2", 1)):
        pub.connect(name, workers=workers, dtype="float32")
    report = pub.push(1)
    assert report.fleet == ["g0", "g1", "g2"] and not report.failed
    assert worlds[-1] == (1 + 1 + 2 + 1, True)
    assert [pub.control.inits[s][-1]["rank_offset"] for s in ("g0", "g1", "g2")] == [1, 2, 4]
    sizes = [p.numel() * 4 for _, p in model.named_parameters(remove_duplicate=False)]
    assert sum(broadcasts) == sum(sizes)  # every byte once, for all three servers
    assert len(broadcasts) == len(bucket_plan(sizes, 8192)) > 1  # one broadcast per bucket
    pub.close()


@pytest.mark.slow
def test_zero3_delta_push_keeps_every_rank_in_step(tiny_model_dir):
    """--weight_sync delta under ZeRO-3: the delta's encode pass (before the metadata) gathers
    on both ranks in step, rank 0 sends the three changed values through the fleet group, and
    both servers end with the changed checkpoint."""
    import json
    import os
    import subprocess
    import sys

    from common.transport import free_port
    from helpers.paths import HELPERS

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = [sys.executable, str(HELPERS / "rollout_zero3_push.py"), str(tiny_model_dir), "--servers", "2"]
    procs = [
        subprocess.Popen(
            args + ["--sync", "delta"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(o[-3000:] for o in outs)
    (line,) = [ln for ln in outs[0].splitlines() if ln.startswith("DELTA ")]
    result = json.loads(line[len("DELTA ") :])
    assert result["encodings"] == ["full", "delta"] and result["changed"] == 3
    assert result["fleet"] == ["r0", "r1"] and result["equal"]
