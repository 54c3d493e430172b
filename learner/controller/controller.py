"""The controller (learner rank 0): hands out prompts, routes samples to scoring, collects.

It owns the ROUTER socket every service connects to, the ``ServicePool`` (who is there) and
the ``PromptLedger`` (what is where). ``collect(n)`` runs the data path until ``n`` prompts are
generated and scored:

    queued prompts --PromptBatch--> rollout server --SampleBatch--> controller
    generated prompts --ScoreRequest--> reward service --ScoredBatch--> controller

Dead or silent peers give their work back (``pool.reap``), late work is re-issued
(``ledger.expire``), late answers are dropped as duplicates. The schedule (lockstep here:
collect, train, push) lives in ``learner.train_ppo``; this class is the data path only.

The rollout side goes through ``RolloutClient`` (``learner/controller/rollout_client.py``), which reads
the socket, answers the pool, keeps weight groups, and spreads prompts by free capacity. A
rollout server that joins mid-run gets the current weights before its first prompt: here at
once when ``sync_joiners_in_pump`` (rank 0 can push alone), otherwise at the next weight push
(ZeRO-3 on several ranks: a push is a collective of all learner ranks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.protocol import Error, SampleBatch, SamplingParams, ScoredBatch, Shutdown
from common.transport import CallTimeout, Endpoint, PeerUnavailable, RemoteError
from learner.controller.batches import concat_samples, split_by_prompt, split_scored_by_prompt
from learner.controller.ledger import Entry, PromptLedger
from learner.controller.pool import ServicePool
from learner.controller.reward_client import build_score_request
from learner.controller.rollout_client import RolloutClient
from learner.rl.experience import Rollout, Sample

log = logging.getLogger(__name__)


@dataclass
class PromptItem:
    tokens: list[int]
    text: str = ""
    label: Any = None


@dataclass
class CollectResult:
    rollout: Rollout
    entries: list[Entry]
    failed_groups: int = 0
    reasons: list[str] = field(default_factory=list)


class ServicesMissing(RuntimeError):
    pass


class Controller:
    def __init__(
        self,
        rollout: RolloutClient,
        ledger: PromptLedger,
        *,
        sampling: SamplingParams,
        max_prompts_per_request: int = 16,
        sync_joiners_in_pump: bool = True,
        detokenize: Callable[[list[list[int]]], list[str]] | None = None,
    ) -> None:
        self.rollout = rollout
        self.endpoint: Endpoint = rollout.endpoint
        self.pool: ServicePool = rollout.pool
        self.ledger = ledger
        self.sampling = sampling
        self.max_prompts_per_request = max_prompts_per_request
        self.sync_joiners_in_pump = sync_joiners_in_pump
        # Function rewards read text (OpenRLHF's `queries` = prompt + response); the controller
        # has the policy's tokenizer, so it decodes here once instead of in every reward service.
        self.detokenize = detokenize
        self.policy_version = 0
        self._next_id = 0
        self.counters = {"stale_samples": 0, "failed_samples": 0, "error_replies": 0}

    # ------------------------------------------------------------------ intake
    def add_prompts(self, items: list[PromptItem]) -> list[int]:
        ids = []
        for item in items:
            self.ledger.add(self._next_id, item)
            ids.append(self._next_id)
            self._next_id += 1
        return ids

    def wait_for_services(self, min_rollout: int, min_reward: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.pump(0.1)
            n_roll, n_rew = len(self.pool.alive("rollout")), len(self.pool.alive("reward"))
            if n_roll >= min_rollout and n_rew >= min_reward:
                return
            if time.monotonic() > deadline:
                raise ServicesMissing(
                    f"after {timeout_s:.0f} s only {n_roll}/{min_rollout} rollout server(s) and {n_rew}/{min_reward} "
                    f"reward service(s) have connected to {self.endpoint.address}; start them with "
                    f"--controller pointing here (see their logs if they were started)"
                )

    # ------------------------------------------------------------------ the loop
    def pump(self, timeout: float = 0.05) -> None:
        """One turn: receive and route messages, handle deaths and deadlines, dispatch work."""
        for identity, msg in self.rollout.poll(timeout):
            self._route(identity, msg)
        for lost in self.rollout.reap():
            back = self.ledger.lost(lost.keys, f"{lost.peer.name} {lost.reason}")
            if back:
                log.warning("re-issuing %d prompt(s) held by %s", len(back), lost.peer.name)
        for pid in self.ledger.expire():
            log.warning("prompt %d passed its deadline; re-issuing", pid)
        if self.sync_joiners_in_pump:
            self.rollout.sync_joiners(push=True)
        self._dispatch_generation()
        self._dispatch_scoring()

    def _route(self, identity: bytes, msg: Any) -> None:
        """A message the RolloutClient passed on (the pool has seen it already)."""
        peer = self.pool.peers.get(identity)
        if peer is None:
            return
        if isinstance(msg, SampleBatch):  # RolloutClient has released these prompts at the pool
            for pid, sub in split_by_prompt(msg).items():
                if sub.policy_versions and min(sub.policy_versions) < self.policy_version:
                    self.counters["stale_samples"] += len(sub)
                self.ledger.generated(pid, sub, peer.name)
        elif isinstance(msg, ScoredBatch):
            entries = self.ledger.entries
            lengths = []
            for pid, idx in zip(msg.prompt_ids, msg.sample_indices):
                e = entries.get(pid)
                sb = e.samples if e is not None else None
                lengths.append(sb.response_lengths[sb.sample_indices.index(idx)] if sb is not None else 0)
            for pid, sub in split_scored_by_prompt(msg, lengths).items():
                self.pool.complete(identity, [pid])
                self.ledger.scored(pid, sub, peer.name)
        elif isinstance(msg, Error):
            self.counters["error_replies"] += 1
            log.error("%s answered %s: %s (prompts %s)", peer.name, msg.code, msg.message, msg.prompt_ids[:8])
            self.pool.complete(identity, msg.prompt_ids)
            self.ledger.lost(msg.prompt_ids, f"{peer.name} answered {msg.code}: {msg.message}")
        else:
            log.debug("ignoring %s from %s", type(msg).__name__, peer.name)

    def _dispatch_generation(self) -> None:
        queued = self.ledger.queued()
        if not queued or self.pool.pick("rollout") is None:
            return
        for start in range(0, len(queued), self.max_prompts_per_request):
            chunk = queued[start : start + self.max_prompts_per_request]
            unplaced = set(
                self.rollout.submit(
                    [e.prompt_id for e in chunk],
                    [e.payload.tokens for e in chunk],
                    self.sampling,
                    policy_version=self.policy_version,
                )
            )
            for e in chunk:
                if e.prompt_id not in unplaced:
                    self.ledger.start_generation([e.prompt_id], self.pool.holder(e.prompt_id).name)
            if unplaced:
                return

    def _dispatch_scoring(self) -> None:
        waiting = self.ledger.awaiting_scoring()
        while waiting:
            peer = self.pool.pick("reward")
            if peer is None:
                return
            room = min(peer.capacity - len(peer.in_flight), self.max_prompts_per_request)
            chunk, waiting = waiting[:room], waiting[room:]
            ids = [e.prompt_id for e in chunk]
            samples = concat_samples([e.samples for e in chunk])
            per_sample = [e for e in chunk for _ in range(len(e.samples))]
            prompts = [e.payload.text for e in per_sample]
            queries = ()
            if self.detokenize is not None:
                responses = self.detokenize([r.tolist() for r in samples.split_responses()])
                queries = [p + r for p, r in zip(prompts, responses)]
            req = build_score_request(
                samples, [e.payload.tokens for e in per_sample], prompts, [e.payload.label for e in per_sample], queries
            )
            if self.pool.send_work(peer, req, ids):
                self.ledger.start_scoring(ids, peer.name)

    def shutdown_services(self, reason: str, wait_s: float = 5.0) -> list[str]:
        """Tells every live service to exit, as a call: waits up to ``wait_s`` for their Acks, so
        the request has left before this process does (a message still queued in ZeroMQ when
        the learner exits can be lost, leaving the service to be killed). Returns the names of
        services that did not confirm (logged); a gone peer is simply gone."""
        pending, unconfirmed = [], []
        for peer in self.pool.alive():
            name = peer.identity.decode()  # what RolloutClient calls a peer by
            try:
                pending.append(self.rollout.request(name, Shutdown(reason=reason)))
            except PeerUnavailable as e:
                log.warning("shutdown: %s", e)
                unconfirmed.append(name)
        deadline = time.monotonic() + wait_s
        for call in pending:
            try:
                call.result(max(0.0, deadline - time.monotonic()))
            except (CallTimeout, PeerUnavailable, RemoteError) as e:
                log.warning("shutdown: %s", e)
                unconfirmed.append(call.server)
        return unconfirmed

    # ------------------------------------------------------------------ collect
    def collect(
        self,
        n_prompts: int,
        items: list[PromptItem],
        *,
        timeout_s: float,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> CollectResult:
        """Generates and scores ``items`` (``n_prompts`` of them); returns them as a Rollout of
        complete groups, in prompt order. Raises TimeoutError naming what is missing."""
        ids = self.add_prompts(items)
        deadline = time.monotonic() + timeout_s
        done: dict[int, Entry] = {}
        wanted = set(ids)
        while len(done) < len(ids):
            self.pump(0.05)
            for e in self.ledger.take_done():
                if e.prompt_id in wanted:
                    done[e.prompt_id] = e
            if on_progress:
                on_progress(len(done), len(ids))
            if time.monotonic() > deadline:
                missing = sorted(wanted - set(done))
                holders = self.ledger.holders(missing[:5])
                raise TimeoutError(
                    f"collect: {len(missing)} of {len(ids)} prompts not done after {timeout_s:.0f} s "
                    f"(e.g. {holders}); rollout servers alive: {[p.name for p in self.pool.alive('rollout')]}, "
                    f"reward services alive: {[p.name for p in self.pool.alive('reward')]}"
                )
        return self._to_rollout([done[i] for i in ids])

    def _to_rollout(self, entries: list[Entry]) -> CollectResult:
        samples: list[Sample] = []
        failed_groups, reasons = 0, []
        kept = []
        for e in entries:
            sb, sc = e.samples, e.scores
            bad = [r for r in (sc.failed or []) if r]
            if bad:
                failed_groups += 1
                self.counters["failed_samples"] += len(bad)
                reasons.append(bad[0])
                continue
            kept.append(e)
            order = sorted(range(len(sb)), key=lambda i: sb.sample_indices[i])
            resp = sb.split_responses()
            lps = sb.split_logprobs()
            score_row = {idx: j for j, idx in enumerate(sc.sample_indices)}
            ref_offsets = None
            if sc.ref_logprobs is not None:
                ref_offsets, acc = {}, 0
                for idx in sc.sample_indices:
                    n = sb.response_lengths[sb.sample_indices.index(idx)]
                    ref_offsets[idx] = (acc, n)
                    acc += n
            for i in order:
                idx = sb.sample_indices[i]
                ref = None
                if ref_offsets is not None:
                    a, n = ref_offsets[idx]
                    ref = sc.ref_logprobs.reshape(-1)[a : a + n].float()
                samples.append(
                    Sample(
                        prompt_id=e.prompt_id,
                        sample_index=idx,
                        prompt=list(e.payload.tokens),
                        response=resp[i].tolist(),
                        rollout_logprobs=lps[i].float().clone(),
                        ref_logprobs=ref,
                        reward=float(sc.rewards[score_row[idx]]),
                        finish_reason=sb.finish_reasons[i] if sb.finish_reasons else "stop",
                        policy_version=sb.policy_versions[i] if sb.policy_versions else 0,
                    )
                )
        if failed_groups:
            log.warning("dropped %d group(s) whose scoring failed (first reason: %s)", failed_groups, reasons[0])
        return CollectResult(Rollout(samples, self.sampling.n), kept, failed_groups, reasons)
