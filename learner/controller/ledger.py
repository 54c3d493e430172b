"""The prompt ledger: every prompt in flight, where it is, and until when.

A prompt moves ``queued -> generating -> scoring -> done``. Each move records the peer that
holds it and a deadline. A prompt whose peer died, or whose deadline passed, goes back to
``queued`` and is handed out again (``reissued`` counts it). A result for a prompt that is not
in the state that result belongs to — a late answer from a server that was given up on, a
second answer after a re-issue — is dropped and counted in ``duplicates``. So every prompt is
trained on at most once, and a prompt leaves the ledger only through ``take_done``.

Keys are prompt ids: a rollout server returns all ``n`` samples of a prompt together, and a
group (GRPO, RLOO) needs all of them, so the prompt is the unit of work. The ledger is
socket-free; the controller drives it.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


class State(enum.Enum):
    QUEUED = "queued"
    GENERATING = "generating"
    SCORING = "scoring"
    DONE = "done"


@dataclass
class Entry:
    prompt_id: int
    payload: Any  # what the controller needs to rebuild requests: tokens, text, label
    state: State = State.QUEUED
    holder: str = ""  # name of the peer holding it
    deadline: float = float("inf")
    attempts: int = 0  # times handed out for generation
    # The controller's policy version when last handed out: the sample's version is at least this.
    dispatched_version: int = 0
    score_attempts: int = 0  # times sent for scoring
    # Of those, how many the peer answered with an error (rather than dying or going silent),
    # and the last such answer: what a prompt that is given up on is reported with.
    generate_errors: int = 0
    score_errors: int = 0
    last_error: str = ""
    samples: Any = None  # SampleBatch (one prompt's n samples) once generated
    scores: Any = None  # ScoredBatch once scored
    history: list[str] = field(default_factory=list)  # "generating@r0", "lost: ..." — for errors


class LedgerError(RuntimeError):
    pass


class PromptLedger:
    def __init__(
        self,
        *,
        generate_timeout_s: float,
        score_timeout_s: float,
        max_attempts: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.generate_timeout_s = generate_timeout_s
        self.score_timeout_s = score_timeout_s
        self.max_attempts = max_attempts
        self.clock = clock
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.counters = {"added": 0, "reissued": 0, "duplicates": 0, "done": 0, "trained": 0}

    # ----------------------------------------------------------------- intake
    def add(self, prompt_id: int, payload: Any) -> None:
        if prompt_id in self.entries:
            raise LedgerError(f"prompt id {prompt_id} is already in the ledger")
        self.entries[prompt_id] = Entry(prompt_id, payload)
        self.counters["added"] += 1

    def queued(self, limit: int | None = None) -> list[Entry]:
        out = [e for e in self.entries.values() if e.state is State.QUEUED]
        return out if limit is None else out[:limit]

    def count(self, state: State) -> int:
        return sum(1 for e in self.entries.values() if e.state is state)

    def __len__(self) -> int:
        return len(self.entries)

    # ----------------------------------------------------------------- transitions
    def start_generation(self, prompt_ids: Iterable[int], peer: str, version: int = 0) -> None:
        now = self.clock()
        for pid in prompt_ids:
            e = self._get(pid, State.QUEUED, "start generation")
            if e.attempts >= self.max_attempts:
                raise LedgerError(_given_up(e, "was handed out", e.attempts, e.generate_errors, "never came back"))
            e.state, e.holder, e.deadline = State.GENERATING, peer, now + self.generate_timeout_s
            e.attempts += 1
            e.dispatched_version = version
            e.history.append(f"generating@{peer}")

    def generated(self, prompt_id: int, samples: Any, peer: str) -> bool:
        """Records a prompt's samples. False (dropped as duplicate) if it was not expecting them."""
        e = self.entries.get(prompt_id)
        if e is None or e.state is not State.GENERATING or e.holder != peer:
            self.counters["duplicates"] += 1
            return False
        e.samples = samples
        e.state, e.holder, e.deadline = State.SCORING, "", float("inf")  # awaiting a reward service
        e.history.append(f"generated@{peer}")
        return True

    def start_scoring(self, prompt_ids: Iterable[int], peer: str) -> None:
        deadline = self.clock() + self.score_timeout_s
        for pid in prompt_ids:
            e = self._get(pid, State.SCORING, "start scoring")
            if e.score_attempts >= self.max_attempts:
                raise LedgerError(
                    _given_up(e, "was sent for scoring", e.score_attempts, e.score_errors, "never scored")
                )
            e.score_attempts += 1
            e.holder, e.deadline = peer, deadline
            e.history.append(f"scoring@{peer}")

    def awaiting_scoring(self) -> list[Entry]:
        """Generated prompts not yet sent to a reward service."""
        return [e for e in self.entries.values() if e.state is State.SCORING and not e.holder]

    def scored(self, prompt_id: int, scores: Any, peer: str) -> bool:
        e = self.entries.get(prompt_id)
        if e is None or e.state is not State.SCORING or e.holder != peer:
            self.counters["duplicates"] += 1
            return False
        e.scores = scores
        e.state, e.holder, e.deadline = State.DONE, "", float("inf")
        e.history.append(f"scored@{peer}")
        self.counters["done"] += 1
        return True

    def lost(self, prompt_ids: Iterable[int], reason: str, holder: str | None = None, error: bool = False) -> list[int]:
        """The peer holding these died: generation goes back to the queue, scoring back to
        'awaiting scoring' (the samples are kept: re-generating would waste work). ``holder``:
        only prompts that peer holds now; one that passed its deadline there and went to
        another peer stays with the other (None: whoever holds them, as for a deadline).
        ``error``: the peer answered them with an error (``reason``), counted per prompt."""
        back = []
        for pid in prompt_ids:
            e = self.entries.get(pid)
            if e is None or e.state not in (State.GENERATING, State.SCORING) or not e.holder:
                continue
            if holder is not None and e.holder != holder:
                continue
            e.history.append(f"lost@{e.holder}: {reason}")
            if error:
                e.last_error = f"{e.holder} {reason}"
                if e.state is State.GENERATING:
                    e.generate_errors += 1
                else:
                    e.score_errors += 1
            if e.state is State.GENERATING:
                e.state = State.QUEUED
            e.holder, e.deadline = "", float("inf")
            self.counters["reissued"] += 1
            back.append(pid)
        return back

    def expire(self) -> list[int]:
        """Prompts past their deadline: handled like a lost peer, keyed by what they waited for."""
        now = self.clock()
        late = [e.prompt_id for e in self.entries.values() if e.holder and e.deadline < now]
        return self.lost(late, "deadline passed")

    def holders(self, prompt_ids: Iterable[int]) -> dict[int, str]:
        return {pid: self.entries[pid].holder for pid in prompt_ids if pid in self.entries}

    def take_done(self, limit: int | None = None) -> list[Entry]:
        """Removes and returns finished prompts (oldest first). Each is returned exactly once."""
        done = [e for e in self.entries.values() if e.state is State.DONE]
        if limit is not None:
            done = done[:limit]
        for e in done:
            del self.entries[e.prompt_id]
        self.counters["trained"] += len(done)
        return done

    def remove(self, prompt_ids: Iterable[int]) -> list[Entry]:
        """Takes prompts out of the ledger whatever their state (aborted, abandoned); a later
        answer for one of them is a duplicate. Not counted as trained."""
        return [e for pid in prompt_ids if (e := self.entries.pop(pid, None)) is not None]

    def _get(self, pid: int, want: State, what: str) -> Entry:
        e = self.entries.get(pid)
        if e is None:
            raise LedgerError(f"cannot {what} for prompt {pid}: not in the ledger")
        if e.state is not want:
            raise LedgerError(f"cannot {what} for prompt {pid}: it is {e.state.value}, not {want.value}")
        return e


def _given_up(e: Entry, sent: str, n: int, errors: int, silent: str) -> str:
    """Why a prompt is given up on after it ``sent`` ``n`` times: every time answered with an
    error (the last one quoted), some times, or none (``silent``: lost to deaths and deadlines)."""
    if errors >= n:
        what = f"answered with an error each time (the last: {e.last_error})"
    elif errors:
        what = f"answered with an error {errors} time(s) (the last: {e.last_error}) and otherwise {silent}"
    else:
        what = silent
    return f"prompt {e.prompt_id} {sent} {n} times and {what}; giving up rather than looping (history: {', '.join(e.history)})"
