"""DeepSpeed's offload_states / reload_states, the learner's half of the colocated schedule.

Between two training phases the colocated schedule parks the learner's optimizer state,
fp32 master weights and gradients in pinned CPU memory (``engine.offload_states``) so the
vLLM engine on the same GPU can use that memory, and brings them back before the next
training phase (``engine.reload_states``). The bf16 weights stay on the GPU: the weight push
to the engine reads them. What this file checks, on one GPU (a world of one, NCCL):

- offload frees at least the bytes of the offloaded tensors, both in torch's accounting
  (``memory_allocated``) and in the driver's (``mem_get_info``: what vLLM would see);
- reload restores every optimizer state tensor, master weight and model weight bit for bit;
- one more training step works afterwards;
- ZeRO-3 offload needs DeepSpeed's FusedAdam (DeepSpeed 0.19.8 asserts it); the project's
  ``make_engine`` builds torch AdamW, which ZeRO-3 refuses, while ZeRO-2 takes any optimizer.

Each check runs in its own process (a process group and DeepSpeed's globals live once per
process; and memory figures must not include another test's leftovers):
``python tests/unit/runtime/test_offload_gpu.py --zero_stage 2 [--optimizer make_engine|fused_adam]
[--device cuda|cpu]`` prints ``RESULT {json}``. ``--device cpu`` runs the same round trip on
DeepSpeed's CPU accelerator (no memory figures): the slow CPU test below and a dry run
without a GPU. ``bench/gpu_colocate_checks.py`` runs the GPU tests and prints the figures
(``docs/colocated.md`` has them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from helpers.procs import ROOT, python_cmd, worker_env

GiB = 1024**3
# A 272 M-parameter Qwen2 (1024 wide, 16 layers, 32 k vocabulary): 3.3 GB of fp32 master
# weights and Adam moments, enough that the freed memory is well clear of allocator noise.
GPU_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, vocab_size=32000)
CPU_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256)


def run_check(args: list[str], *, timeout: float = 420) -> dict:
    """Runs this file as a worker (a world of one) and returns its RESULT record."""
    cmd = python_cmd([__file__, *args])
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    results = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, (
        f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    )
    result = json.loads(results[-1])
    record_figures(result)
    return result


def record_figures(result: dict) -> None:
    """Appends a result to the JSON-lines file named by RAYLESS_FIGURES (the bench reads it)."""
    path = os.environ.get("RAYLESS_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")
    print("FIGURES " + json.dumps(result), flush=True)


def bitwise_equal(a, b) -> bool:
    """Same dtype, shape and bytes (NaN == NaN, -0 != +0): what 'restored' has to mean."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def diff_snapshots(before: dict, after: dict) -> list[str]:
    """Names whose tensors differ (or are missing on one side); empty when identical."""
    names = sorted(set(before) | set(after))
    return [n for n in names if n not in before or n not in after or not bitwise_equal(before[n], after[n])]


# --------------------------------------------------------------------------- fast tests


def test_diff_snapshots_is_bitwise():
    import torch

    a = {"x": torch.tensor([1.0, float("nan"), 0.0]), "s": torch.tensor(3.0), "b": torch.ones(2, dtype=torch.bfloat16)}
    same = {k: v.clone() for k, v in a.items()}
    assert diff_snapshots(a, same) == []  # NaN equals NaN bit for bit, 0-dim tensors work
    signed_zero = dict(same, x=torch.tensor([1.0, float("nan"), -0.0]))
    assert diff_snapshots(a, signed_zero) == ["x"]  # -0.0 == 0.0 numerically, not bitwise
    assert diff_snapshots(a, dict(same, b=torch.ones(2))) == ["b"]  # dtype changed
    assert diff_snapshots(a, {"x": a["x"]}) == ["b", "s"]  # missing tensors count


@pytest.mark.slow
def test_zero2_offload_round_trip_on_cpu():
    """The GPU check's code path on DeepSpeed's CPU accelerator: offload/reload round trip
    bit for bit, then a step (no memory to free here; the GPU test measures that)."""
    r = run_check(["--zero_stage", "2", "--device", "cpu"])
    assert r["ok"], r
    assert r["changed_after_reload"] == [] and r["adam_tensors"] > 0 and r["step_after_reload_ok"]


@pytest.mark.slow
def test_zero3_offload_refuses_torch_adamw():
    """DeepSpeed 0.19.8's ZeRO-3 offload_states asserts FusedAdam; make_engine's torch AdamW
    is refused before anything moves (device independent, so checked on CPU)."""
    r = run_check(["--zero_stage", "3", "--device", "cpu"])
    assert not r["ok"] and "FusedAdam" in r["offload_error"], r


# --------------------------------------------------------------------------- GPU tests


@pytest.mark.gpu
def test_zero2_offload_frees_gpu_memory_and_reload_restores_bit_for_bit():
    r = run_check(["--zero_stage", "2"])
    assert r["ok"], r
    assert r["changed_after_reload"] == [] and r["adam_tensors"] > 0, r
    # Everything offloaded leaves the GPU: torch's count and the driver's free memory.
    assert r["freed_allocated_bytes"] >= 0.95 * r["offloaded_bytes"], r
    assert r["freed_driver_bytes"] >= 0.9 * r["offloaded_bytes"], r
    assert r["step_after_reload_ok"], r


@pytest.mark.gpu
def test_zero3_offload_refuses_make_engines_torch_adamw_on_gpu():
    r = run_check(["--zero_stage", "3"])
    assert not r["ok"] and "FusedAdam" in r["offload_error"], r


@pytest.mark.gpu
def test_zero3_offload_with_fused_adam_frees_and_restores():
    if not (shutil.which("nvcc") or os.environ.get("CUDA_HOME")):
        pytest.skip("FusedAdam is JIT-built and needs nvcc")
    r = run_check(["--zero_stage", "3", "--optimizer", "fused_adam"], timeout=300)  # a ~1 min JIT build
    assert r["ok"], r
    assert r["changed_after_reload"] == [] and r["adam_tensors"] > 0, r
    assert r["freed_allocated_bytes"] >= 0.95 * r["offloaded_bytes"], r
    assert r["freed_driver_bytes"] >= 0.9 * r["offloaded_bytes"], r
    assert r["step_after_reload_ok"], r


# --------------------------------------------------------------------------- worker


def _build_engine(args, dist_info):
    """A random Qwen2 of the configured shape under ZeRO-``zero_stage``, bf16 on GPU."""
    import deepspeed
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.runtime.engine import make_engine

    shape = GPU_SHAPE if args.device == "cuda" else CPU_SHAPE
    config = Qwen2Config(
        **shape,
        num_attention_heads=16 if args.device == "cuda" else 4,
        num_key_value_heads=16 if args.device == "cuda" else 4,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(dist_info.device):  # built in place: no host copy of the weights
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    common = dict(zero_stage=args.zero_stage, bf16=True, train_batch_size=args.batch, micro_train_batch_size=args.batch)
    if args.optimizer == "make_engine":
        return make_engine(model, learning_rate=1e-4, num_training_steps=10, lr_warmup_ratio=0.0, **common)
    # OpenRLHF's optimizer: DeepSpeed's FusedAdam (JIT-compiled CUDA op), which ZeRO-3's
    # offload_states requires. Same config as make_engine, the optimizer built by DeepSpeed.
    from learner.runtime.deepspeed_config import train_ds_config

    ds_config = train_ds_config(world_size=1, **common)
    ds_config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "adam_w_mode": True}}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, dist_init_required=False)
    return engine


ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")  # not DeepSpeed's pinned "*_offload_buffer" copies


def _snapshot(engine) -> dict:
    """Host copies of everything offload touches: the fp32 master partitions with their Adam
    state, and the full bf16 model weights.

    The masters are read from the ZeRO wrapper: ZeRO-3 puts each one into the client
    optimizer's ``param_groups`` only for the duration of its step (the state stays keyed by it).
    """
    import torch

    from helpers.params import full_named_parameters

    zero = engine.optimizer
    masters = getattr(zero, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
    if masters is None:
        masters = zero.fp32_partitioned_groups_flat  # ZeRO-3
    out = {}
    for i, master in enumerate(masters):
        out[f"master/{i}"] = master.detach().to("cpu", copy=True)
        for key, value in zero.optimizer.state.get(master, {}).items():
            if key in ADAM_KEYS and torch.is_tensor(value):
                out[f"adam/{i}/{key}"] = value.detach().to("cpu", copy=True)
    for name, t in full_named_parameters(engine):
        out[f"weight/{name}"] = t.to("cpu", copy=True)
    return out


def _gpu_bytes(snapshot: dict, prefixes: tuple[str, ...]) -> int:
    return sum(t.numel() * t.element_size() for n, t in snapshot.items() if n.startswith(prefixes))


def _memory(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(), "free": free}


def worker(args) -> dict:
    import torch
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    from learner.runtime.engine import init_distributed

    dist_info = init_distributed()
    engine = _build_engine(args, dist_info)
    result = {
        "check": "deepspeed_offload",
        "zero_stage": args.zero_stage,
        "optimizer": args.optimizer,
        "device": str(dist_info.device),
        "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters()),
        "ok": False,
    }
    gen = torch.Generator().manual_seed(1)
    vocab = engine.module.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(dist_info.device)

    def train_step() -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach().item()

    result["loss_step1"] = train_step()  # Adam state exists only after a first step
    before = _snapshot(engine)
    # What the colocated schedule parks between training phases (OpenRLHF's set, plus the
    # gradient partitions): everything but the bf16 weights, which the weight push reads.
    include = [
        OffloadStateTypeEnum.optim_states,
        OffloadStateTypeEnum.hp_params,
        OffloadStateTypeEnum.lp_grads,
        OffloadStateTypeEnum.contiguous_grad_buffer,
    ]
    # Bytes that must leave the GPU: fp32 master partitions and Adam moments.
    result["offloaded_bytes"] = _gpu_bytes(before, ("master/", "adam/")) if dist_info.device.type == "cuda" else 0
    result["adam_tensors"] = sum(n.startswith("adam/") for n in before)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        if dist_info.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def offload() -> None:
        engine.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)

    mem0 = _memory(dist_info.device)
    try:
        result["offload_s"] = timed(offload)
    except AssertionError as e:  # ZeRO-3 with a non-FusedAdam optimizer
        result["offload_error"] = f"AssertionError: {e}"
        return result
    mem1 = _memory(dist_info.device)
    result["reload_s"] = timed(lambda: engine.reload_states(non_blocking=True))
    mem2 = _memory(dist_info.device)
    after = _snapshot(engine)
    # A second cycle, as every colocated step does: pinned host buffers may be reused.
    result["offload2_s"] = timed(offload)
    result["reload2_s"] = timed(lambda: engine.reload_states(non_blocking=True))
    after2 = _snapshot(engine)
    result["compared_tensors"] = len(before)
    result["changed_after_reload"] = (diff_snapshots(before, after) + diff_snapshots(before, after2))[:10]
    if mem0:
        result["memory_before"], result["memory_offloaded"], result["memory_reloaded"] = mem0, mem1, mem2
        result["freed_allocated_bytes"] = mem0["allocated"] - mem1["allocated"]
        result["freed_driver_bytes"] = mem1["free"] - mem0["free"]
        for key in ("offload", "reload", "offload2", "reload2"):
            result[f"{key}_GBps"] = result["offloaded_bytes"] / result[f"{key}_s"] / 1e9

    result["loss_step2"] = train_step()
    moved = diff_snapshots(
        {n: t for n, t in after.items() if n.startswith("weight/")},
        {n: t for n, t in _snapshot(engine).items() if n.startswith("weight/")},
    )
    steps = [s["step"] for s in engine.optimizer.optimizer.state.values() if "step" in s]
    result["optimizer_steps"] = [int(s) for s in steps[:1]]  # a tensor in torch AdamW, an int in FusedAdam
    result["step_after_reload_ok"] = bool(
        torch.isfinite(torch.tensor(result["loss_step2"])) and len(moved) > 0 and result["optimizer_steps"] == [2]
    )
    result["ok"] = result["changed_after_reload"] == [] and result["step_after_reload_ok"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero_stage", type=int, choices=(2, 3), default=2)
    p.add_argument("--optimizer", choices=("make_engine", "fused_adam"), default="make_engine")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args()
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported
        args.seq = min(args.seq, 16)
    print("RESULT " + json.dumps(worker(args)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
