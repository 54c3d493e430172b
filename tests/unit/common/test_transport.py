"""The transport over real sockets: delivery, calls with deadlines, bad peers, fuzzing."""

import asyncio
import logging
import random
import threading
import time

import pytest
import torch
import zmq

from common import protocol as P
from common.transport import (
    AsyncEndpoint,
    CallTimeout,
    Endpoint,
    HandshakeFailed,
    PeerUnavailable,
    RemoteError,
    TransportError,
    ahandshake,
    handshake,
)


@pytest.fixture
def ctrl():
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    yield ep
    ep.close(0)


def serve_hello(ctrl, n=1, timeout=5.0):
    """Controller side: answer n Hellos with Welcome (or the version error)."""
    for _ in range(n):
        ident, msg = ctrl.recv(timeout=timeout)
        assert isinstance(msg, P.Hello)
        ctrl.set_peer_name(ident, msg.name)
        ctrl.reply(msg, P.version_error(msg) or P.Welcome(peer_id=msg.name, policy_version=3), to=ident)


def test_handshake_and_batches_both_ways(ctrl):
    svc = Endpoint.connect(ctrl.address, name="rollout-a")
    t = threading.Thread(target=serve_hello, args=(ctrl,))
    t.start()
    welcome = handshake(svc, "rollout", P.RolloutCapabilities(capacity=8), timeout=5)
    t.join()
    assert welcome.policy_version == 3 and welcome.peer_id == "rollout-a"

    ctrl.send(P.PromptBatch(prompt_ids=[1], token_ids=[[4, 5]]), to=b"rollout-a")
    _, got = svc.recv(timeout=5)
    assert got.token_ids == [[4, 5]]
    svc.send(
        P.SampleBatch(
            prompt_ids=[1],
            sample_indices=[0],
            response_lengths=[3],
            response_ids=torch.tensor([1, 2, 3]),
            logprobs=torch.tensor([-1.0, -2.0, -3.0]),
        )
    )
    ident, sb = ctrl.recv(timeout=5)
    assert ident == b"rollout-a" and sb.response_ids.tolist() == [1, 2, 3]
    svc.close(0)


def test_version_mismatch_is_a_clear_error(ctrl):
    svc = Endpoint.connect(ctrl.address, name="old")
    t = threading.Thread(target=serve_hello, args=(ctrl,))
    t.start()
    with pytest.raises(RemoteError, match="protocol 0, controller speaks"):
        svc.call(P.Hello(role="rollout", name="old", protocol_version=0), timeout=5)
    t.join()
    svc.close(0)


def test_call_times_out_naming_the_peer_and_keeps_other_messages(ctrl):
    svc = Endpoint.connect(ctrl.address, name="slow-svc")
    svc.send(P.Heartbeat(name="slow-svc"))
    ident, _ = ctrl.recv(timeout=5)
    ctrl.set_peer_name(ident, "slow-svc")
    svc.send(P.Heartbeat(name="slow-svc", seq=1))  # arrives while the controller waits
    t0 = time.monotonic()
    with pytest.raises(CallTimeout, match="no reply from slow-svc"):
        ctrl.call(P.Shutdown(reason="x"), to=ident, timeout=0.5)
    assert time.monotonic() - t0 < 2
    _, hb = ctrl.recv(timeout=1)  # the heartbeat that came during the call was kept
    assert isinstance(hb, P.Heartbeat) and hb.seq == 1
    svc.close(0)


def test_send_to_unknown_peer_raises(ctrl):
    with pytest.raises(PeerUnavailable, match="ghost is not connected"):
        ctrl.send(P.Shutdown(), to=b"ghost")


def test_fuzz_malformed_frames_endpoint_survives(ctrl):
    """1,000+ malformed frames at a live endpoint: each rejected and counted; it still serves."""
    rng = random.Random(0)
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"fuzzer")
    raw.connect(ctrl.address)
    good = P.Codec().encode(
        P.SampleBatch(
            prompt_ids=[1, 2],
            sample_indices=[0, 0],
            response_lengths=[2, 1],
            response_ids=torch.tensor([5, 6, 7]),
            logprobs=torch.zeros(3),
        )
    )
    good = [bytes(memoryview(f)) for f in good]
    tags = sorted(P.message_types())

    def garbage():
        kind = rng.randrange(8)
        if kind == 0:
            return [rng.randbytes(rng.randrange(0, 64))]  # one frame: truncated
        if kind == 1:
            return [bytes([rng.randrange(256)]), rng.randbytes(rng.randrange(0, 200))]
        if kind == 2:
            return [bytes([rng.choice(tags)]), rng.randbytes(rng.randrange(0, 200))]
        if kind == 3:  # good header, buffers corrupted or missing
            return good[:2] + [rng.randbytes(rng.randrange(0, 16)) for _ in range(rng.randrange(0, 3))]
        if kind == 4:  # bit flips in a good header
            h = bytearray(good[1])
            for _ in range(rng.randrange(1, 4)):
                h[rng.randrange(len(h))] ^= 1 << rng.randrange(8)
            return [good[0], bytes(h), *good[2:]]
        if kind == 5:  # truncated header
            return [good[0], good[1][: rng.randrange(len(good[1]))], *good[2:]]
        if kind == 6:  # wrong tag for the header
            return [bytes([P.Hello.TAG]), good[1], *good[2:]]
        return [rng.randbytes(2), b"", b""]  # two-byte tag

    n = 1200
    for _ in range(n):
        raw.send_multipart(garbage())
    deadline = time.monotonic() + 20
    while ctrl.stats["rejected"] + ctrl.stats["received"] < n and time.monotonic() < deadline:
        ctrl.recv(timeout=0.2)
    assert ctrl.stats["rejected"] >= 1000  # the odd bit flip can still be a valid message
    # rejected senders get an Error answer
    assert raw.poll(2000)
    err = P.Codec().decode(raw.recv_multipart())
    assert isinstance(err, P.Error) and err.code == "bad_request"
    # ...and the endpoint still answers a valid request
    svc = Endpoint.connect(ctrl.address, name="after-fuzz")
    t = threading.Thread(target=serve_hello, args=(ctrl,), kwargs={"timeout": 10})
    t.start()
    assert handshake(svc, "rollout", None, timeout=10).peer_id == "after-fuzz"
    t.join()
    raw.close(0)
    svc.close(0)


def test_service_side_rejects_garbage_from_controller_too():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    svc = Endpoint.connect(f"tcp://127.0.0.1:{port}", name="svc")
    svc.send(P.Heartbeat(name="svc"))
    ident = router.recv_multipart()[0]
    router.send_multipart([ident, b"\x99", b"junk"])
    router.send_multipart([ident, *P.Codec().encode(P.Shutdown(reason="bye"))])
    _, msg = svc.recv(timeout=5)
    assert isinstance(msg, P.Shutdown) and svc.stats["rejected"] == 1
    svc.close(0)
    router.close(0)


def test_async_endpoint_handshake_and_timeout(ctrl):
    async def main():
        svc = AsyncEndpoint(ctrl.address, name="async-svc")
        t = threading.Thread(target=serve_hello, args=(ctrl,))
        t.start()
        w = await ahandshake(svc, "rollout", None, timeout=5)
        t.join()
        assert w.peer_id == "async-svc"
        ctrl.send(P.PromptBatch(prompt_ids=[3], token_ids=[[1]]), to=b"async-svc")
        msg = await svc.recv(timeout=5)
        assert msg.prompt_ids == [3]
        assert await svc.recv(timeout=0.1) is None
        svc.close(0)

        lonely = AsyncEndpoint("tcp://127.0.0.1:1", name="lonely")
        with pytest.raises((CallTimeout, TransportError), match="lonely"):
            await ahandshake(lonely, "rollout", None, timeout=0.5)
        lonely.close(0)

    asyncio.run(main())


def test_hostile_identities_are_logged_as_hex_and_rejections_rate_limited_per_peer(ctrl, caplog):
    """A peer picks its own identity: raw control bytes must not reach the log (1,000 random
    frames once made the learner's log a binary file for grep). A flood from one peer is
    summarised; another peer's first rejection is still logged."""
    import logging

    ctx = zmq.Context.instance()
    hostile = ctx.socket(zmq.DEALER)
    hostile.setsockopt(zmq.IDENTITY, b"\x1b[2J\n\x00evil\xff")
    hostile.connect(ctrl.address)
    other = ctx.socket(zmq.DEALER)
    other.setsockopt(zmq.IDENTITY, b"honest-but-buggy")
    other.connect(ctrl.address)
    caplog.set_level(logging.ERROR, logger="common.transport")
    for _ in range(300):
        hostile.send_multipart([b"\x07", b"\x00\x01garbage"])
    deadline = time.monotonic() + 20
    while ctrl.stats["rejected"] < 300 and time.monotonic() < deadline:
        ctrl.recv(timeout=0.2)
    other.send_multipart([b"\x07", b"junk"])
    deadline = time.monotonic() + 10
    while ctrl.stats["rejected"] < 301 and time.monotonic() < deadline:
        ctrl.recv(timeout=0.2)
    lines = [r.getMessage() for r in caplog.records]
    assert all(line.isprintable() for line in lines), [line for line in lines if not line.isprintable()][:2]
    hostile_lines = [line for line in lines if "0x1b5b324a0a006576696cff" in line]
    assert 1 <= len(hostile_lines) <= 21  # the burst, then at most a summary per interval
    assert any("honest-but-buggy" in line for line in lines)
    hostile.close(0)
    other.close(0)


def test_safe_label_keeps_names_and_hexes_the_rest():
    from common.transport import safe_label

    assert safe_label(b"rollout-0") == "rollout-0"
    assert safe_label(b"\x00\x01") == "0x0001"
    assert safe_label(b"a\nb") == "0x610a62"
    assert safe_label(bytes(100)).endswith("...") and len(safe_label(bytes(100))) == 2 + 64 + 3


def test_no_controller_is_not_reported_as_a_failed_handshake():
    """Nothing listens: the plain "not connected" error, no talk of keys (test_auth.py has the
    keys that do not match)."""
    svc = Endpoint.connect("tcp://127.0.0.1:1", name="alone")
    with pytest.raises(PeerUnavailable, match="not connected or not reading") as err:
        handshake(svc, "rollout", None, timeout=0.5)
    assert not isinstance(err.value, HandshakeFailed) and svc.handshake_failure() is None
    svc.close(0)


def test_a_controller_open_to_other_hosts_without_keys_warns_once(caplog, tmp_path):
    from common.auth import keygen, warn_if_open

    caplog.set_level(logging.WARNING, logger="common.auth")
    open_ep = Endpoint.bind("tcp://0.0.0.0:0")
    warned = [r.message for r in caplog.records if "without keys" in r.message]
    assert len(warned) == 1 and open_ep.address in warned[0], warned
    assert "anyone who can reach this port can join" in warned[0]
    assert "python -m common.auth keygen DIR" in warned[0] and "--auth_dir DIR" in warned[0]
    assert warn_if_open(open_ep.address)  # asked again (a restarted loop): not said again
    assert len([r for r in caplog.records if "without keys" in r.message]) == 1
    open_ep.close(0)

    caplog.clear()
    local = Endpoint.bind("tcp://127.0.0.1:0")  # one host: nobody else can reach it
    keyed = Endpoint.bind("tcp://0.0.0.0:0", auth_dir=str(keygen(tmp_path / "keys")))
    assert not [r for r in caplog.records if "without keys" in r.message]
    local.close(0)
    keyed.close(0)
