"""The gloo backend's learner half and the group both halves use: CPU runs take the NCCL path.

One group per (learner, rollout server): a plain ``ProcessGroupGloo`` on its own ``TCPStore``,
hosted by the learner (rank 0); the server's vLLM workers are ranks 1..k. Never the default
process group, so it coexists with vLLM's groups and DeepSpeed's, and a group can be formed or
dropped while everything else keeps running. The workers' half is
``rollout_service/weight_receiver_gloo.py`` (``GlooGroup`` is shared; nothing here imports vLLM).
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch.distributed import ProcessGroupGloo, TCPStore

from common.weights.base import Rendezvous, WeightSender
from common.weights.wire import DEFAULT_SEGMENT_BYTES


class GlooGroup:
    """A gloo group of one learner (rank 0) and one rollout server's workers, with its store.

    ``broadcast`` is asynchronous (returns the work handle): the learner fans one bucket out to
    several servers' groups at once and waits on all of them.
    """

    def __init__(self, store: TCPStore, pg: ProcessGroupGloo, rank: int, world_size: int, label: str) -> None:
        self.store, self.pg, self.rank, self.world_size, self.label = store, pg, rank, world_size, label

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        timeout_s: float,
        label: str,
        store: TCPStore | None = None,
    ) -> GlooGroup:
        """Joins (rank > 0) or hosts (rank 0, ``store`` already listening) the group. Blocks until
        every rank has connected, at most ``timeout_s``."""
        timeout = timedelta(seconds=timeout_s)
        try:
            if store is None:
                store = TCPStore(host, port, world_size, is_master=False, timeout=timeout)
            pg = ProcessGroupGloo(store, rank, world_size, timeout)
        except Exception as e:  # noqa: BLE001 - re-raised with who and where
            raise RuntimeError(
                f"weight-transfer group {label} (tcp://{host}:{port}, rank {rank} of "
                f"{world_size}) could not form within {timeout_s:.0f} s: {e}"
            ) from e
        return cls(store, pg, rank, world_size, label)

    @staticmethod
    def host_store(host: str, world_size: int, timeout_s: float, port: int = 0) -> TCPStore:
        """The learner's store, listening before any worker is told where it is (port 0: any)."""
        return TCPStore(
            host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        # Dropping the references closes the sockets; gloo has no explicit destroy that is
        # safe to call while a peer may be gone.
        self.pg = None
        self.store = None


class GlooSender(WeightSender):
    """Buckets go out as a few broadcasts each: tensors of at least ``segment_bytes`` from their
    own memory, runs of small ones packed first (the receiver lands each in its slice of the
    bucket, so the bytes on arrival are vLLM's packed layout either way)."""

    name = "gloo"

    def __init__(self, *, host: str, bucket_bytes: int, timeout_s: float) -> None:
        super().__init__(host=host, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        # The receiver cuts segments by the same rule: it travels in init_info.
        self.segment_bytes = DEFAULT_SEGMENT_BYTES

    def listen(self, world_size: int) -> Rendezvous:
        store = GlooGroup.host_store(self.host, world_size, self.timeout_s)
        # Workers wait twice as long as we do: when one server stalls, we wait timeout_s on it
        # before dropping it, and the healthy servers, waiting for their next bucket meanwhile,
        # must not time out first.
        init_info = {
            "master_address": self.host,
            "master_port": store.port,
            "world_size": world_size,
            "rank_offset": 1,
            "packed_buffer_size_bytes": self.bucket_bytes,
            "segment_bytes": self.segment_bytes,
            "timeout_s": 2 * self.timeout_s,
        }

        def join(label: str) -> GlooGroup:
            return GlooGroup.open(
                self.host, store.port, 0, world_size, timeout_s=self.timeout_s, label=label, store=store
            )

        return Rendezvous(init_info, join)
