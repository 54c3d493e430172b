"""Rank 0's weights for the rollout fleet: joiners brought up to date, pushes to every server.

``common.weights.publisher.WeightPublisher`` moves the bytes and keeps one weight group per
server (and one fleet group over all of them); ``learner.controller.pool.ServicePool`` knows
who is there. ``FleetWeights`` keeps the two in step and records what each push did in the
pool, the one place the run's policy version lives (``ServicePool.policy_version``):

- ``sync_joiners(push)``: servers that said Hello since the last call get a weight group and,
  if anything was pushed before and ``push`` is set, the current weights; then they may take
  work (``Peer.ready``). A joiner that fails is declared dead (it says Hello again).
- ``push(version)``: one push of the publisher's model to every live, connected server (the
  fleet group, formed again when servers joined or left). Servers that fail are declared dead
  (``pool.reap`` returns their prompts); the pool then holds ``version``.

Without a publisher (a controller whose tests have no model) joiners are ready at once and
``push`` is refused. Under ZeRO-3 across several ranks a push is a collective: the other ranks
call ``publisher.push(version)`` at the same point (``learner.rl.weight_push.WeightPush``).
"""

from __future__ import annotations

import logging

from common.protocol import RolloutCapabilities
from common.weights.publisher import PushReport, WeightPublisher, WeightSyncError
from learner.controller.pool import ServicePool

log = logging.getLogger(__name__)

ROLE = "rollout"


class FleetWeights:
    def __init__(self, pool: ServicePool, publisher: WeightPublisher | None = None) -> None:
        self.pool, self.publisher = pool, publisher

    def _forget_the_dead(self) -> None:
        """Weight groups of servers the pool declared dead are dropped (nobody to tell)."""
        if self.publisher is None:
            return
        for name in list(self.publisher.links):
            peer = self.pool.peers.get(name.encode())
            if peer is None or not peer.alive:
                self.publisher.disconnect(name, notify=False)

    def sync_joiners(self, push: bool = True) -> list[str]:
        """Readies the servers that joined since the last call (see the module docstring);
        returns their names."""
        synced = []
        joined = [p for p in self.pool.take_joined() if p.role == ROLE and p.alive]
        if joined:
            self._forget_the_dead()
        for peer in joined:
            try:
                if self.publisher is not None:
                    caps = peer.capabilities
                    if not isinstance(caps, RolloutCapabilities):
                        raise WeightSyncError("connect", {peer.name: "its Hello announced no rollout capabilities"})
                    self.publisher.connect(peer.name, workers=caps.workers, dtype=caps.dtype or None)
                    if push and self.pool.pushed:
                        version = self.pool.policy_version
                        self.publisher.push(version, [peer.name])
                        self.pool.weights_pushed(version, [peer.name])
            except WeightSyncError as e:
                self.pool.mark_dead(peer, str(e))
                continue
            peer.ready = True
            synced.append(peer.name)
        return synced

    def push(self, version: int) -> PushReport:
        """Pushes the publisher's model as ``version`` to every live, connected server. Servers
        that fail are declared dead and named in ``report.failed``; servers a failure cut off
        are retried within the push and count as updated. Raises WeightSyncError only if no
        server could be updated."""
        if self.publisher is None:
            raise RuntimeError("FleetWeights has no WeightPublisher: nothing to push")
        self._forget_the_dead()
        servers = [p.name for p in self.pool.alive(ROLE) if p.name in self.publisher.links]
        try:
            report = self.publisher.push(version, servers)
        except WeightSyncError as e:
            if e.report is None:  # push() attaches what it did; without it there is nothing to go on
                raise
            report = e.report
            for server, why in e.failures.items():
                peer = self.pool.peers.get(server.encode())
                if peer is not None:
                    self.pool.mark_dead(peer, f"weight push v{version} failed: {why}")
            if servers and not report.updated:
                raise
        self.pool.weights_pushed(version, report.updated)
        return report
