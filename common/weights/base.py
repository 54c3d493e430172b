"""What a weight-transfer backend is, and the registry that names them.

A backend is how the bytes of a push travel from the learner (rank 0) to one rollout server's
vLLM workers. It has two halves, under one name:

- the sender, in the learner: a ``WeightSender`` subclass in ``common/weights/<name>.py``,
  listed in ``SENDERS``. ``listen`` starts forming a group with one server and says what the
  server's workers need to join it (``WeightSyncInit.init_info``); ``Rendezvous.join`` completes
  it; ``send`` moves one push's buckets through the groups of every target server at once;
- the receiver, in vLLM's workers: a vLLM ``WeightTransferEngine`` under the same name in vLLM's
  ``WeightTransferEngineFactory``. vLLM ships ``nccl`` and ``ipc``; the rollout service registers
  the ones it lacks (``rollout_service/weight_receiver.py``).

The control calls around the bytes (start / update / finish, ``common/protocol.py``) are the same
for every backend; ``common.weights.publisher.WeightPublisher`` makes them.

No torch import at module load: ``resolve_backend`` is called where a config has just been
parsed, and a sender module is imported only when its backend is used.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from common.weights.wire import Buffers

AUTO = "auto"

# Backend name -> "module:class" of its sender, imported on first use.
SENDERS: dict[str, str] = {
    "gloo": "common.weights.gloo:GlooSender",
    "nccl": "common.weights.nccl:NcclSender",
}


def known_backends() -> list[str]:
    return [AUTO, *SENDERS]


def resolve_backend(requested: str) -> str:
    """The backend ``requested`` stands for: ``auto`` is NCCL where CUDA is available, else gloo
    (the same on the learner and on every server, so both sides pick alike on one kind of host).
    Raises ValueError for a name no backend has, listing the known ones."""
    if requested == AUTO:
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in SENDERS:
        raise ValueError(f"unknown weight-transfer backend {requested!r} (known: {', '.join(known_backends())})")
    return requested


def sender_class(backend: str) -> type[WeightSender]:
    """The ``WeightSender`` subclass of ``backend`` (``auto`` resolved here)."""
    module, _, cls = SENDERS[resolve_backend(backend)].partition(":")
    return getattr(importlib.import_module(module), cls)


class Work(Protocol):
    def wait(self) -> Any:
        """Returns once the operation is complete; raises (within the group's timeout) if a peer
        failed or stalled."""


class SendGroup(Protocol):
    """A formed group of the learner (rank 0) and one or several servers' workers (ranks 1..n)."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Work:
        """Starts sending ``tensor`` to every worker; asynchronous, so that one bucket can be on
        its way to several servers at once."""

    def close(self) -> None:
        """Drops the group; safe when the peer is already gone."""


@dataclass
class Rendezvous:
    """A group half formed: the learner is ready for the server's workers. Send them
    ``init_info`` (in ``WeightSyncInit``), then ``join(label)`` blocks until they have joined,
    at most the sender's timeout, and returns the group (``label`` names the server in errors)."""

    init_info: dict[str, Any]
    join: Callable[[str], SendGroup]


class WeightSender(ABC):
    """The learner's half of one backend. Built once per publisher; forms a group per server."""

    name: ClassVar[str]
    # Whether the receiving half can take a bucket in segments (``segment_bytes``).
    takes_segments: ClassVar[bool] = False
    # The receiving engine can load one received tensor under several names (a tied lm_head
    # from the embedding, ``WeightUpdate.aliases``): tied parameters then travel once.
    sends_tied_once: ClassVar[bool] = False

    def __init__(self, *, host: str, bucket_bytes: int, timeout_s: float) -> None:
        self.host, self.bucket_bytes, self.timeout_s = host, bucket_bytes, timeout_s
        self._segment_bytes = float("inf")

    @property
    def segment_bytes(self) -> float:
        """How a bucket goes on the wire (``common.weights.wire.segment_plan``): tensors of at
        least this many bytes are sent from their own memory, in a broadcast of their own; inf:
        one broadcast per bucket (the only choice of a backend whose receiver cannot take
        segments: vLLM's NCCL consumer receives a bucket in one piece)."""
        return self._segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, value: float) -> None:
        if value != float("inf") and not self.takes_segments:
            raise ValueError(f"the {self.name} receiver takes a bucket in one piece: segment_bytes stays inf")
        self._segment_bytes = value

    @abstractmethod
    def listen(self, world_size: int, *, fleet: bool = False) -> Rendezvous:
        """Starts forming a group of ``world_size`` ranks: the learner and one server's workers,
        or (``fleet``) the workers of several servers, each told its ``rank_offset`` by the
        publisher. A fleet group must cost the learner about one copy of the bytes per push
        whatever its size (NCCL's broadcast does; gloo relays, ``common/weights/gloo.py``)."""

    def send(
        self, pairs: Iterator[tuple[str, torch.Tensor]], groups: dict[str, SendGroup], buffers: Buffers
    ) -> dict[str, str]:
        """Sends one push (``pairs`` in update-metadata order) into every group of ``groups``
        (server -> group); returns {server: error} for the groups that failed, the others having
        received everything. Default: vLLM's packed layout, one pass, every bucket fanned out."""
        from common.weights.wire import send_packed

        return send_packed(pairs, groups, self.bucket_bytes, buffers=buffers, segment_bytes=self.segment_bytes)
