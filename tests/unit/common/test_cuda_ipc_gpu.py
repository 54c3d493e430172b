"""CUDA IPC hand-over of a model's weights between two processes on one GPU: the weight push
of the colocated schedule (learner and vLLM engine share the GPU; NCCL refuses two ranks on
one device, and a copy through the host would cost two PCIe trips).

The mechanism is vLLM's IPC weight-transfer engine (``vllm/distributed/weight_transfer/
ipc_engine.py``): the sender calls ``torch.multiprocessing.reductions.reduce_tensor`` on a
CUDA tensor, which exports the allocation's ``cudaIpcMemHandle`` (plus offset, size, a
ref-counter file and an event), and ships ``{gpu_uuid: args}``; the receiver maps it with
``rebuild_cuda_tensor(*args)`` (device index overwritten with its own) and copies into its
weights (``model.load_weights``). Two layouts, as in vLLM:

- ``per_tensor`` (vLLM unpacked): one handle per parameter; the receiver opens every
  allocation behind them, then copies each parameter.
- ``packed`` (vLLM packed): the sender copies every parameter into one uint8 staging buffer
  (one handle); the receiver splits it into views (``unpack``) and copies. vLLM bounds the
  buffer (1 GB chunks); here it holds the whole model, one chunk.

Each timed round the receiver drops its mappings afterwards, as vLLM's engine does, so every
round pays the opening again. The baseline, in the same run and process pair: a
device-to-device copy of the same bytes in the sender (one flat copy, and per tensor).

Run as a worker: ``python tests/unit/common/test_cuda_ipc_gpu.py [--rounds 5]`` prints
``RESULT {json}``; ``bench/gpu_colocate_checks.py`` runs the GPU test and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from helpers.procs import ROOT, python_cmd, worker_env

# Qwen2.5-1.5B's shape with random weights: 1.54 G parameters, 3.1 GB in bf16, 338 tensors.
MODEL_SHAPE = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=False,
)
REPLY_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------- packing (no CUDA)


ALIGN = 16  # bytes; every dtype's element size divides it, so each view of the buffer is legal


def pack_layout(tensors) -> tuple[list[int], list[int], int]:
    """(byte offset, byte size) of each tensor in the packed buffer, and the buffer's size.

    vLLM packs back to back (its ``tensor_sizes``), which only works while every tensor's
    offset is a multiple of the next one's element size (one dtype, even sizes); offsets
    here are rounded up to ``ALIGN`` so mixed dtypes view too.
    """
    offsets, sizes, end = [], [], 0
    for t in tensors:
        offset = -(-end // ALIGN) * ALIGN
        size = t.numel() * t.element_size()
        offsets.append(offset)
        sizes.append(size)
        end = offset + size
    return offsets, sizes, end


def pack_into(buffer, tensors) -> None:
    """Copies each tensor's bytes (made contiguous) into ``buffer`` (uint8) at its offset."""
    offsets, sizes, _ = pack_layout(tensors)
    for t, offset, size in zip(tensors, offsets, sizes, strict=True):
        buffer[offset : offset + size].copy_(t.contiguous().reshape(-1).view(buffer.dtype))


def unpack(buffer, shapes, dtypes, offsets, sizes) -> list:
    """Views of ``buffer`` (uint8) with the given shapes and dtypes (vLLM's ``unpack_tensor``)."""
    import torch

    out = []
    for shape, dtype, offset, size in zip(shapes, dtypes, offsets, sizes, strict=True):
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        out.append(buffer[offset : offset + size].view(dtype).view(shape))
    return out


def test_pack_unpack_round_trip_is_bitwise_on_cpu():
    import torch

    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=g).to(torch.bfloat16),
        torch.randn(4, 6, generator=g).t(),  # non-contiguous
        torch.empty(0, 7),  # empty
        torch.tensor(2.5, dtype=torch.float64),  # 0-dim
        torch.randint(-5, 5, (7,), generator=g, dtype=torch.int32),
    ]
    offsets, sizes, total = pack_layout(tensors)
    assert sizes == [30, 96, 0, 8, 28]
    assert offsets == [0, 32, 128, 128, 144] and total == 172  # each offset rounded up to 16 bytes
    buffer = torch.full((total + 3,), 0xAB, dtype=torch.uint8)  # larger than needed: only the head is used
    pack_into(buffer, tensors)
    out = unpack(
        buffer, [list(t.shape) for t in tensors], [str(t.dtype).split(".")[-1] for t in tensors], offsets, sizes
    )
    for a, b in zip(tensors, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert buffer[-3:].tolist() == [0xAB] * 3


# --------------------------------------------------------------------------- GPU test


def run_check(args: list[str], *, timeout: float = 420) -> dict:
    cmd = python_cmd([__file__, *args])
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    results = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, (
        f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    result = json.loads(results[-1])
    if os.environ.get("RAYLESS_FIGURES"):
        with open(os.environ["RAYLESS_FIGURES"], "a") as f:
            f.write(json.dumps(result) + "\n")
    print("FIGURES " + json.dumps(result), flush=True)
    return result


@pytest.mark.gpu
def test_cuda_ipc_hands_weights_over_bit_identical():
    r = run_check([])
    assert r["identical"] == {"per_tensor": True, "packed": True}, r
    # Mapped memory is device memory: once mapped, the receiver's copy runs at D2D speed.
    for mode in ("per_tensor", "packed"):
        assert r[mode]["copy_s"] <= 2 * r["d2d_per_tensor_s"] + 2e-3, r


# --------------------------------------------------------------------------- worker


def _reply(conn, what: str):
    if not conn.poll(REPLY_TIMEOUT_S):
        raise TimeoutError(f"no {what} from the other process within {REPLY_TIMEOUT_S:.0f} s (see its log above)")
    return conn.recv()


def _rebuild(handle: dict, uuid: str, device_index: int):
    """vLLM's receive: the args for this GPU, device index overwritten with ours."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if uuid not in handle:
        raise ValueError(f"no IPC handle for GPU {uuid}; have {list(handle)}")
    args = list(handle[uuid])
    args[6] = device_index  # index 6 of reduce_tensor's args is the device index
    return rebuild_cuda_tensor(*args)


def receiver(conn, device_index: int) -> None:
    """The engine's side: owns its own copy of the weights, fills it from IPC handles."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.set_device(device_index)
    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    shapes, dtypes = _reply(conn, "metadata")
    weights = [torch.empty(s, dtype=getattr(torch, d), device="cuda") for s, d in zip(shapes, dtypes, strict=True)]
    offsets, sizes, _ = pack_layout(weights)
    torch.cuda.synchronize()
    conn.send("ready")
    while True:
        msg = _reply(conn, "request")
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "zero":  # before a verification round: nothing left from earlier rounds
            for w in weights:
                w.zero_()
            torch.cuda.synchronize()
            conn.send("zeroed")
            continue
        if kind == "share_back":  # the sender compares our copy with its weights on the GPU
            conn.send([{uuid: reduce_tensor(w)[1]} for w in weights])
            _reply(conn, "comparison done")
            continue
        t0 = time.perf_counter()
        if kind == "per_tensor":
            sources = [_rebuild(h, uuid, device_index) for h in msg[1]]
        else:  # packed
            sources = unpack(_rebuild(msg[1], uuid, device_index), shapes, dtypes, offsets, sizes)
        t_open = time.perf_counter()
        for w, s in zip(weights, sources, strict=True):
            w.copy_(s)
        torch.cuda.synchronize()
        t_copy = time.perf_counter()
        del sources  # unmaps, as vLLM's engine drops its views after load_weights
        conn.send(("done", t_open - t0, t_copy - t_open))


def _timed(fn, rounds: int) -> float:
    """Median wall time of ``fn`` (synchronized) over ``rounds`` after one warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _d2d_baseline(params, total: int, rounds: int) -> tuple[float, float]:
    """Device-to-device copies of the same bytes in one process: one flat copy, and one copy
    per tensor (the receiver's kernels, without IPC)."""
    import torch

    flat_src = torch.empty(total, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    copies = [torch.empty_like(p) for p in params]
    flat_s = _timed(lambda: flat_dst.copy_(flat_src), rounds)
    per_tensor_s = _timed(lambda: [c.copy_(p) for c, p in zip(copies, params, strict=True)], rounds)
    return flat_s, per_tensor_s


def worker(args) -> dict:
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device_index = 0
    torch.cuda.set_device(device_index)
    uuid = str(torch.cuda.get_device_properties(device_index).uuid)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(Qwen2Config(**MODEL_SHAPE)).to(torch.bfloat16)
    params = [p.detach() for p in model.parameters()]
    shapes = [list(p.shape) for p in params]
    dtypes = [str(p.dtype).split(".")[-1] for p in params]
    _, _, total = pack_layout(params)
    result = {
        "check": "cuda_ipc",
        "gpu": torch.cuda.get_device_name(device_index),
        "tensors": len(params),
        "bytes": total,
        "rounds": args.rounds,
    }

    result["d2d_flat_s"], result["d2d_per_tensor_s"] = _d2d_baseline(params, total, args.rounds)
    staging = torch.empty(total, dtype=torch.uint8, device="cuda")  # packed mode's IPC buffer, reused

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(child_conn, device_index), name="ipc-receiver")
    t0 = time.perf_counter()
    child.start()
    conn.send((shapes, dtypes))
    assert _reply(conn, "ready") == "ready"
    result["receiver_start_s"] = time.perf_counter() - t0

    def send(mode: str) -> tuple[float, float, float, float]:
        """One hand-over; returns (sender wall time, sender's export time (handles, and the
        packing copy), receiver open time, receiver copy time)."""
        t0 = time.perf_counter()
        if mode == "per_tensor":
            payload = [{uuid: reduce_tensor(p)[1]} for p in params]
        else:
            pack_into(staging, params)
            torch.cuda.synchronize()  # the receiver reads the buffer on its own stream
            payload = {uuid: reduce_tensor(staging)[1]}
        export_s = time.perf_counter() - t0
        conn.send((mode, payload))
        _, open_s, copy_s = _reply(conn, f"{mode} hand-over")
        return time.perf_counter() - t0, export_s, open_s, copy_s

    try:
        identical = {}
        for mode in ("per_tensor", "packed"):
            conn.send(("zero",))
            _reply(conn, "zeroed")
            send(mode)
            conn.send(("share_back",))
            theirs = [_rebuild(h, uuid, device_index) for h in _reply(conn, "shared weights")]
            identical[mode] = all(
                a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
                for a, b in zip(params, theirs, strict=True)
            )
            del theirs
            conn.send("compared")
        result["identical"] = identical

        timings = {"per_tensor": [], "packed": []}
        for _ in range(args.rounds):  # alternate, so drift hits both layouts alike
            for mode in timings:
                timings[mode].append(send(mode))
        for mode, rows in timings.items():
            wall, export_s, open_s, copy_s = (statistics.median(col) for col in zip(*rows, strict=True))
            result[mode] = {
                "wall_s": wall,
                "export_s": export_s,
                "open_s": open_s,
                "copy_s": copy_s,
                "first_wall_s": rows[0][0],
                "vs_d2d_per_tensor": wall / result["d2d_per_tensor_s"],
                "vs_d2d_flat": wall / result["d2d_flat_s"],
            }
        result["d2d_flat_GBps"] = total / result["d2d_flat_s"] / 1e9
        conn.send(("stop",))
        child.join(30)
    finally:
        if child.is_alive():
            child.kill()
    torch.cuda.ipc_collect()
    result["receiver_exitcode"] = child.exitcode
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print("RESULT " + json.dumps(worker(args)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
