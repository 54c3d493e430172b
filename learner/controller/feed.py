"""``OffPolicyFeed``: the async schedule's data path, a stream of groups with bounded staleness.

Beside ``Controller.collect`` (hand over a batch, wait for all of it), the feed keeps the
controller busy continuously: it admits prompts as the staleness budget allows, pumps the
controller, and keeps scored groups ready until the learner takes a batch. Versions: the
learner trains step ``s`` with the weights it pushed as version ``v = s - 1`` (the *train
version*); a sample's version is the one that sampled its first token (the rollout server
reports it); its lag is ``v - version``. ``max_staleness`` K bounds the lag in three places:

1. admission (AReaL's rule): prompts are handed out only while
   ``trained + ready + in flight < (K + v + 1) * B`` (B = groups per step, v = the version the
   servers hold), so work that would be too stale is not generated in the first place, and a
   slow learner makes the servers wait instead of growing memory;
2. ``abort_stale`` before each push: a group still generating that was dispatched under a
   version older than the next train version minus K is aborted in vLLM and its prompt
   re-queued (ahead of new prompts) under a new prompt id;
3. ``take_batch``: a ready group older than the bound is dropped whole and counted, a last
   guard (re-issues after a server died, slow stragglers). Groups are kept or dropped whole:
   group estimators need the whole group.

With K = 0 this is lockstep: B prompts admitted after each push, none while training.

Accounting, by admission (a prompt re-queued after an abort is admitted again)::

    admitted == trained + dropped_stale + dropped_failed + dropped_filtered + aborted + in_flight

Evaluation prompts (``add_eval`` / ``take_eval``) travel through the same controller, between the
training prompts, with their own sampling, and are tagged by prompt id: they never become a
ready group (so never reach ``take_batch``), do not count in admission (``room``) nor in the
accounting above, and are not aborted as stale. They are accounted apart::

    eval_counters["admitted"] == eval_counters["returned"] + eval_counters["aborted"] + eval in flight or done

Checkpoints. The feed numbers the prompts it draws by their *position* in the run's prompt
stream (the schedule says where its iterator starts: ``first_position``). ``state_dict()`` records
the next position and the positions still pending (ready groups, prompts in flight, aborted
prompts waiting to be admitted again); a feed built for the resumed run with ``restore()``
admits the pending ones first (they are generated again, by the resumed weights: a restart
aborts what was outstanding, and counts it so) and then draws from the next position on.
Trained and dropped prompts are in neither list, so none is skipped or trained twice. The
counters are run totals, restored too: admission after a resume sees what the run trained.

Single-threaded and socket-free apart from the controller it drives: one thread owns it (the
async schedule's pump thread, see ``learner/rl/schedules/async_.py``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from common.protocol import SamplingParams
from learner.controller.controller import Controller, scored_samples
from learner.controller.ledger import Entry, State
from learner.controller.types import CollectResult, PromptItem, ScoredSample

log = logging.getLogger(__name__)


@dataclass
class Group:
    """One prompt's scored samples, ready to train on."""

    item: PromptItem
    samples: list[ScoredSample]  # G of them, by sample index
    version: int  # the oldest first-token version among its samples
    seq: int  # arrival order (ties among equal versions: first come, first trained)
    position: int = -1  # the prompt's position in the run's prompt stream (checkpoints)


class OffPolicyFeed:
    def __init__(
        self,
        controller: Controller,
        prompts: Iterator[PromptItem],
        *,
        batch_groups: int,
        max_staleness: int,
        total_groups: int | None = None,
        keep_group: Callable[[list[ScoredSample]], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        first_position: int = 0,
    ) -> None:
        """``batch_groups`` B prompts per step; ``total_groups`` how many the run will train on
        (no prompt is admitted beyond what it still needs; counted with ``counters["trained"]``,
        a run total after ``restore``); ``keep_group`` (dynamic filtering) says whether a scored
        group is worth training on, else it is dropped and replaced; ``first_position`` is the
        stream position of the first prompt ``prompts`` yields."""
        self.controller = controller
        self.prompts = prompts
        self.B = batch_groups
        self.K = max_staleness
        self.total_groups = total_groups
        self.keep_group = keep_group
        self.clock = clock
        # Bringing a joiner up to date reads the learner's parameters, which the learner trains
        # while this feed pumps: the controller must leave joiners to the next push (which syncs
        # them first). Its builder decides that (``sync_joiners_in_pump``); a feed cannot.
        if controller.sync_joiners_in_pump and controller.weights.publisher is not None:
            raise ValueError(
                "OffPolicyFeed: the controller syncs joiners in its pump, which would read weights the "
                "learner is training; build it with sync_joiners_in_pump=False"
            )
        self.ready: list[Group] = []
        self.in_flight: dict[int, PromptItem] = {}  # prompt id -> item: admitted, not yet ready
        self._position: dict[int, int] = {}  # prompt id -> stream position, for what is in flight
        self.requeued: deque[tuple[PromptItem, int]] = deque()  # (item, position): aborted, admitted again first
        self.next_position = first_position  # of the next prompt drawn from ``prompts``
        self._seq = 0
        self.counters = {
            "admitted": 0,
            "trained": 0,
            "dropped_stale": 0,
            "dropped_failed": 0,
            "dropped_filtered": 0,
            "aborted": 0,
        }
        # Evaluation prompts (module docstring): by prompt id, while generating and once done.
        self.eval_in_flight: dict[int, PromptItem] = {}
        self.eval_done: dict[int, Entry] = {}
        self.eval_counters = {"admitted": 0, "returned": 0, "aborted": 0}
        self.rollout_idle_s = 0.0  # time with no prompt generating anywhere
        # The most groups ever admitted and not yet trained or dropped (ready + in flight): the
        # back-pressure check. Admission keeps it <= (K + 1) x B; a slow learner must not raise it.
        self.outstanding_max = 0
        self._last_turn = clock()

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        """The version the rollout servers hold (the last push)."""
        return self.controller.policy_version

    def outstanding(self) -> int:
        """Admitted and not yet trained or dropped: ready groups and prompts in flight."""
        return len(self.ready) + len(self.in_flight)

    def room(self) -> int:
        """How many more prompts may be admitted now."""
        n = (self.K + self.version + 1) * self.B - (self.counters["trained"] + self.outstanding())
        if self.total_groups is not None:
            n = min(n, self.total_groups - self.counters["trained"] - self.outstanding())
        return max(0, n)

    def check_accounting(self) -> None:
        """The accounting of the module docstring, of training prompts and, apart, of evaluation's."""
        c = self.counters
        ended = c["trained"] + c["dropped_stale"] + c["dropped_failed"] + c["dropped_filtered"] + c["aborted"]
        if c["admitted"] != ended + self.outstanding():
            raise AssertionError(f"feed accounting broken: {c}, outstanding {self.outstanding()}")
        e = self.eval_counters
        if e["admitted"] != e["returned"] + e["aborted"] + len(self.eval_in_flight) + len(self.eval_done):
            raise AssertionError(
                f"feed evaluation accounting broken: {e}, {len(self.eval_in_flight)} in flight, "
                f"{len(self.eval_done)} done"
            )

    # ------------------------------------------------------------------ the loop
    def admit(self) -> int:
        n = self.room()
        items: list[tuple[PromptItem, int]] = []
        while len(items) < n and self.requeued:
            items.append(self.requeued.popleft())
        while len(items) < n:
            item = next(self.prompts, None)
            if item is None:
                break
            items.append((item, self.next_position))
            self.next_position += 1
        if items:
            for pid, (item, pos) in zip(self.controller.add_prompts([it for it, _ in items]), items, strict=True):
                self.in_flight[pid] = item
                self._position[pid] = pos
            self.counters["admitted"] += len(items)
            self.outstanding_max = max(self.outstanding_max, self.outstanding())
        return len(items)

    def pump(self, timeout: float = 0.05) -> None:
        """One turn: admit what the budget allows, move the controller, collect finished groups."""
        now = self.clock()
        if not any(e.state is State.GENERATING for e in self.controller.ledger.entries.values()):
            self.rollout_idle_s += now - self._last_turn
        self._last_turn = now
        self.admit()
        self.controller.pump(timeout)
        for e in self.controller.take_done():
            if self.eval_in_flight.pop(e.prompt_id, None) is not None:
                self.eval_done[e.prompt_id] = e  # an evaluation's: kept for take_eval, never trained on
                continue
            item = self.in_flight.pop(e.prompt_id, None)
            if item is None:
                continue  # no longer the feed's (aborted: a late answer)
            pos = self._position.pop(e.prompt_id)
            if any(r for r in (e.scores.failed or [])):
                self.counters["dropped_failed"] += 1
                log.warning(
                    "dropped prompt %d: scoring failed (%s)", e.prompt_id, next(r for r in e.scores.failed if r)
                )
                continue
            samples = scored_samples(e)
            if self.keep_group is not None and not self.keep_group(samples):
                self.counters["dropped_filtered"] += 1
                continue
            self.ready.append(Group(item, samples, min(s.policy_version for s in samples), self._seq, pos))
            self._seq += 1

    def take_batch(self, train_version: int) -> list[Group] | None:
        """B groups to train ``train_version`` on, oldest first, or None if fewer are ready.
        Groups older than ``train_version - K`` are dropped first (counted)."""
        floor = train_version - self.K
        stale = [g for g in self.ready if g.version < floor]
        if stale:
            self.counters["dropped_stale"] += len(stale)
            log.warning(
                "dropped %d group(s) older than v%d (training v%d, --max_staleness %d)",
                len(stale),
                floor,
                train_version,
                self.K,
            )
            self.ready = [g for g in self.ready if g.version >= floor]
        if len(self.ready) < self.B:
            return None
        self.ready.sort(key=lambda g: (g.version, g.seq))
        batch, self.ready = self.ready[: self.B], self.ready[self.B :]
        self.counters["trained"] += len(batch)
        # One line per step: tests and operators read the back-pressure bound from the log.
        log.info(
            "batch for v%d: %d group(s) left ready, %d in flight; outstanding at most %d so far (bound %d)",
            train_version,
            len(self.ready),
            len(self.in_flight),
            self.outstanding_max,
            (self.K + 1) * self.B,
        )
        return batch

    def abort_stale(self, next_train_version: int) -> int:
        """Before pushing ``next_train_version``: aborts groups still generating that were
        dispatched under a version below ``next_train_version - K`` (they could only be dropped
        later) and re-queues their prompts. Returns how many."""
        floor = next_train_version - self.K
        entries = self.controller.ledger.entries
        doomed = [
            pid
            for pid in self.in_flight
            if (e := entries.get(pid)) is not None and e.state is State.GENERATING and e.dispatched_version < floor
        ]
        if not doomed:
            return 0
        self.controller.abort(doomed, f"older than v{floor} (--max_staleness {self.K})")
        for pid in doomed:
            self.requeued.append((self.in_flight.pop(pid), self._position.pop(pid)))
        self.counters["aborted"] += len(doomed)
        log.info("aborted %d group(s) still generating under versions below v%d; re-queued", len(doomed), floor)
        return len(doomed)

    # ------------------------------------------------------------------ evaluation
    def add_eval(self, items: list[PromptItem], sampling: SamplingParams) -> list[int]:
        """Hands evaluation prompts to the controller, sampled with ``sampling``, outside the
        staleness budget; returns their prompt ids (for ``take_eval``)."""
        ids = self.controller.add_prompts(items, sampling)
        self.eval_in_flight.update(zip(ids, items, strict=True))
        self.eval_counters["admitted"] += len(ids)
        return ids

    def take_eval(self, ids: list[int], group_size: int) -> CollectResult | None:
        """The evaluation ``ids`` once every one is generated and scored (in their order, groups
        whose scoring failed counted and left out), else None."""
        if any(pid not in self.eval_done for pid in ids):
            return None
        entries = [self.eval_done.pop(pid) for pid in ids]
        self.eval_counters["returned"] += len(entries)
        return self.controller.to_rollout(entries, group_size)

    def eval_waiting(self, ids: list[int]) -> int:
        """How many of the evaluation ``ids`` are not done yet."""
        return sum(pid not in self.eval_done for pid in ids)

    def abort_eval(self, reason: str) -> int:
        """Takes every evaluation prompt out (its evaluation failed or the run ends)."""
        pids = list(self.eval_in_flight) + list(self.eval_done)
        if self.eval_in_flight:
            self.controller.abort(list(self.eval_in_flight), reason)
        self.eval_in_flight.clear()
        self.eval_done.clear()
        self.eval_counters["aborted"] += len(pids)
        return len(pids)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The feed's place in the prompt stream and its counters (JSON-able; see the module
        docstring). Taken between steps, when ``counters["trained"]`` is whole batches."""
        pending = [g.position for g in self.ready] + list(self._position.values()) + [p for _, p in self.requeued]
        return {
            "next_position": self.next_position,
            "pending": sorted(pending),
            "outstanding": self.outstanding(),
            "outstanding_max": self.outstanding_max,
            "counters": dict(self.counters),
        }

    def restore(self, state: dict[str, Any], item_at: Callable[[int], PromptItem]) -> int:
        """Continues the run a checkpointed feed's ``state_dict`` describes, before the first
        pump: its counters, and its pending prompts (``item_at(position)``) queued to be admitted
        first. ``prompts`` must start at the state's next position. Returns how many are pending."""
        if self.counters["admitted"] or self.ready or self.in_flight or self.requeued:
            raise RuntimeError("restore() is for a new feed, before it admitted anything")
        if int(state["next_position"]) != self.next_position:
            raise ValueError(
                f"the checkpoint's prompt stream goes on at position {state['next_position']}, "
                f"this feed's prompts start at {self.next_position}"
            )
        saved = state.get("counters", {})
        for key in self.counters:
            self.counters[key] = int(saved.get(key, 0))
        # What was ready or generating when the checkpoint was taken died with the old learner:
        # counted as aborted, so admitting it again keeps the accounting whole.
        self.counters["aborted"] += int(state.get("outstanding", 0))
        self.outstanding_max = int(state.get("outstanding_max", 0))
        self.requeued.extend((item_at(int(p)), int(p)) for p in state.get("pending", []))
        self.check_accounting()
        if self.requeued:
            log.info(
                "resumed feed: %d prompt(s) pending at the checkpoint are issued again first; new prompts from "
                "position %d; %d group(s) trained so far",
                len(self.requeued),
                self.next_position,
                self.counters["trained"],
            )
        return len(self.requeued)

    def close(self) -> dict[str, int]:
        """The run is over: prompts still in flight are aborted (servers stop generating them)
        and, with ready groups, reported as left over. Returns the final counters."""
        if self.in_flight:
            self.controller.abort(list(self.in_flight), "training finished")
        self.abort_eval("training finished")
        out = dict(
            self.counters,
            in_flight_at_end=len(self.in_flight),
            ready_at_end=len(self.ready),
            outstanding_max=self.outstanding_max,
        )
        log.info("async data path at the end: %s", out)
        return out
