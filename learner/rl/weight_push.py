"""When and to whom the learner pushes weights: the schedule's side of weight sync.

``common.weights.publisher.WeightPublisher`` moves the bytes; ``learner.controller.rollout_client.RolloutClient``
forms a weight group with each server. This class ties them to the training loop:

- one publisher on every learner rank (under ZeRO-3 a push gathers on all of them);
- ``connect(endpoint, pool)`` on rank 0 makes the RolloutClient that shares the publisher;
- ``push(version)`` at the step's sync point, on every rank: rank 0 first connects servers that
  joined since the last push (they get this push too), then pushes to every connected server,
  through one fleet group (formed again when the servers changed: see docs/rollout.md);
- between pushes, joiners are brought up to date at once when rank 0 can push alone (no ZeRO-3
  across several ranks); otherwise they wait for the next push.

Backend: ``auto`` picks NCCL when CUDA is available, else gloo — the same code path.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import torch.distributed as dist

from common.net import bind_address
from common.weights import resolve_backend
from common.weights.publisher import PushReport, WeightPublisher
from learner.rl.config import PPOConfig

log = logging.getLogger(__name__)


def _sync_host(cfg: PPOConfig) -> str:
    """Where the rollout servers' workers reach this rank for weight sync: ``--sync_host``, else
    the address the controller is bound to when it is one (the servers reach the controller
    there already), else this host's name. The weight-transfer stores listen on that address
    only when it is an IP address (``common.net.bind_address``); a host name, or a controller
    bound to every interface (0.0.0.0, *), leaves them on every interface (docs/security.md)."""
    if cfg.sync_host:
        return cfg.sync_host
    bind = cfg.controller_bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    address = bind_address(bind)
    if address:
        return address
    return socket.gethostname()


class WeightPush:
    def __init__(self, cfg: PPOConfig, engine: Any) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        backend = resolve_backend(cfg.weight_sync_backend)
        self.publisher = WeightPublisher(
            engine, rank=self.rank, backend=backend, host=_sync_host(cfg), timeout_s=cfg.weight_sync_timeout_s
        )
        # Under ZeRO-3 on several ranks a push is a collective: rank 0 cannot serve a joiner alone.
        self.rank0_can_push_alone = not (cfg.zero_stage == 3 and world > 1)
        self.last_report: PushReport | None = None
        self.rollout: Any = None  # rank 0's RolloutClient, set by connect()

    def connect(self, endpoint: Any, pool: Any) -> Any:
        """Rank 0: the RolloutClient on the controller socket, sharing this publisher (its weight
        groups are the rollout servers' connections). Pushes then go to its servers."""
        from learner.controller.rollout_client import RolloutClient

        self.rollout = RolloutClient(endpoint, pool, self.publisher)
        return self.rollout

    def push(self, version: int) -> PushReport | None:
        """Call on every rank at the same point. Rank 0 first connects servers that joined since
        the last push (they receive this very push), then sends; it returns the report (other
        ranks return None). The caller then tells the controller the new version."""
        if self.rank != 0:
            self.publisher.push(version)
            return None
        if self.rollout is None:
            raise RuntimeError("WeightPush.push on rank 0 before connect(): no rollout client to push to")
        self.rollout.sync_joiners(push=False)
        r = self.last_report = self.rollout.push_weights(version)
        log.info(
            "weights v%d -> %d server(s) in %.2f s (%d through the fleet group%s)%s",
            version,
            len(r.updated),
            r.seconds.get("total", 0.0),
            len(r.fleet),
            f", {len(r.retried)} retried alone" if r.retried else "",
            f" (failed: {sorted(r.failed)})" if r.failed else "",
        )
        return r

    def close(self) -> None:
        self.publisher.close()
