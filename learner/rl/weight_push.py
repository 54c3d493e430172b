"""When and to whom the learner pushes weights: the schedule's side of weight sync.

``common.weights.publisher.WeightPublisher`` moves the bytes; rank 0's
``learner.controller.weight_fleet.FleetWeights`` keeps its groups in step with the servers and
records each push in the pool (the run's one policy version). This class ties them to the
training loop:

- one publisher on every learner rank (under ZeRO-3 a push gathers on all of them); rank 0's has
  the rollout client as its control channel (``make_publisher``);
- ``push(version)`` at the step's sync point, on every rank, is the one call a push is: rank 0
  first connects servers that joined since the last push (they get this push too), then pushes
  to every connected server through one fleet group (formed again when the servers changed: see
  docs/rollout.md), and the pool then holds ``version``;
- between pushes, joiners are brought up to date at once when rank 0 can push alone (no ZeRO-3
  across several ranks) and the learner is not training meanwhile (not async); otherwise they
  wait for the next push (``rank0_syncs_joiners``).

Backend: ``auto`` picks NCCL when CUDA is available, else gloo — the same code path.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from common.net import bind_address
from common.weights import resolve_backend
from common.weights.publisher import PushReport, WeightPublisher
from learner.controller.weight_fleet import FleetWeights
from learner.rl.config import PPOConfig
from learner.rl.config.sections import ServicesSection

log = logging.getLogger(__name__)


def _sync_host(services: ServicesSection) -> str:
    """Where the rollout servers' workers reach this rank for weight sync: ``--sync_host``, else
    the address the controller is bound to when it is one (the servers reach the controller
    there already), else this host's name. The weight-transfer stores listen on that address
    only when it is an IP address (``common.net.bind_address``); a host name, or a controller
    bound to every interface (0.0.0.0, *), leaves them on every interface (docs/security.md)."""
    if services.sync_host:
        return services.sync_host
    bind = services.controller_bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    address = bind_address(bind)
    if address:
        return address
    return socket.gethostname()


def rank0_syncs_joiners(cfg: PPOConfig, world_size: int) -> bool:
    """Whether rank 0 may bring a joiner up to date between pushes: it reads the weights alone,
    which ZeRO-3 across ranks cannot (a gather is a collective) and which async training is
    changing meanwhile."""
    return not (cfg.ds.zero_stage == 3 and world_size > 1) and not cfg.train.async_enable


def make_publisher(cfg: PPOConfig, engine: Any, *, rank: int, control: Any = None) -> WeightPublisher:
    """This rank's publisher of ``engine``'s weights; rank 0 passes its RolloutClient as ``control``."""
    return WeightPublisher(
        engine,
        control=control,
        rank=rank,
        backend=resolve_backend(cfg.vllm.sync_backend),
        host=_sync_host(cfg.services),
        timeout_s=cfg.services.weight_sync_timeout_s,
        lora_sync=cfg.services.lora_sync if cfg.ds.lora.rank else "merged",
        sync=cfg.services.weight_sync,
    )


class WeightPush:
    def __init__(self, publisher: WeightPublisher, fleet: FleetWeights | None) -> None:
        """``fleet``: rank 0's (None on the other ranks)."""
        self.publisher, self.fleet = publisher, fleet

    def push(self, version: int) -> PushReport | None:
        """Call on every rank at the same point. Rank 0 first connects servers that joined since
        the last push (they receive this very push), then sends; it returns the report (other
        ranks return None)."""
        if self.fleet is None:
            self.publisher.push(version)
            return None
        self.fleet.sync_joiners(push=False)
        r = self.fleet.push(version)
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
