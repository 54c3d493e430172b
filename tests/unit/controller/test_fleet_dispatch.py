"""What keeps dispatch flat in the fleet's size and samples uncopied on the way through
(measured by ``bench/fleet.py``, docs/scale.md), checked against what it replaced:

- ``RolloutClient.submit`` places prompts exactly as the loop it replaced (``ServicePool.pick``
  per chunk), but finds the servers with room once per call;
- ``ServicePool.holder`` answers from an index kept by ``send_work`` / ``complete`` / deaths,
  not by asking every peer;
- a rollout server's one-prompt SampleBatch goes into the ledger uncopied, and token ids keep
  the dtype they came in (int32) on their way to a reward service;
- a server lost later in the submit that placed prompts on it leaves them queued, not
  placed on a dead server.
"""

from __future__ import annotations

import math
import random

import msgspec
import pytest
import torch

from common import protocol as P
from learner.controller.batches import concat_samples, split_by_prompt, split_scored_by_prompt
from learner.controller.controller import Controller, scored_samples
from learner.controller.ledger import Entry, PromptLedger, State
from learner.controller.pool import ServicePool
from learner.controller.rollout_client import RolloutClient
from learner.controller.types import PromptItem


class StubEndpoint:
    """Records what the pool sends; every peer is reachable unless named in ``unreachable``."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, P.Message]] = []
        self.unreachable: set[bytes] = set()

    def send(self, msg, to=None, timeout=None):
        from common.transport import PeerUnavailable

        if to in self.unreachable:
            raise PeerUnavailable(f"{to!r} is not connected")
        self.sent.append((to, msg))

    def reply(self, request, msg, to=None):
        msg.call_id = request.call_id
        self.send(msg, to)

    def set_peer_name(self, identity, name):
        pass

    def recv(self, timeout=None):
        return None  # nothing arrives: the tests hand the pool its messages themselves


def fleet(capacities: list[int]) -> tuple[ServicePool, StubEndpoint]:
    ep = StubEndpoint()
    pool = ServicePool(ep, needs_preparation=())
    for i, cap in enumerate(capacities):
        name = f"r{i:03d}"
        pool.handle(
            name.encode(),
            P.Hello(role="rollout", name=name, capabilities=P.RolloutCapabilities(capacity=cap), call_id=1),
        )
    ep.sent.clear()
    return pool, ep


def reference_submit(pool: ServicePool, ep: StubEndpoint, prompt_ids: list[int]) -> list[int]:
    """The placement loop ``RolloutClient.submit`` had: a pick and a pass over the pool per chunk."""
    todo = list(prompt_ids)
    while todo:
        room = [p for p in pool.ready("rollout") if len(p.in_flight) < p.capacity]
        peer = pool.pick("rollout")
        if peer is None:
            break
        take = min(peer.capacity - len(peer.in_flight), math.ceil(len(todo) / len(room)))
        chunk, rest = todo[:take], todo[take:]
        if pool.send_work(peer, P.PromptBatch(prompt_ids=chunk, token_ids=[[1]] * len(chunk)), chunk):
            todo = rest
    return todo


def placements(ep: StubEndpoint) -> list[tuple[bytes, list[int]]]:
    return [(to, msg.prompt_ids) for to, msg in ep.sent if isinstance(msg, P.PromptBatch)]


def test_submit_places_prompts_as_the_pick_per_chunk_loop_did():
    rng = random.Random(0)
    for trial in range(40):
        caps = [rng.choice([1, 1, 2, 4, 16]) for _ in range(rng.choice([1, 3, 8, 64, 256]))]
        loads = [rng.randint(0, c) for c in caps]
        n_prompts = rng.choice([1, 5, 64, 300])
        unreachable = {f"r{i:03d}".encode() for i in range(len(caps)) if rng.random() < 0.05}
        runs = []
        for submit in ("new", "reference"):
            pool, ep = fleet(caps)
            for peer, load in zip(pool.peers.values(), loads, strict=True):
                peer.in_flight.update(("held", peer.name, j) for j in range(load))
            ep.unreachable = unreachable
            ids = list(range(n_prompts))
            if submit == "new":
                left = RolloutClient(ep, pool).submit(ids, [[1]] * n_prompts, P.SamplingParams())
            else:
                left = reference_submit(pool, ep, ids)
            runs.append((placements(ep), left, pool.counters["died"]))
        assert runs[0] == runs[1], f"trial {trial}: capacities {caps}, loads {loads}, {n_prompts} prompts"


def test_submit_spreads_a_batch_over_a_fleet_of_single_slot_servers():
    pool, ep = fleet([1] * 256)
    left = RolloutClient(ep, pool).submit(list(range(300)), [[1]] * 300, P.SamplingParams())
    assert left == list(range(256, 300))
    got = placements(ep)
    assert sorted(to for to, _ in got) == [f"r{i:03d}".encode() for i in range(256)]
    assert all(len(ids) == 1 for _, ids in got)


def test_holder_is_the_peer_the_key_was_last_sent_to():
    pool, ep = fleet([2, 2])
    a, b = pool.peers[b"r000"], pool.peers[b"r001"]
    pool.send_work(a, P.Abort(), [7])
    assert pool.holder(7) is a
    # the ledger gave up on a and re-issued 7 to b; a's late answer completes nothing of b's
    pool.send_work(b, P.Abort(), [7])
    assert pool.holder(7) is b
    pool.complete(a.identity, [7])
    assert pool.holder(7) is b and 7 not in a.in_flight
    pool.complete(b.identity, [7])
    assert pool.holder(7) is None
    pool.send_work(a, P.Abort(), [8, 9])
    pool.mark_dead(a, "test")
    assert pool.holder(8) is None and pool.holder(9) is None
    assert [lw.keys for lw in pool.reap()] == [[8, 9]]
    pool.complete(b"nobody", [8])  # an unknown peer completes nothing


def one_prompt_batch(pid: int, n: int, t: int, dtype=torch.int32) -> P.SampleBatch:
    return P.SampleBatch(
        prompt_ids=[pid] * n,
        sample_indices=list(range(n)),
        response_lengths=[t] * n,
        response_ids=torch.arange(n * t, dtype=dtype) + 100 * pid,
        logprobs=-torch.arange(n * t, dtype=torch.float32) / 10,
        finish_reasons=["stop"] * n,
        policy_versions=[3] * n,
    )


def test_a_one_prompt_batch_goes_into_the_ledger_uncopied():
    b = one_prompt_batch(5, 2, 3)
    assert split_by_prompt(b) == {5: b}
    # two prompts in one batch (a server coalescing answers) are still split by rows
    a, b = one_prompt_batch(1, 2, 3), one_prompt_batch(2, 2, 3)
    two = msgspec.structs.replace(concat_samples([a, b]), logprobs=torch.cat([a.logprobs, b.logprobs]))
    parts = split_by_prompt(two)
    assert sorted(parts) == [1, 2]
    assert parts[2].response_ids.tolist() == (torch.arange(6) + 200).tolist()
    assert parts[2].logprobs.tolist() == one_prompt_batch(2, 2, 3).logprobs.tolist()


def test_token_ids_keep_their_dtype_on_the_way_to_scoring():
    a, b = one_prompt_batch(1, 2, 3), one_prompt_batch(2, 1, 4)
    assert concat_samples([a, b]).response_ids.dtype == torch.int32 and concat_samples([a, b]).logprobs is None
    assert concat_samples([a]).response_ids is a.response_ids  # one batch: nothing to join
    mixed = concat_samples([a, one_prompt_batch(3, 1, 2, dtype=torch.int64)])
    assert mixed.response_ids.dtype == torch.int64
    assert mixed.response_ids.tolist() == a.response_ids.tolist() + (torch.arange(2) + 300).tolist()


def test_scored_samples_are_views_of_the_received_batch():
    sb = one_prompt_batch(4, 2, 3)
    scores = P.ScoredBatch(prompt_ids=[4, 4], sample_indices=[1, 0], rewards=torch.tensor([1.0, 0.0]))
    e = Entry(prompt_id=4, payload=PromptItem(tokens=[9]), samples=sb, scores=scores)
    out = scored_samples(e)
    assert [s.sample_index for s in out] == [0, 1] and [s.reward for s in out] == [0.0, 1.0]
    assert out[1].response.tolist() == [403, 404, 405] and out[1].response.dtype == torch.int32
    assert out[1].rollout_logprobs.tolist() == pytest.approx([-0.3, -0.4, -0.5])
    # No copy of a prompt's tokens or log-probs: the samples hold the received frame's memory.
    assert out[1].response.data_ptr() == sb.response_ids.data_ptr() + 3 * 4
    assert out[0].rollout_logprobs.data_ptr() == sb.logprobs.data_ptr()
    assert out[0].prompt is out[1].prompt is e.payload.tokens  # the group shares its prompt's list


def test_a_prompts_scores_are_a_view_when_its_rows_are_consecutive():
    ref = -torch.arange(12, dtype=torch.float32)
    s = P.ScoredBatch(
        prompt_ids=[1, 1, 2, 3, 2],
        sample_indices=[0, 1, 0, 0, 1],
        rewards=torch.zeros(5),
        ref_logprobs=ref,
        teacher_logprobs=2 * ref,
    )
    parts = split_scored_by_prompt(s, [2, 3, 1, 4, 2])
    assert parts[1].ref_logprobs.tolist() == [0.0, -1.0, -2.0, -3.0, -4.0]
    assert parts[1].ref_logprobs.data_ptr() == ref.data_ptr()  # rows 0-1: a view
    assert parts[2].ref_logprobs.tolist() == [-5.0, -10.0, -11.0]  # rows 2 and 4: joined, a copy
    assert parts[3].ref_logprobs.tolist() == [-6.0, -7.0, -8.0, -9.0]
    assert parts[2].teacher_logprobs.tolist() == [-10.0, -20.0, -22.0]  # a teacher's: the same rows


class FailsTheSecondSend(StubEndpoint):
    """``victim`` takes one PromptBatch, then is unreachable (it went away mid-dispatch)."""

    def __init__(self, victim: bytes) -> None:
        super().__init__()
        self.victim, self.batches = victim, 0

    def send(self, msg, to=None, timeout=None):
        if to == self.victim and isinstance(msg, P.PromptBatch):
            self.batches += 1
            if self.batches > 1:
                self.unreachable.add(to)
        super().send(msg, to, timeout)


def test_a_server_lost_later_in_the_same_submit_leaves_its_earlier_prompts_queued():
    """submit() may send one server several chunks. When a later send to it fails, the pool
    declares it dead with the prompts of its earlier chunk, which submit() had placed: they
    have no holder, so dispatch leaves them queued (the next turn sends them elsewhere) rather
    than failing on the missing holder."""
    ep = FailsTheSecondSend(b"r000")
    pool = ServicePool(ep, needs_preparation=())
    for name, cap in (("r000", 8), ("r001", 1)):
        pool.handle(
            name.encode(),
            P.Hello(role="rollout", name=name, capabilities=P.RolloutCapabilities(capacity=cap), call_id=1),
        )
    c = Controller(
        RolloutClient(ep, pool), PromptLedger(generate_timeout_s=30, score_timeout_s=30), sampling=P.SamplingParams()
    )
    ids = c.add_prompts([PromptItem(tokens=[100 + i]) for i in range(6)])
    # r000 (8 slots) gets 3, r001 (1 slot) 1, then r000 the last 2: that send fails.
    c._dispatch_generation()
    assert placements(ep) == [(b"r000", [0, 1, 2]), (b"r001", [3])]
    assert not pool.peers[b"r000"].alive
    assert [(pid, c.ledger.entries[pid].holder) for pid in ids if c.ledger.entries[pid].state is State.GENERATING] == [
        (3, "r001")
    ]
    assert [e.prompt_id for e in c.ledger.queued()] == [0, 1, 2, 4, 5]
    # The pool hands r000's prompts back as lost; the ledger has them queued already.
    (lost,) = c.rollout.reap()
    assert sorted(lost.keys) == [0, 1, 2] and c.ledger.lost(lost.keys, "gone") == []
