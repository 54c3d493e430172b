"""The NCCL backend's learner half: vLLM's communicator, vLLM's packed consumer in the workers.

A group holds one server (a joiner, a retry) or the whole fleet (ranks 1..n over every server's
workers, one broadcast per bucket for all of them).

The workers run vLLM's own ``nccl`` engine (packed mode), so the group is formed the way vLLM's
trainer side forms it (``nccl_common.trainer_init``: a ``PyNcclCommunicator`` on a
``StatelessProcessGroup``, the learner rank 0). vLLM is imported only when a group forms.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from common.transport import free_port
from common.weights.base import Rendezvous, WeightSender


class _CudaWork:
    """NCCL broadcasts are enqueued on a stream; waiting is polling an event, with a deadline
    (a dead NCCL peer never completes the kernel, so a plain synchronize would hang)."""

    def __init__(self, timeout_s: float) -> None:
        self.event = torch.cuda.Event()
        self.event.record()
        self.timeout_s = timeout_s

    def wait(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.event.query():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"NCCL broadcast not complete after {self.timeout_s:.0f} s (peer dead or stalled; "
                    "the communicator is unusable and must be dropped)"
                )
            time.sleep(0.001)


class NcclGroup:
    def __init__(self, comm: Any, timeout_s: float) -> None:
        self.comm, self.timeout_s = comm, timeout_s

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> _CudaWork:
        self.comm.broadcast(tensor, src=src)
        return _CudaWork(self.timeout_s)

    def close(self) -> None:
        destroy = getattr(self.comm, "destroy", None)
        if callable(destroy):
            destroy()


class NcclSender(WeightSender):
    """One broadcast per bucket: vLLM's packed NCCL consumer receives a bucket in one piece."""

    name = "nccl"  # one broadcast per bucket: takes_segments stays False

    def listen(self, world_size: int, *, fleet: bool = False) -> Rendezvous:
        # A fleet needs nothing different here: NCCL's broadcast already pipelines through the
        # ranks (ring/tree, in chunks), so the root sends one copy whatever the group's size;
        # each server's workers take their ranks from the rank_offset the publisher gives them.
        port = free_port(self.host)
        init_info = {
            "master_address": self.host,
            "master_port": port,
            "world_size": world_size,
            "rank_offset": 1,
            "packed": True,
            "packed_buffer_size_bytes": self.bucket_bytes,
            "packed_num_buffers": 2,
        }

        def join(label: str) -> NcclGroup:
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            comm = trainer_init({"master_address": self.host, "master_port": port, "world_size": world_size})
            return NcclGroup(comm, self.timeout_s)

        return Rendezvous(init_info, join)
