"""The controller's side of the rollout servers: work out, samples in, calls answered.

Built on ``learner.controller.pool.ServicePool`` (who is there, what each holds, who died).
``RolloutClient`` owns the reading of the controller's ROUTER endpoint: every message goes
through ``pool.handle`` (so heartbeats keep peers alive even while a weight push blocks the
loop for minutes), replies to calls go to whoever is waiting on them, and everything else
(SampleBatches, per-prompt Errors, and other roles' results) is queued for ``poll``. It is also
the weight publisher's control channel (``common.weights.publisher.SyncControl``: ``request``);
the weights themselves are ``learner.controller.weight_fleet.FleetWeights``'s.

A controller loop::

    client = RolloutClient(endpoint, pool)
    fleet = FleetWeights(pool, WeightPublisher(policy, control=client, backend="gloo"))
    while training:
        fleet.sync_joiners()                         # new servers: weight group + current weights
        unplaced = client.submit(ids, tokens, sampling, policy_version=pool.policy_version)
        for ident, msg in client.poll(timeout=0.1):  # SampleBatch / Error(prompt_ids=...) / ...
            ...                                      # ledger.generated(...) / ledger.lost(...)
        for lost in client.reap():                   # dead servers: their prompt ids
            ledger.lost(lost.keys, lost.reason)
        ...
        fleet.push(v + 1)                            # after an optimizer step
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Sequence

from common import protocol as P
from common.transport import CallTimeout, Endpoint, PeerUnavailable, RemoteError, safe_label
from learner.controller.pool import LostWork, Peer, ServicePool

log = logging.getLogger(__name__)

ROLE = "rollout"


class _Pending:
    """A call out to one server; ``result`` pumps the socket until its reply or the deadline."""

    def __init__(self, client: RolloutClient, server: str, call_id: int, what: str) -> None:
        self.client, self.server, self.call_id, self.what = client, server, call_id, what

    def result(self, timeout: float) -> P.Message:
        c = self.client
        deadline = time.monotonic() + timeout
        try:
            while self.call_id not in c._replies:
                c._judge_silence()  # silence past the deadline counts while we wait, too
                peer = c.peer(self.server)
                if peer is not None and not peer.alive:
                    # Declared dead while we waited (a fatal notice, silence): no reply will come.
                    raise PeerUnavailable(
                        f"{self.server} is gone (declared dead) while waiting for its reply to {self.what}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CallTimeout(f"no reply from {self.server} to {self.what} within {timeout:.1f} s")
                c._pump_one(min(left, 0.5))
        finally:
            c._waiting.discard(self.call_id)  # a reply after this is late and dropped
        reply = c._replies.pop(self.call_id)
        if isinstance(reply, P.Error):
            raise RemoteError(self.server, reply)
        return reply


class RolloutClient:
    def __init__(self, endpoint: Endpoint, pool: ServicePool, *, call_timeout_s: float = 30.0) -> None:
        self.endpoint, self.pool = endpoint, pool
        self.call_timeout_s = call_timeout_s
        self._waiting: set[int] = set()
        self._replies: dict[int, P.Message] = {}
        self._inbox: deque[tuple[bytes, P.Message]] = deque()
        self._lost: list[LostWork] = []  # reaped while a call waited; handed out by reap()

    # ------------------------------------------------------------------ socket
    def _pump_one(self, timeout: float) -> bool:
        got = self.endpoint.recv(timeout=max(0.0, timeout))
        if got is None:
            return False
        ident, received = got
        assert ident is not None  # the controller's endpoint is a ROUTER: every message names its sender
        msg = self.pool.handle(ident, received)  # heartbeats, Hello, fatal errors end here
        if msg is None:
            return True
        peer = self.pool.peers.get(ident)
        if msg.call_id in self._waiting:  # a reply to one of this client's calls (any role: Shutdown)
            self._replies[msg.call_id] = msg
        elif peer is not None and peer.role != ROLE:
            self._inbox.append((ident, msg))  # another role's traffic: its own client matches it
        elif msg.call_id:
            log.info("dropping late %s (call %d) from %s", type(msg).__name__, msg.call_id, safe_label(ident))
        else:
            if isinstance(msg, P.SampleBatch):
                self.pool.complete(ident, set(msg.prompt_ids))
            elif isinstance(msg, P.Error) and msg.prompt_ids:
                self.pool.complete(ident, msg.prompt_ids)
            self._inbox.append((ident, msg))
        return True

    def poll(self, timeout: float = 0.0, max_messages: int = 1000) -> list[tuple[bytes, P.Message]]:
        """What has arrived: SampleBatches, Errors about prompts (their ``prompt_ids``), and any
        other role's results, as ``(identity, message)``. Waits up to ``timeout`` for the first.
        Prompts in what is returned are no longer counted as in flight at their server."""
        if not self._inbox:
            self._pump_one(timeout)
        for _ in range(max_messages):
            if not self._pump_one(0.0):
                break
        out = list(self._inbox)
        self._inbox.clear()
        return out

    # ------------------------------------------------------------------ calls (SyncControl)
    def request(self, server: str, msg: P.Message) -> _Pending:
        """Sends ``msg`` to ``server`` as a call; the reply is collected by ``.result(timeout)``."""
        msg.call_id = self.endpoint.core.new_call_id()
        self._waiting.add(msg.call_id)
        try:
            self.endpoint.send(msg, to=server.encode(), timeout=self.call_timeout_s)
        except PeerUnavailable:
            self._waiting.discard(msg.call_id)
            raise
        return _Pending(self, server, msg.call_id, type(msg).__name__)

    def call(self, server: str, msg: P.Message, timeout: float | None = None) -> P.Message:
        return self.request(server, msg).result(self.call_timeout_s if timeout is None else timeout)

    # ------------------------------------------------------------------ work
    def peer(self, server: str) -> Peer | None:
        return self.pool.peers.get(server.encode())

    def servers(self, ready_only: bool = True) -> list[str]:
        peers = self.pool.ready(ROLE) if ready_only else self.pool.alive(ROLE)
        return [p.name for p in peers]

    def submit(
        self,
        prompt_ids: Sequence[int],
        token_ids: Sequence[list[int]],
        sampling: P.SamplingParams,
        *,
        policy_version: int = 0,
        seeds: Sequence[int] | None = None,
        agent: P.AgentParams | None = None,
        labels: Sequence[str] | None = None,
    ) -> list[int]:
        """Spreads prompts over the ready servers by free capacity (least loaded first, an even
        share each). ``seeds``: one per prompt (``PromptBatch.seeds``) or None. Returns the
        prompt ids no server had room for; submit them again later."""
        per_prompt: Sequence[int | None] = [None] * len(prompt_ids) if seeds is None else seeds
        label_of = dict(zip(prompt_ids, labels, strict=True)) if labels is not None else None
        todo = list(zip(prompt_ids, token_ids, per_prompt, strict=True))
        # The servers with room, least relative load first (ties by name, as ServicePool.pick),
        # found once per call: asking the pool per chunk costs a pass over the fleet per prompt
        # when hundreds of servers have room for one or two prompts each.
        room = [(p.load, p.name, i, p) for i, p in enumerate(self.pool.ready(ROLE)) if len(p.in_flight) < p.capacity]
        heapq.heapify(room)
        while todo and room:
            _, _, i, peer = heapq.heappop(room)
            take = min(peer.capacity - len(peer.in_flight), math.ceil(len(todo) / (len(room) + 1)))
            chunk, rest = todo[:take], todo[take:]
            batch = P.PromptBatch(
                prompt_ids=[p for p, _, _ in chunk],
                token_ids=[list(t) for _, t, _ in chunk],
                sampling=sampling,
                policy_version=policy_version,
                seeds=[s for _, _, s in chunk if s is not None],  # every prompt's, or none (seeds=None)
                agent=agent,
                labels=[label_of[p] for p, _, _ in chunk] if label_of is not None else [],
            )
            if self.pool.send_work(peer, batch, batch.prompt_ids):
                todo = rest
                if len(peer.in_flight) < peer.capacity:
                    heapq.heappush(room, (peer.load, peer.name, i, peer))
        return [p for p, _, _ in todo]

    def reap(self) -> list[LostWork]:
        """Dead servers (silent past the pool's deadline, announced fatal, unreachable, failed a
        weight push) with the prompt ids each held."""
        self._judge_silence()
        lost, self._lost = self._lost, []
        return lost

    def _judge_silence(self) -> None:
        """Declares dead the peers silent past the deadline, after reading all that has arrived:
        a controller that read nothing for a while (a training step longer than the peer timeout)
        finds its services' heartbeats waiting in the socket, and its own absence is not their
        silence. Reading until the socket is empty ends: handling a message is far quicker than
        the services send them."""
        while self._pump_one(0.0):
            pass
        self._lost.extend(self.pool.reap())
