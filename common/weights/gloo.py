"""The gloo backend's learner half and the group both halves use: CPU runs take the NCCL path.

A group is a plain ``ProcessGroupGloo`` on its own ``TCPStore``, hosted by the learner (rank 0);
the servers' vLLM workers are ranks 1..n. Never the default process group, so it coexists with
vLLM's groups and DeepSpeed's, and a group can be formed or dropped while everything else keeps
running. Two shapes:

- one server (a joiner, or a retry): the learner broadcasts into the group, as before;
- the fleet (every ready server in one group): a *relay*. gloo's broadcast is a binomial tree
  that moves the whole message per hop (``gloo/broadcast.cc``: the root sends to ranks 1, 2, 4,
  ...), so the learner would still send log2(n) copies, with no pipelining. Instead the learner
  sends each bucket once, in pieces (``chunk_spans``), to rank 1; rank r receives its pieces from
  r - 1 and passes each on to r + 1 while the next arrives (``GlooWeightTransferEngine``). The
  learner's cost is one model's bytes whatever n; the last server is n pieces behind.

The workers' half is ``rollout_service/weight_receiver_gloo.py`` (``GlooGroup`` is shared;
nothing here imports vLLM).
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch.distributed import ProcessGroupGloo, TCPStore

from common.net import tcp_store_server
from common.weights.base import Rendezvous, WeightSender
from common.weights.wire import DEFAULT_RELAY_CHUNK_BYTES, DEFAULT_SEGMENT_BYTES, chunk_spans

# How long the workers of a fleet group wait for every rank to join (at most the push timeout).
FLEET_RENDEZVOUS_S = 60.0


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
        except Exception as e:  # re-raised with who and where
            raise RuntimeError(
                f"weight-transfer group {label} (tcp://{host}:{port}, rank {rank} of "
                f"{world_size}) could not form within {timeout_s:.0f} s: {e}"
            ) from e
        return cls(store, pg, rank, world_size, label)

    @staticmethod
    def host_store(host: str, world_size: int, timeout_s: float, port: int = 0) -> TCPStore:
        """The learner's store, listening before any worker is told where it is (port 0: any),
        on ``host`` only when that is an IP address (``common.net.tcp_store_server``: a plain
        TCPStore would listen on every interface)."""
        return tcp_store_server(host, port, timeout_s=timeout_s, world_size=world_size)

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)

    def send(self, tensor: torch.Tensor, dst: int):
        """Point to point (the relay), asynchronous; in order with earlier sends to ``dst``."""
        return self.pg.send([tensor], dst, 0)

    def recv(self, tensor: torch.Tensor, src: int):
        return self.pg.recv([tensor], src, 0)

    def close(self) -> None:
        # Dropping the references closes the sockets; gloo has no explicit destroy that is
        # safe to call while a peer may be gone.
        self.pg = None
        self.store = None


class _AllWorks:
    """Several works waited as one (the pieces of one relayed segment)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class RelayGroup:
    """The learner's end of a fleet group: every "broadcast" is sent once, in pieces, to rank 1,
    the head of the relay chain (ranks 1..n pass it on). ``SendGroup``'s interface, so the fan-out
    sender (``common.weights.wire.send_packed``) drives it like any group."""

    def __init__(self, group: GlooGroup, chunk_bytes: int) -> None:
        self.group, self.chunk_bytes = group, chunk_bytes

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> _AllWorks:
        if src != 0:
            raise ValueError(f"the learner (rank 0) is the relay's only source, not rank {src}")
        return _AllWorks(
            [self.group.send(tensor[o : o + n], 1) for o, n in chunk_spans(tensor.numel(), self.chunk_bytes)]
        )

    def close(self) -> None:
        self.group.close()


class GlooSender(WeightSender):
    """Buckets go out as a few broadcasts each: tensors of at least ``segment_bytes`` from their
    own memory, runs of small ones packed first (the receiver lands each in its slice of the
    bucket, so the bytes on arrival are vLLM's packed layout either way)."""

    name = "gloo"
    sends_tied_once = True  # rollout_service/weight_receiver_gloo.py loads the aliases
    takes_segments = True

    def __init__(self, *, host: str, bucket_bytes: int, timeout_s: float) -> None:
        super().__init__(host=host, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        # The receiver cuts segments by the same rule: it travels in init_info.
        self.segment_bytes = DEFAULT_SEGMENT_BYTES
        self.relay_chunk_bytes = DEFAULT_RELAY_CHUNK_BYTES  # likewise

    def listen(self, world_size: int, *, fleet: bool = False) -> Rendezvous:
        store = GlooGroup.host_store(self.host, world_size, self.timeout_s)
        # One server's group: its workers wait twice as long as we do: when one server stalls,
        # we wait timeout_s on it before dropping it, and the healthy servers, waiting for their
        # next bucket meanwhile, must not time out first. A fleet (relay): a server behind a
        # stalled one cannot be served by this push anyway; it must give up within our own
        # timeout, so that its error (not its silence) reaches us and it is retried on its own.
        init_info = {
            "master_address": self.host,
            "master_port": store.port,
            "world_size": world_size,
            "rank_offset": 1,
            "packed_buffer_size_bytes": self.bucket_bytes,
            "segment_bytes": self.segment_bytes,
            "timeout_s": self.timeout_s if fleet else 2 * self.timeout_s,
            "relay": fleet,
            "relay_chunk_bytes": self.relay_chunk_bytes,
        }
        if fleet:
            # Every worker of the fleet waits in the rendezvous until all have joined: a server
            # that never does (dead, not yet noticed) must cost the others less than a push's
            # timeout. Healthy servers join in seconds.
            init_info["rendezvous_timeout_s"] = min(self.timeout_s, FLEET_RENDEZVOUS_S)

        def join(label: str) -> GlooGroup | RelayGroup:
            group = GlooGroup.open(
                self.host, store.port, 0, world_size, timeout_s=self.timeout_s, label=label, store=store
            )
            return RelayGroup(group, init_info["relay_chunk_bytes"]) if fleet else group

        return Rendezvous(init_info, join)
