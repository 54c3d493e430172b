"""Controller-side helper for reward services: send ScoreRequests, match ScoredBatches.

Built on ``ServicePool`` (``learner/controller/pool.py``): the pool picks the least-loaded live reward
service and records the request's prompt ids as work that peer holds (the pool's work keys
are prompt ids, as the ledger's). The client adds what the pool does not know: which
request each ``call_id`` was, so a reply -- ``ScoredBatch`` or ``Error`` -- is matched to its
request, and a dead peer's requests come back whole, ready to resubmit.

Socket-free like the pool: the controller's loop feeds it messages. In a loop::

    client = RewardClient(pool)
    client.submit(build_score_request(samples, prompt_tokens, prompts, labels))
    ...
    got = endpoint.recv(timeout=0.1)
    if got and (msg := pool.handle(*got)) is not None:
        outcome = client.on_message(got[0], msg)      # None: not a reward reply
    for req in client.on_lost(pool.reap()):          # a service died holding these
        client.submit(req)

Deadlines are the ledger's (``PromptLedger.expire`` re-issues a prompt not scored in time, under
a new request); an answer to a request the client no longer holds is counted ``late`` and dropped.

``build_score_request`` fills ``samples.prompt_token_ids``: the reward service needs the
prompt tokens for reference log-probs and for a reward model (it answers ``bad_request``
otherwise); rollout servers do not echo them, the controller has them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.protocol import Error, Message, SampleBatch, ScoredBatch, ScoreRequest
from common.transport import safe_label
from learner.controller.pool import LostWork, Peer, ServicePool

log = logging.getLogger(__name__)


def build_score_request(
    samples: SampleBatch,
    prompt_tokens: Sequence[Sequence[int]] | dict[int, Sequence[int]],
    prompts: Sequence[str] | dict[int, str] = (),
    labels: Sequence[Any] | dict[int, Any] = (),
    queries: Sequence[str] = (),
) -> ScoreRequest:
    """A ScoreRequest for ``samples``, with the prompt tokens set on the batch.

    ``prompt_tokens`` / ``prompts`` / ``labels`` are per sample (length N) or per prompt id
    (a dict looked up with each sample's ``prompt_id``); text and labels may be omitted.
    """

    def per_sample(x):
        return [x[pid] for pid in samples.prompt_ids] if isinstance(x, dict) else list(x)

    toks = [list(t) for t in per_sample(prompt_tokens)]
    sb = SampleBatch(
        prompt_ids=samples.prompt_ids,
        sample_indices=samples.sample_indices,
        response_lengths=samples.response_lengths,
        response_ids=samples.response_ids,
        logprobs=samples.logprobs,
        finish_reasons=samples.finish_reasons,
        policy_versions=samples.policy_versions,
        prompt_token_ids=toks,
        server=samples.server,
    )
    return ScoreRequest(samples=sb, prompts=per_sample(prompts), labels=per_sample(labels), queries=list(queries))


@dataclass
class PendingScore:
    request: ScoreRequest
    peer: Peer
    keys: list[int]  # the prompt ids the pool records as held by ``peer``
    sent_at: float


@dataclass
class ScoreOutcome:
    request: ScoreRequest
    peer: str  # name of the service that answered
    scored: ScoredBatch | None = None  # the reply; None when ``error`` is set
    error: Error | None = None  # bad_request / internal / overloaded / shutting_down ...
    seconds: float = 0.0  # from send to reply
    failed: list[str] = field(default_factory=list)  # the per-sample failure reasons in ``scored``

    @property
    def ok(self) -> bool:
        return self.scored is not None


class RewardClient:
    """Dispatch and matching of ScoreRequests over a ServicePool. Not thread-safe."""

    def __init__(self, pool: ServicePool, *, role: str = "reward", clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.role = role
        self.clock = clock
        self.pending: dict[int, PendingScore] = {}  # call_id -> request in flight
        self.counters = {"sent": 0, "scored": 0, "errors": 0, "lost": 0, "late": 0}

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def submit(self, request: ScoreRequest, peer: Peer | None = None) -> PendingScore | None:
        """Sends ``request`` to ``peer`` (default: the least-loaded reward service with room).
        Returns None when no service has room or the send failed (the pool then marks the
        peer dead); the caller keeps the request and tries again later."""
        peer = peer or self.pool.pick(self.role)
        if peer is None:
            return None
        request.call_id = self.pool.endpoint.core.new_call_id()  # shared with Endpoint.call: ids never collide
        keys = list(dict.fromkeys(request.samples.prompt_ids))
        if not self.pool.send_work(peer, request, keys):
            return None
        p = self.pending[request.call_id] = PendingScore(request, peer, keys, self.clock())
        self.counters["sent"] += 1
        return p

    def on_message(self, identity: bytes, msg: Message) -> ScoreOutcome | None:
        """Matches a ScoredBatch or Error (one the pool passed on) to its request; None if it
        is not an answer to a request of this client. A late answer -- its request was already
        given up as lost -- is dropped and counted (``late``)."""
        if not isinstance(msg, (ScoredBatch, Error)) or msg.call_id == 0:
            return None
        p = self.pending.get(msg.call_id)
        if p is None or p.peer.identity != identity:
            if isinstance(msg, ScoredBatch):
                self.counters["late"] += 1
                log.info("dropping a late ScoredBatch (call %d) from %s", msg.call_id, safe_label(identity))
            return None
        del self.pending[msg.call_id]
        self.pool.complete(identity, p.keys)
        out = ScoreOutcome(p.request, p.peer.name, seconds=self.clock() - p.sent_at)
        if isinstance(msg, Error):
            self.counters["errors"] += 1
            out.error = msg
        else:
            self.counters["scored"] += 1
            out.scored = msg
            out.failed = [r for r in msg.failed if r]
        return out

    def on_lost(self, lost: Iterable[LostWork]) -> list[ScoreRequest]:
        """The requests held by peers the pool declared dead, to resubmit."""
        dead = {lw.peer.identity for lw in lost}
        back = [cid for cid, p in self.pending.items() if p.peer.identity in dead]
        self.counters["lost"] += len(back)
        return [self.pending.pop(cid).request for cid in back]
