"""Throughput of the work queue vs raw ZeroMQ, measured in the same run.

A SampleBatch of 64 samples x 1024 tokens (int32 ids + float32 logprobs, 512 KiB of payload)
goes DEALER -> ROUTER through ``common.transport`` (encode, send, receive, decode, validate),
and the very same bytes go through a bare DEALER/ROUTER pair with zero-copy frames. The
sender is a separate process in both cases, as a rollout server is. Prints both in MB/s
and their ratio (goal >= 0.8).

Run: ``python bench/transport.py [--iters N] [--samples 64] [--tokens 1024]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
import zmq

from common.protocol import Codec, SampleBatch
from common.transport import Endpoint


def make_batch(samples: int, tokens: int) -> SampleBatch:
    g = torch.Generator().manual_seed(0)
    return SampleBatch(
        prompt_ids=list(range(samples)),
        sample_indices=[0] * samples,
        response_lengths=[tokens] * samples,
        response_ids=torch.randint(0, 32000, (samples * tokens,), dtype=torch.int32, generator=g),
        logprobs=-torch.rand(samples * tokens, generator=g),
        finish_reasons=["stop"] * samples,
        policy_versions=[1] * samples,
        server="bench",
    )


def _produce_transport(address: str, batch: SampleBatch, iters: int) -> None:
    svc = Endpoint.connect(address, name="bench-svc")
    for _ in range(iters):
        svc.send(batch)
    svc.close()


def _produce_raw(address: str, frames: list[bytes], iters: int) -> None:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(address)
    for _ in range(iters):
        dealer.send_multipart(frames, copy=False)
    dealer.close(linger=-1)


def run_transport(batch: SampleBatch, iters: int) -> float:
    ctrl = Endpoint.bind("tcp://127.0.0.1:0")
    p = mp.get_context("spawn").Process(target=_produce_transport, args=(ctrl.address, batch, iters))
    p.start()
    _, got = ctrl.recv(timeout=60)  # clock starts at the first message: process start-up excluded
    t0 = time.perf_counter()
    total = got.response_ids.numel()
    for _ in range(iters - 1):
        _, got = ctrl.recv(timeout=30)
        total += got.response_ids.numel()  # touch the decoded message
    dt = time.perf_counter() - t0
    p.join()
    ctrl.close(0)
    return dt


def run_raw(frames: list[bytes], iters: int) -> float:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    p = mp.get_context("spawn").Process(target=_produce_raw, args=(f"tcp://127.0.0.1:{port}", frames, iters))
    p.start()
    router.recv_multipart(copy=False)
    t0 = time.perf_counter()
    for _ in range(iters - 1):
        router.recv_multipart(copy=False)
    dt = time.perf_counter() - t0
    p.join()
    router.close(0)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=400, help="batches per measurement")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5, help="alternating measurements; the median is reported")
    args = ap.parse_args()
    batch = make_batch(args.samples, args.tokens)
    frames = [bytes(memoryview(f)) for f in Codec().encode(batch)]
    nbytes = sum(len(f) for f in frames)
    run_transport(batch, 20), run_raw(frames, 20)  # warm-up
    ours, raw = [], []
    for _ in range(args.repeats):  # alternate, so drift on a noisy machine hits both
        ours.append(nbytes * (args.iters - 1) / run_transport(batch, args.iters) / 1e6)
        raw.append(nbytes * (args.iters - 1) / run_raw(frames, args.iters) / 1e6)
    o, r = statistics.median(ours), statistics.median(raw)
    print(f"message: SampleBatch {args.samples} x {args.tokens} tokens, {nbytes / 1024:.0f} KiB on the wire")
    print(f"rayless work queue : {o:9.1f} MB/s")
    print(f"raw ZMQ zero-copy  : {r:9.1f} MB/s")
    print(f"ratio              : {o / r:9.2f}   (goal >= 0.80)")


if __name__ == "__main__":
    main()
