"""The controller (learner rank 0): hands out prompts, routes samples to scoring, collects.

It owns the ``PromptLedger`` (what is where) and drives two clients over the one ROUTER
socket every service connects to: ``RolloutClient`` (``rollout_client.py``: prompts out,
samples in, weight groups) and ``RewardClient`` (``reward_client.py``: score requests out,
scores in). ``collect(items, sampling=...)`` runs the data path until those prompts are
generated and scored:

    queued prompts --PromptBatch--> rollout server --SampleBatch--> controller
    generated prompts --ScoreRequest--> reward service --ScoredBatch--> controller

Dead or silent peers give their work back (``pool.reap``), late work is re-issued
(``ledger.expire``), late answers are dropped as duplicates. This class is the data path
only: when to collect, train and push is a schedule's decision (``learner/rl/schedules/``).
Outgoing prompts are stamped with the version of the weights the fleet holds, which lives in
the pool (``ServicePool.policy_version``) and moves only with a push (``FleetWeights.push``).

A rollout server that joins mid-run gets the current weights before its first prompt
(``FleetWeights.sync_joiners``): here at once when ``sync_joiners_in_pump`` (rank 0 can push
alone and nothing trains meanwhile), otherwise at the next weight push (ZeRO-3 on several
ranks, where a push is a collective of all learner ranks; the async schedule, where the
learner trains while the data path runs).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from common.protocol import Abort, AgentParams, Error, SampleBatch, SamplingParams, ScoredBatch, Shutdown
from common.transport import CallTimeout, Endpoint, PeerUnavailable, RemoteError
from learner.controller.batches import concat_samples, split_by_prompt, split_scored_by_prompt
from learner.controller.ledger import Entry, PromptLedger, State
from learner.controller.pool import ServicePool
from learner.controller.reward_client import RewardClient, build_score_request
from learner.controller.rollout_client import RolloutClient
from learner.controller.scoring import AGENT_SCORER, Scoring, ServiceScoring
from learner.controller.types import CollectResult, PromptItem, Rollout, ScoredSample
from learner.controller.weight_fleet import FleetWeights

log = logging.getLogger(__name__)

__all__ = ["CollectResult", "Controller", "PromptItem", "ServicesMissing"]


class ServicesMissing(RuntimeError):
    pass


class Controller:
    def __init__(
        self,
        rollout: RolloutClient,
        ledger: PromptLedger,
        *,
        sampling: SamplingParams,
        rewards: RewardClient | None = None,
        weights: FleetWeights | None = None,
        max_prompts_per_request: int = 16,
        sync_joiners_in_pump: bool = True,
        detokenize: Callable[[list[list[int]]], list[str]] | None = None,
        agent: AgentParams | None = None,
        scoring: Scoring | None = None,
        drop_failed_episodes: bool = False,
    ) -> None:
        self.rollout = rollout
        self.endpoint: Endpoint = rollout.endpoint
        self.pool: ServicePool = rollout.pool
        self.rewards = rewards or RewardClient(self.pool)
        # Without a weight publisher (tests of the data path) joiners are ready at once.
        self.weights = weights or FleetWeights(self.pool)
        self.ledger = ledger
        self.sampling = sampling  # the default of collect(); evaluation passes its own
        self.max_prompts_per_request = max_prompts_per_request
        self.sync_joiners_in_pump = sync_joiners_in_pump
        # Function rewards read text (OpenRLHF's `queries` = prompt + response); the controller
        # has the policy's tokenizer, so it decodes here once instead of in every reward service.
        self.detokenize = detokenize
        # Agent episodes (docs/agents.md): every prompt runs as one on the rollout servers.
        self.agent = agent
        # How a prompt's samples are scored (here, or by a reward service), chosen when the run
        # is built (learner/rl/build.py:sample_scoring; learner/controller/scoring.py).
        self.scoring = scoring or ServiceScoring()
        # --agent_failure drop: a prompt whose episode failed is dropped like a group whose
        # scoring failed (counted, left out of the batch) instead of being issued again.
        self.drop_failed_episodes = drop_failed_episodes
        self._sampling_of: dict[int, SamplingParams] = {}  # prompt id -> how it is sampled
        self._next_id = 0
        self.counters = {"stale_samples": 0, "failed_samples": 0, "error_replies": 0, "failed_episodes": 0}

    @property
    def policy_version(self) -> int:
        """The version of the weights the rollout servers hold (the last push; the pool's)."""
        return self.pool.policy_version

    # ------------------------------------------------------------------ intake
    def add_prompts(self, items: list[PromptItem], sampling: SamplingParams | None = None) -> list[int]:
        ids = []
        for item in items:
            self.ledger.add(self._next_id, item)
            self._sampling_of[self._next_id] = sampling or self.sampling
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
            if self.pool.refused:  # a service this run cannot use: said now, not after the wait
                raise ServicesMissing(
                    "refused at the handshake: "
                    + "; ".join(f"{name}: {why}" for name, why in sorted(self.pool.refused.items()))
                )
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
        lost_work = self.rollout.reap()
        self.rewards.on_lost(lost_work)  # the ledger re-issues by prompt id; forget the requests
        for lost in lost_work:
            # The pool is keyed by whatever its users send; this controller's work keys are prompt ids.
            back = self.ledger.lost(cast("list[int]", lost.keys), lost.reason, holder=lost.peer.name)
            if back:
                log.warning("re-issuing %d prompt(s) held by %s", len(back), lost.peer.name)
        for pid in self.ledger.expire():
            log.warning("prompt %d passed its deadline; re-issuing", pid)
        if self.sync_joiners_in_pump:
            self.weights.sync_joiners(push=True)
        self._dispatch_generation()
        self._dispatch_scoring()

    def _route(self, identity: bytes, msg: Any) -> None:
        """A message the RolloutClient passed on (the pool has seen it already)."""
        peer = self.pool.peers.get(identity)
        if peer is None:
            return
        outcome = self.rewards.on_message(identity, msg)  # None unless it answers a ScoreRequest
        if outcome is not None:
            if outcome.error is not None:
                self._on_error(peer.name, outcome.error, outcome.request.samples.prompt_ids)
            else:
                assert outcome.scored is not None  # an outcome carries the reply or the error
                self._on_scored(peer.name, outcome.scored)
        elif isinstance(msg, SampleBatch):  # RolloutClient has released these prompts at the pool
            for pid, sub in split_by_prompt(msg).items():
                if sub.policy_versions and min(sub.policy_versions) < self.pool.policy_version:
                    self.counters["stale_samples"] += len(sub)
                if self.ledger.generated(pid, sub, peer.name):
                    self._score_here(pid, sub)
        elif isinstance(msg, Error):  # a rollout server refusing prompts (call id 0)
            self.pool.complete(identity, msg.prompt_ids)
            if msg.code == AGENT_FAILED:
                self.counters["failed_episodes"] += len(msg.prompt_ids)
            if msg.code == AGENT_FAILED and self.drop_failed_episodes:
                self._drop_episodes(peer.name, msg)
            else:
                self._on_error(peer.name, msg, msg.prompt_ids)
        else:  # includes a late ScoredBatch whose request was given up: the ledger re-issued it
            log.debug("ignoring %s from %s", type(msg).__name__, peer.name)

    def _score_here(self, pid: int, sub: SampleBatch) -> None:
        """A prompt the run's scoring rates without a reward service is scored now; the others
        wait for one (``_dispatch_scoring``)."""
        try:
            scored = self.scoring.route(sub)
        except ValueError as e:
            self._on_error(sub.server, Error(code="bad_request", message=str(e)), [pid])
            return
        if scored is not None:
            self.ledger.start_scoring([pid], scored.server)
            self.ledger.scored(pid, scored, scored.server)

    def _drop_episodes(self, peer: str, err: Error) -> None:
        """The prompts of failed episodes end as failed groups (``to_rollout`` and the async feed
        count and leave them out), with the server's message as the reason."""
        log.warning("%s: %s (dropped: --agent_failure drop)", peer, err.message)
        for pid in err.prompt_ids:
            e = self.ledger.entries.get(pid)
            if e is None or not self.ledger.generated(pid, None, peer):  # a late or duplicate answer
                continue
            n = self._sampling_of[pid].n
            failed = ScoredBatch(
                prompt_ids=[pid] * n,
                sample_indices=list(range(n)),
                rewards=torch.full((n,), float("nan")),
                failed=[f"agent episode failed: {err.message}"] * n,
                server=AGENT_SCORER,
            )
            self.ledger.start_scoring([pid], AGENT_SCORER)
            self.ledger.scored(pid, failed, AGENT_SCORER)

    def _on_scored(self, peer: str, msg: ScoredBatch) -> None:
        entries = self.ledger.entries
        lengths = []
        for pid, idx in zip(msg.prompt_ids, msg.sample_indices, strict=True):
            e = entries.get(pid)
            sb = e.samples if e is not None else None
            lengths.append(sb.response_lengths[sb.sample_indices.index(idx)] if sb is not None else 0)
        for pid, sub in split_scored_by_prompt(msg, lengths).items():
            e = entries.get(pid)
            if e is not None and e.samples is not None:  # else a late answer: the ledger drops it
                sub = self.scoring.merge(e.samples, sub)
            self.ledger.scored(pid, sub, peer)

    def _on_error(self, peer: str, err: Error, prompt_ids: list[int]) -> None:
        self.counters["error_replies"] += 1
        ids = list(dict.fromkeys(err.prompt_ids or prompt_ids))
        log.error("%s answered %s: %s (prompts %s)", peer, err.code, err.message, ids[:8])
        self.ledger.lost(ids, f"answered {err.code}: {err.message}", holder=peer, error=True)

    def _dispatch_generation(self) -> None:
        queued = self.ledger.queued()
        if not queued or self.pool.pick("rollout") is None:
            return
        # A PromptBatch has one SamplingParams, and seeds for all its prompts or none: prompts
        # are sent in runs of equal sampling and seededness.
        runs: dict[tuple[int, bool], list[Entry]] = {}
        for e in queued:
            runs.setdefault((id(self._sampling_of[e.prompt_id]), e.payload.seed is None), []).append(e)
        for (_, unseeded), run in runs.items():
            sampling = self._sampling_of[run[0].prompt_id]
            for start in range(0, len(run), self.max_prompts_per_request):
                chunk = run[start : start + self.max_prompts_per_request]
                unplaced = set(
                    self.rollout.submit(
                        [e.prompt_id for e in chunk],
                        [e.payload.tokens for e in chunk],
                        sampling,
                        policy_version=self.pool.policy_version,
                        seeds=None if unseeded else [e.payload.seed for e in chunk],
                        agent=self.agent,
                        labels=[label_text(e.payload.label) for e in chunk] if self.agent else None,
                    )
                )
                for e in chunk:
                    # No holder: its server took it, then failed a later send of this submit and
                    # is dead with it (lost work the ledger ignores): it stays queued for the next turn.
                    holder = self.pool.holder(e.prompt_id) if e.prompt_id not in unplaced else None
                    if holder is not None:
                        self.ledger.start_generation([e.prompt_id], holder.name, version=self.pool.policy_version)
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
            samples = concat_samples([e.samples for e in chunk])
            per_sample = [e for e in chunk for _ in range(len(e.samples))]
            prompts = [e.payload.text for e in per_sample]
            queries: Sequence[str] = ()
            if self.detokenize is not None:
                responses = self.detokenize([r.tolist() for r in samples.split_responses()])
                queries = [p + r for p, r in zip(prompts, responses, strict=True)]
            # An agent episode's own prompt (its environment may have rewritten the first
            # observation): concat_samples keeps it, and only for episodes.
            episode_prompts = samples.prompt_token_ids
            req = build_score_request(
                samples,
                episode_prompts if episode_prompts is not None else [e.payload.tokens for e in per_sample],
                prompts,
                [e.payload.label for e in per_sample],
                queries,
            )
            if self.rewards.submit(req, peer) is not None:
                self.ledger.start_scoring([e.prompt_id for e in chunk], peer.name)

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

    # ------------------------------------------------------------------ non-blocking use (async schedule)
    def take_done(self) -> list[Entry]:
        """Generated and scored prompts, each returned once (``scored_samples(e)`` has its samples).
        For a caller that drives ``pump`` itself instead of ``collect``."""
        done = self.ledger.take_done()
        for e in done:
            self._sampling_of.pop(e.prompt_id, None)
        return done

    def abort(self, prompt_ids: list[int], reason: str) -> list[Entry]:
        """Takes prompts out of the data path whatever their state; a rollout server generating
        one is told to drop it (``Abort``, not a call), so it stops spending compute on it. A
        late answer for one of them is dropped as a duplicate. Returns the removed entries."""
        by_holder: dict[str, list[int]] = {}
        for pid in prompt_ids:
            e = self.ledger.entries.get(pid)
            if e is not None and e.state is State.GENERATING and e.holder:
                by_holder.setdefault(e.holder, []).append(pid)
        for peer in self.pool.alive("rollout"):
            pids = by_holder.get(peer.name)
            if pids:
                self.pool.complete(peer.identity, pids)  # its capacity is free for the next prompts
                self.pool.send_work(peer, Abort(prompt_ids=pids, reason=reason), ())
        removed = self.ledger.remove(prompt_ids)
        for e in removed:
            self._sampling_of.pop(e.prompt_id, None)
        return removed

    # ------------------------------------------------------------------ collect
    def collect(
        self,
        items: list[PromptItem],
        *,
        timeout_s: float,
        sampling: SamplingParams | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> CollectResult:
        """Generates (with ``sampling``, default the controller's) and scores ``items``; returns
        them as a Rollout of complete groups, in prompt order. Raises TimeoutError naming
        what is missing."""
        sampling = sampling or self.sampling
        ids = self.add_prompts(items, sampling)
        deadline = time.monotonic() + timeout_s
        done: dict[int, Entry] = {}
        wanted = set(ids)
        while len(done) < len(ids):
            self.pump(0.05)
            for e in self.ledger.take_done():
                self._sampling_of.pop(e.prompt_id, None)
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
        return self.to_rollout([done[i] for i in ids], sampling.n)

    def to_rollout(self, entries: list[Entry], group_size: int) -> CollectResult:
        """Done entries as a ``CollectResult``: complete groups in the entries' order; a group whose
        scoring failed is counted and left out. (``collect`` ends with it; a caller that pumps
        itself, the async feed, uses it too.)"""
        samples: list[ScoredSample] = []
        failed_groups, reasons = 0, []
        kept = []
        for e in entries:
            bad = [r for r in (e.scores.failed or []) if r]
            if bad:
                failed_groups += 1
                self.counters["failed_samples"] += len(bad)
                reasons.append(bad[0])
                continue
            kept.append(e)
            samples.extend(scored_samples(e))
        if failed_groups:
            log.warning("dropped %d group(s) whose scoring failed (first reason: %s)", failed_groups, reasons[0])
        return CollectResult(Rollout(samples, group_size), kept, failed_groups, reasons)


AGENT_FAILED = "agent_failed"  # rollout server -> controller Error code: an episode failed (not the server)


def label_text(label: Any) -> str:
    """A dataset label as the agent receives it: text as is, anything else as JSON."""
    if label is None:
        return ""
    return label if isinstance(label, str) else json.dumps(label)


def scored_samples(e: Entry) -> list[ScoredSample]:
    """A done ledger entry's samples, by sample index, joined with their scores."""
    sb, sc = e.samples, e.scores
    order = sorted(range(len(sb)), key=lambda i: sb.sample_indices[i])
    if sb.logprobs is None:
        sb.split_logprobs()  # raises: the learner needs the sampler's log-probs
    # Per-sample views of the received frames, no copy: a rollout server's SampleBatch is one
    # prompt's samples, so its frame holds exactly what they need and lives as long as they do.
    # The frames are read-only memory: nothing downstream writes into a ScoredSample's tensors
    # (collate and broadcast copy out of them). Token ids stay tensors: a Python list of them is
    # 40 B a token and was most of this function's time at long answers.
    resp = torch.as_tensor(sb.response_ids).to(torch.int32).split(sb.response_lengths)
    lps = torch.as_tensor(sb.logprobs).to(torch.float32).split(sb.response_lengths)
    score_row = {idx: j for j, idx in enumerate(sc.sample_indices)}
    # The reward service's extra_logs (an agent's own scoring carries the agent's, read below
    # from the samples); a list of another length than the rows is a service's bug, not logged.
    reward_logs = (
        {k: v for k, v in sc.extra_logs.items() if len(v) == len(sc.sample_indices)}
        if sc.server != AGENT_SCORER
        else {}
    )
    ref_offsets = None
    if sc.ref_logprobs is not None or sc.teacher_logprobs is not None:  # flat, in sc.sample_indices' order
        length = dict(zip(sb.sample_indices, sb.response_lengths, strict=True))
        ref_offsets, acc = {}, 0
        for idx in sc.sample_indices:
            ref_offsets[idx] = (acc, length[idx])
            acc += length[idx]
    ep = sb.episodes
    masks = ep.action_mask.bool().split(sb.response_lengths) if ep is not None else None
    # The group shares its prompt's token list (read-only downstream); an agent's episodes each
    # carry their own (the prompt as the episode's first turn saw it).
    prompt = e.payload.tokens
    out = []
    for i in order:
        idx = sb.sample_indices[i]
        ref = teacher = topk_ids = topk_lps = None
        if ref_offsets is not None:
            a, n = ref_offsets[idx]
            if sc.ref_logprobs is not None:
                ref = sc.ref_logprobs.reshape(-1)[a : a + n].float()
            if sc.teacher_logprobs is not None:
                teacher = sc.teacher_logprobs.reshape(-1)[a : a + n].float()
            if sc.teacher_topk_ids is not None and sc.teacher_topk_logprobs is not None:  # (L, K), rows alike
                topk_ids = torch.as_tensor(sc.teacher_topk_ids)[a : a + n].to(torch.int32)
                topk_lps = torch.as_tensor(sc.teacher_topk_logprobs)[a : a + n].float()
        out.append(
            ScoredSample(
                prompt_id=e.prompt_id,
                sample_index=idx,
                prompt=list(sb.prompt_token_ids[i]) if ep is not None and sb.prompt_token_ids else prompt,
                response=resp[i],
                rollout_logprobs=lps[i],
                ref_logprobs=ref,
                # the run's Scoring has put each sample's reward here (an episode's own, or the service's)
                reward=float(sc.rewards[score_row[idx]]),
                finish_reason=sb.finish_reasons[i] if sb.finish_reasons else "stop",
                policy_version=sb.policy_versions[i] if sb.policy_versions else 0,
                action_mask=masks[i].clone() if masks is not None else None,
                turns=ep.turns[i] if ep is not None and ep.turns else 0,
                reward_logs={k: float(v[score_row[idx]]) for k, v in reward_logs.items()},
                agent_logs=dict(ep.logs[i]) if ep is not None and ep.logs else {},
                teacher_logprobs=teacher,
                teacher_topk_ids=topk_ids,
                teacher_topk_logprobs=topk_lps,
            )
        )
    return out
