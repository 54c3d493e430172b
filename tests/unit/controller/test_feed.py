"""The async data path (learner.controller.feed.OffPolicyFeed) over fake services: admission,
the staleness guards, abort before a push, accounting, and K = 0 behaving as lockstep."""

from __future__ import annotations

import json
import time

import pytest

from common import protocol as P
from common.transport import Endpoint
from helpers.async_fakes import FakeReward, FakeRollout
from learner.controller.controller import Controller
from learner.controller.feed import OffPolicyFeed
from learner.controller.ledger import PromptLedger
from learner.controller.pool import ServicePool
from learner.controller.rollout_client import RolloutClient
from learner.controller.types import PromptItem
from learner.rl.prompts import PromptStream

B, G = 2, 2


@pytest.fixture
def ctrl():
    ep = Endpoint.bind("tcp://127.0.0.1:0")
    pool = ServicePool(ep, peer_timeout_s=5.0, needs_preparation=())
    ledger = PromptLedger(generate_timeout_s=30, score_timeout_s=30)
    c = Controller(RolloutClient(ep, pool), ledger, sampling=P.SamplingParams(n=G, max_new_tokens=2))
    services = []

    def start(svc):
        svc.start()
        services.append(svc)
        return svc

    yield c, start
    for s in services:
        s.stop.set()
    ep.close(0)


def items(n: int, labels=None) -> list[PromptItem]:
    return [PromptItem(tokens=[100 + i, 7], text=f"p{i}", label=(labels or {}).get(i)) for i in range(n)]


def make_feed(c, its, *, k, total=None, keep=None):
    return OffPolicyFeed(c, iter(its), batch_groups=B, max_staleness=k, total_groups=total, keep_group=keep)


def pump_until(feed, cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        feed.pump(0.01)
        assert time.monotonic() < deadline, f"timed out; counters {feed.counters}, ready {len(feed.ready)}"


def settle(feed, seconds=0.3):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        feed.pump(0.01)


def tokens(groups):
    return sorted(g.item.tokens[0] for g in groups)


def test_admission_follows_the_staleness_budget(ctrl):
    c, start = ctrl
    start(FakeRollout(c.endpoint.address))
    start(FakeReward(c.endpoint.address))
    c.wait_for_services(1, 1, timeout_s=10)
    feed = make_feed(c, items(20), k=1)
    pump_until(feed, lambda: len(feed.ready) == 4)
    settle(feed)
    # (K + v + 1) * B with v = 0: two steps' worth, however fast generation is.
    assert feed.counters["admitted"] == 4 and len(feed.ready) == 4
    batch = feed.take_batch(0)
    assert tokens(batch) == [100, 101]
    settle(feed)
    assert feed.counters["admitted"] == 4, "no new room until the next push"
    c.pool.weights_pushed(1, [])
    pump_until(feed, lambda: feed.counters["admitted"] == 6 and len(feed.ready) == 4)
    # Oldest first: step 2 (v1) trains the two v0 groups (lag 1), not the fresh v1 ones.
    batch = feed.take_batch(1)
    assert tokens(batch) == [102, 103] and {g.version for g in batch} == {0}
    feed.check_accounting()


def test_groups_older_than_the_bound_are_dropped_whole_and_counted(ctrl):
    c, start = ctrl
    start(FakeRollout(c.endpoint.address))
    start(FakeReward(c.endpoint.address))
    c.wait_for_services(1, 1, timeout_s=10)
    feed = make_feed(c, items(20), k=1)
    pump_until(feed, lambda: len(feed.ready) == 4)
    # The learner jumped two versions (say, the servers were re-synced): v0 groups are 2 behind v2.
    c.pool.weights_pushed(2, [])
    assert feed.take_batch(2) is None
    assert feed.counters["dropped_stale"] == 4 and not feed.ready
    # Dropped groups free their budget: refills come from the same stream, at the new version.
    pump_until(feed, lambda: len(feed.ready) >= 2)
    batch = feed.take_batch(2)
    assert {g.version for g in batch} == {2} and tokens(batch) == [104, 105]
    feed.check_accounting()


def test_abort_before_push_requeues_under_new_ids_and_late_answers_are_duplicates(ctrl):
    c, start = ctrl
    held = {2, 3}  # prompt ids 2 and 3 (the 3rd and 4th prompts) never finish on their own
    r = start(FakeRollout(c.endpoint.address, hold=lambda pid: pid in held))
    start(FakeReward(c.endpoint.address))
    c.wait_for_services(1, 1, timeout_s=10)
    feed = make_feed(c, items(20), k=1)
    pump_until(feed, lambda: len(feed.ready) == 2)
    settle(feed)
    assert feed.take_batch(0) is not None
    c.pool.weights_pushed(1, [])  # push v1: prompts 2, 3 (dispatched at v0) are still fine for step 2
    assert feed.abort_stale(next_train_version=1) == 0
    pump_until(feed, lambda: len(feed.ready) == 2)  # the v1 admissions (ids 4, 5)
    assert feed.take_batch(1) is not None  # step 2 takes them: 2 and 3 are still generating
    # Before pushing v2 (step 3 trains v2, floor v1): 2 and 3, dispatched at v0, are aborted.
    assert feed.abort_stale(next_train_version=2) == 2
    c.pool.weights_pushed(2, [])
    pump_until(feed, lambda: sorted(r.aborted) == [2, 3])
    assert feed.counters["aborted"] == 2
    held.discard(2)
    r.answer_now(2, version=0)  # a SampleBatch that crossed the Abort: dropped as a duplicate
    pump_until(feed, lambda: len(feed.ready) >= 2 and c.ledger.counters["duplicates"] >= 1)
    batch = feed.take_batch(2)
    # The re-queued prompts went first, under new ids, and were generated at v2.
    assert tokens(batch) == [102, 103] and {g.version for g in batch} == {2}
    assert min(g.samples[0].prompt_id for g in batch) > 5
    feed.check_accounting()


def test_accounting_with_failed_and_filtered_groups_and_the_end_of_the_run(ctrl):
    c, start = ctrl
    start(FakeRollout(c.endpoint.address, delay=0.01))
    start(FakeReward(c.endpoint.address))
    c.wait_for_services(1, 1, timeout_s=10)
    its = items(30, labels={1: "poison", 4: "flat"})
    feed = make_feed(c, its, k=1, total=3 * B, keep=lambda ss: len({s.reward for s in ss}) > 1)
    trained = []
    for v in range(3):
        pump_until(feed, lambda v=v: (b := feed.take_batch(v)) is not None and trained.append(b) is None)
        c.pool.weights_pushed(v + 1, [])
        feed.abort_stale(v + 1)
        feed.check_accounting()
    flat = [p.item.tokens[0] for b in trained for p in b]
    assert len(flat) == len(set(flat)) == 3 * B, "each prompt trained once"
    assert 101 not in flat and 104 not in flat
    assert feed.counters["dropped_failed"] == 1 and feed.counters["dropped_filtered"] == 1
    end = feed.close()
    c_ = feed.counters
    dropped = c_["dropped_stale"] + c_["dropped_failed"] + c_["dropped_filtered"]
    assert c_["admitted"] == c_["trained"] + dropped + c_["aborted"] + end["in_flight_at_end"] + end["ready_at_end"]
    # total_groups: nothing is admitted beyond what the run still needs.
    assert c_["admitted"] == 3 * B + dropped


def test_k0_is_lockstep(ctrl):
    """K = 0: each step trains exactly lockstep's prompts for that step, all at lag 0, and no
    prompt is generated while the learner trains."""
    c, start = ctrl
    start(FakeRollout(c.endpoint.address))
    start(FakeReward(c.endpoint.address))
    c.wait_for_services(1, 1, timeout_s=10)
    its = items(10)
    stream = PromptStream(its, B)
    feed = make_feed(c, (it for s in range(1, 6) for it in stream.batch(s)), k=0, total=4 * B)
    for step in range(1, 5):
        batch = None

        def got(step=step):
            nonlocal batch
            batch = feed.take_batch(step - 1)
            return batch is not None

        pump_until(feed, got)
        assert tokens(batch) == sorted(it.tokens[0] for it in stream.batch(step))
        assert {s.policy_version for g in batch for s in g.samples} == {step - 1}
        settle(feed, 0.1)  # "training"
        assert feed.outstanding() == 0 and feed.counters["admitted"] == step * B
        c.pool.weights_pushed(step, [])
        assert feed.abort_stale(step) == 0
    assert feed.counters == dict(
        admitted=4 * B, trained=4 * B, dropped_stale=0, dropped_failed=0, dropped_filtered=0, aborted=0
    )


# ---------------------------------------------------------------------- evaluation prompts


def test_evaluation_prompts_pass_a_full_budget_never_become_groups_and_are_accounted_apart(ctrl):
    """Evaluation through the feed (the async schedule's way): with the staleness budget full,
    evaluation prompts are still admitted and generated (they are not in the budget), with
    their own sampling (3 samples each, not G); they never become ready groups, so no batch
    takes them; the training accounting is unchanged and theirs is kept apart, down to an
    evaluation still in flight when the run ends (aborted at the server, counted)."""
    c, start = ctrl
    held: set[int] = set()
    r = start(FakeRollout(c.endpoint.address, hold=lambda pid: pid in held))
    start(FakeReward(c.endpoint.address))
    c.wait_for_services(1, 1, timeout_s=10)
    feed = make_feed(c, items(20), k=1)
    pump_until(feed, lambda: len(feed.ready) == 4)
    settle(feed)
    assert feed.room() == 0 and feed.counters["admitted"] == 4  # the budget is full
    evals = [PromptItem(tokens=[900 + i, 7], text=f"e{i}") for i in range(3)]
    ids = feed.add_eval(evals, P.SamplingParams(n=3, max_new_tokens=2))
    assert feed.room() == 0 and feed.outstanding() == 4 and feed.counters["admitted"] == 4
    pump_until(feed, lambda: feed.eval_waiting(ids) == 0)
    feed.check_accounting()
    assert tokens(feed.ready) == [100, 101, 102, 103]  # no evaluation prompt among the groups
    got = feed.take_eval(ids, 3)
    assert [s.prompt[0] for s in got.rollout.samples] == [900] * 3 + [901] * 3 + [902] * 3
    assert [s.sample_index for s in got.rollout.samples[:3]] == [0, 1, 2] and got.failed_groups == 0
    assert tokens(feed.take_batch(0)) == [100, 101]
    feed.check_accounting()
    assert feed.eval_counters == {"admitted": 3, "returned": 3, "aborted": 0}
    assert feed.counters == dict(
        admitted=4, trained=2, dropped_stale=0, dropped_failed=0, dropped_filtered=0, aborted=0
    )
    # An evaluation still generating at the end of the run is aborted with the training prompts.
    late = feed.add_eval(evals[:2], P.SamplingParams(n=3, max_new_tokens=2))
    held.update(late)
    pump_until(feed, lambda: set(late) <= set(r.seen))
    feed.check_accounting()
    end = feed.close()
    assert feed.eval_counters == {"admitted": 5, "returned": 3, "aborted": 2} and end["trained"] == 2
    time.sleep(0.2)
    assert set(late) <= set(r.aborted)
    feed.check_accounting()


# ---------------------------------------------------------------------- checkpoint state


def test_state_dict_names_every_pending_prompt_by_its_stream_position(ctrl):
    """After step 2's push with a prompt ready, prompts generating and two aborted ones waiting
    to be admitted again: the state lists exactly those by position, and every position drawn
    is trained, dropped or pending (nothing else exists to lose)."""
    c, start = ctrl
    held = {2, 3}  # prompt ids 2 and 3 never finish on their own: aborted before the v2 push
    start(FakeRollout(c.endpoint.address, hold=lambda pid: pid in held))
    start(FakeReward(c.endpoint.address))
    c.wait_for_services(1, 1, timeout_s=10)
    its = items(20)
    feed = OffPolicyFeed(c, iter(its[5:]), batch_groups=B, max_staleness=1, first_position=5)
    trained = []
    pump_until(feed, lambda: len(feed.ready) == 2)
    settle(feed)
    trained += feed.take_batch(0)
    c.pool.weights_pushed(1, [])
    pump_until(feed, lambda: len(feed.ready) == 2)
    trained += feed.take_batch(1)
    assert feed.abort_stale(next_train_version=2) == 2
    c.pool.weights_pushed(2, [])  # step 2's push; the checkpoint is taken now
    state = json.loads(json.dumps(feed.state_dict()))  # it goes into state.json

    assert [g.position for g in trained] == [5, 6, 9, 10]  # the items' own positions
    assert [g.item.tokens[0] - 100 for g in trained] == [5, 6, 9, 10]
    assert state["counters"]["trained"] == 2 * B and state["counters"]["aborted"] == 2
    assert state["next_position"] == 5 + feed.counters["admitted"]  # no aborted one admitted again yet
    pending = {p for _, p in feed.requeued} | {g.position for g in feed.ready}
    pending |= set(feed._position.values())  # in flight
    assert [p for _, p in feed.requeued] == [7, 8]  # the aborted ones
    assert state["pending"] == sorted(pending) and state["outstanding"] == feed.outstanding()
    assert sorted([g.position for g in trained] + state["pending"]) == list(range(5, state["next_position"]))


def test_restore_admits_the_pending_prompts_first_then_goes_on_from_the_next_position(ctrl):
    """A hand-made checkpoint state (after step 2, B = 2): positions 3, 6 and 8 pending (two were
    outstanding, one aborted earlier), 9 next. The resumed feed issues 3, 6, 8 again before any
    new prompt, keeps the run's counters, and trains every other position once to the end."""
    c, start = ctrl
    start(FakeRollout(c.endpoint.address, delay=0.01))
    start(FakeReward(c.endpoint.address))
    c.wait_for_services(1, 1, timeout_s=10)
    its = items(30)
    state = {
        "next_position": 9,
        "pending": [3, 6, 8],
        "outstanding": 2,
        "outstanding_max": 4,
        "counters": dict(
            admitted=11, trained=2 * B, dropped_stale=0, dropped_failed=1, dropped_filtered=0, aborted=4
        ),  # 11 == 4 trained + 1 failed + 4 aborted + 2 outstanding
    }
    c.pool.weights_pushed(2, [])  # the resumed learner pushed the checkpoint's weights
    feed = OffPolicyFeed(c, iter(its[9:]), batch_groups=B, max_staleness=1, total_groups=5 * B, first_position=9)
    assert feed.restore(state, its.__getitem__) == 3
    assert feed.counters["aborted"] == 4 + 2 and feed.outstanding_max == 4
    feed.check_accounting()

    assert feed.admit() == 4  # room: (K + v + 1) * B - trained = 8 - 4
    assert feed.state_dict()["pending"] == [3, 6, 8, 9]  # the pending three first, then the stream
    trained = []
    for v in range(2, 5):  # steps 3..5
        pump_until(feed, lambda v=v: (b := feed.take_batch(v)) is not None and trained.append(b) is None)
        c.pool.weights_pushed(v + 1, [])
        feed.abort_stale(v + 1)
        feed.check_accounting()
    positions = sorted(g.position for b in trained for g in b)
    assert positions == [3, 6, 8, 9, 10, 11]  # nothing skipped, nothing trained twice
    assert sorted(g.item.tokens[0] - 100 for b in trained for g in b) == positions
    assert feed.counters["trained"] == 5 * B and feed.counters["admitted"] == 11 + 6
    assert feed.state_dict()["pending"] == [] and feed.next_position == 12


def test_restore_refuses_a_stream_at_another_position_and_a_used_feed(ctrl):
    c, _ = ctrl
    its = items(10)
    state = {"next_position": 4, "pending": [], "counters": dict(admitted=4, trained=4)}
    feed = OffPolicyFeed(c, iter(its[3:]), batch_groups=B, max_staleness=1, first_position=3)
    with pytest.raises(ValueError, match="goes on at position 4, this feed's prompts start at 3"):
        feed.restore(state, its.__getitem__)
    feed = OffPolicyFeed(c, iter(its[4:]), batch_groups=B, max_staleness=1, first_position=4)
    feed.counters["admitted"] = 1
    with pytest.raises(RuntimeError, match="for a new feed"):
        feed.restore(state, its.__getitem__)
