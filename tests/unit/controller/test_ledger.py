"""The ledger: re-issue on loss or deadline, duplicates dropped, each prompt trained once."""

import pytest

from learner.controller.ledger import LedgerError, PromptLedger, State


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def make(n=4, **kw):
    clock = Clock()
    led = PromptLedger(generate_timeout_s=10, score_timeout_s=5, clock=clock, **kw)
    for i in range(n):
        led.add(i, {"tokens": [i]})
    return led, clock


def test_happy_path_each_prompt_done_once():
    led, _ = make(2)
    led.start_generation([0, 1], "r0")
    assert led.generated(0, "s0", "r0") and led.generated(1, "s1", "r0")
    assert [e.prompt_id for e in led.awaiting_scoring()] == [0, 1]
    led.start_scoring([0, 1], "rw0")
    assert led.scored(0, "sc0", "rw0") and led.scored(1, "sc1", "rw0")
    done = led.take_done()
    assert [(e.prompt_id, e.samples, e.scores) for e in done] == [(0, "s0", "sc0"), (1, "s1", "sc1")]
    assert led.take_done() == [] and len(led) == 0 and led.counters["trained"] == 2


def test_dead_server_prompts_are_reissued_and_late_answers_dropped():
    led, _ = make(3)
    led.start_generation([0, 1], "r0")
    led.start_generation([2], "r1")
    assert led.lost([0, 1], "r0 died") == [0, 1]
    assert [e.prompt_id for e in led.queued()] == [0, 1]
    led.start_generation([0, 1], "r1")
    assert led.generated(0, "from-r1", "r1")
    # r0 was not dead after all: its late answer must not count twice
    assert not led.generated(0, "from-r0", "r0") and not led.generated(1, "from-r0", "r0")
    assert led.counters == {**led.counters, "reissued": 2, "duplicates": 2}
    assert led.entries[0].samples == "from-r1" and led.entries[1].state is State.GENERATING


def test_lost_reward_service_keeps_samples_and_rescoring_happens():
    led, _ = make(1)
    led.start_generation([0], "r0")
    led.generated(0, "s", "r0")
    led.start_scoring([0], "rw0")
    assert led.lost([0], "rw0 died") == [0]
    e = led.entries[0]
    assert e.state is State.SCORING and e.samples == "s" and led.awaiting_scoring() == [e]
    led.start_scoring([0], "rw1")
    assert not led.scored(0, "x", "rw0")  # the dead one's answer is a duplicate
    assert led.scored(0, "y", "rw1")


def test_deadlines_expire_into_reissue():
    led, clock = make(2)
    led.start_generation([0], "r0")
    clock.t = 5
    led.start_generation([1], "r0")
    clock.t = 10.5
    assert led.expire() == [0]  # deadline 10; prompt 1's is 15
    clock.t = 15.5
    assert led.expire() == [1]
    assert "lost@r0: deadline passed" in led.entries[0].history


def test_a_peer_lost_after_its_prompt_moved_on_does_not_take_it_back():
    """Prompt 0 passes its deadline on r0 and goes to r1; r0 is then found dead, the pool still
    listing 0 among its work: r1 keeps generating it (no third hand-out, no attempt spent)."""
    led, clock = make(2)
    led.start_generation([0, 1], "r0")
    clock.t = 10.5
    assert led.expire() == [0, 1]
    led.start_generation([0], "r1")
    assert led.lost([0, 1], "unreachable", holder="r0") == []
    assert (led.entries[0].state, led.entries[0].holder, led.entries[0].attempts) == (State.GENERATING, "r1", 2)
    assert led.generated(0, "from-r1", "r1") and led.counters["reissued"] == 2
    led.start_generation([1], "r1")
    assert led.lost([1], "unreachable", holder="r1") == [1]
    assert led.entries[1].history[-1] == "lost@r1: unreachable"


def test_gives_up_after_max_attempts_with_history():
    led, _ = make(1, max_attempts=2)
    for peer in ("r0", "r1"):
        led.start_generation([0], peer)
        led.lost([0], f"{peer} died")
    with pytest.raises(LedgerError, match=r"handed out 2 times.*generating@r0, lost@r0: r0 died"):
        led.start_generation([0], "r2")


def test_gives_up_scoring_after_max_attempts():
    led, _ = make(1, max_attempts=2)
    led.start_generation([0], "r0")
    led.generated(0, "s", "r0")
    for peer in ("rw0", "rw1"):
        led.start_scoring([0], peer)
        led.lost([0], f"{peer} answered bad_request: no text")
    with pytest.raises(LedgerError, match=r"sent for scoring 2 times.*rw1 answered bad_request: no text"):
        led.start_scoring([0], "rw2")


def test_a_prompt_answered_with_an_error_each_time_says_so_and_quotes_the_last():
    led, _ = make(1, max_attempts=2)
    for peer in ("r0", "r1"):
        led.start_generation([0], peer)
        led.lost([0], f"answered agent_failed: env raised on {peer}", holder=peer, error=True)
    with pytest.raises(LedgerError) as got:
        led.start_generation([0], "r2")
    msg = str(got.value)
    assert msg.startswith(
        "prompt 0 was handed out 2 times and answered with an error each time "
        "(the last: r1 answered agent_failed: env raised on r1); giving up rather than looping (history: "
    ), msg
    assert "never came back" not in msg


def test_errors_and_silence_mixed_are_both_said():
    led, clock = make(1, max_attempts=3)
    led.start_generation([0], "r0")
    led.lost([0], "r0 died")
    led.start_generation([0], "r1")
    led.lost([0], "answered bad_request: prompt too long", holder="r1", error=True)
    led.start_generation([0], "r2")
    clock.t = 100.0
    assert led.expire() == [0]
    with pytest.raises(LedgerError, match=r"^prompt 0 was handed out 3 times and answered with an error 1 time\(s\) "
                       r"\(the last: r1 answered bad_request: prompt too long\) and otherwise never came back;"):  # fmt: skip
        led.start_generation([0], "r3")


def test_scoring_answered_with_an_error_each_time_says_so():
    led, _ = make(1, max_attempts=2)
    led.start_generation([0], "r0")
    led.generated(0, "s", "r0")
    for peer in ("rw0", "rw1"):
        led.start_scoring([0], peer)
        led.lost([0], "answered bad_request: no text", holder=peer, error=True)
    with pytest.raises(LedgerError, match=r"^prompt 0 was sent for scoring 2 times and answered with an error each "
                       r"time \(the last: rw1 answered bad_request: no text\);"):  # fmt: skip
        led.start_scoring([0], "rw2")


def test_wrong_transitions_are_errors_not_silent():
    led, _ = make(1)
    with pytest.raises(LedgerError, match="it is queued, not scoring"):
        led.start_scoring([0], "rw0")
    with pytest.raises(LedgerError, match="already in the ledger"):
        led.add(0, {})
    assert not led.scored(42, "x", "rw0") and led.counters["duplicates"] == 1
