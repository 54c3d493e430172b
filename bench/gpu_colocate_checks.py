"""The colocated schedule's GPU foundations, checked and measured in one run (one GPU).

Runs the ``gpu`` tests of ``tests/unit/runtime/test_offload_gpu.py`` (DeepSpeed
offload_states frees the optimizer's GPU memory, reload_states restores it bit for bit, ZeRO-2
and ZeRO-3) and ``tests/unit/common/test_cuda_ipc_gpu.py`` (a CUDA IPC hand-over of a model's
weights to another process on the same GPU, bit-identical, timed against a device-to-device
copy of the same bytes in the same run), then prints the figures those tests recorded as a
table and, last, one JSON line. Results and what they mean: ``docs/colocated.md``.

Run (a CUDA GPU; DeepSpeed, transformers; FusedAdam is JIT-built, so nvcc for ZeRO-3):
``python bench/gpu_colocate_checks.py [--out figures.json] [-- PYTEST_ARGS...]``.
Without CUDA the tests skip and the table is empty.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# IPC first: ZeRO-3's check JIT-builds FusedAdam (~1 min), the longest and least certain part.
TESTS = ["tests/unit/common/test_cuda_ipc_gpu.py", "tests/unit/runtime/test_offload_gpu.py"]
GB = 1e9


def environment() -> dict:
    """What ran the checks: torch, CUDA, GPU, DeepSpeed and whether nvcc is on the path."""
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "nvcc": shutil.which("nvcc")}
    env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except ImportError as e:
        env["deepspeed"] = f"missing ({e})"
    return env


def offload_rows(r: dict) -> list[str]:
    name = f"ZeRO-{r['zero_stage']} {r['optimizer']}"
    if not r.get("ok") and "offload_error" in r:
        return [f"{name}: offload refused: {r['offload_error'][:120]}"]
    if "offloaded_bytes" not in r or not r.get("memory_before"):
        return [f"{name}: ok={r.get('ok')} (no memory figures)"]
    m0, m1, m2 = r["memory_before"], r["memory_offloaded"], r["memory_reloaded"]
    return [
        f"{name}: {r['params'] / 1e6:.0f} M params, offloaded {r['offloaded_bytes'] / GB:.2f} GB "
        f"(fp32 master + Adam moments)",
        f"  allocated {m0['allocated'] / GB:.2f} -> {m1['allocated'] / GB:.2f} -> {m2['allocated'] / GB:.2f} GB "
        f"(before / offloaded / reloaded); driver free +{r['freed_driver_bytes'] / GB:.2f} GB after offload",
        f"  offload {r['offload_s'] * 1e3:.0f} ms ({r['offload_GBps']:.1f} GB/s), "
        f"reload {r['reload_s'] * 1e3:.0f} ms ({r['reload_GBps']:.1f} GB/s); second cycle: "
        f"offload {r['offload2_s'] * 1e3:.0f} ms ({r['offload2_GBps']:.1f} GB/s), "
        f"reload {r['reload2_s'] * 1e3:.0f} ms ({r['reload2_GBps']:.1f} GB/s)",
        f"  {r['compared_tensors']} tensors ({r['adam_tensors']} Adam) bit-identical after both reloads: "
        f"{r['changed_after_reload'] == []}; "
        f"step after reload: loss {r['loss_step1']:.4f} -> {r['loss_step2']:.4f}, ok={r['step_after_reload_ok']}",
    ]


def ipc_rows(r: dict) -> list[str]:
    rows = [
        f"CUDA IPC: {r['tensors']} tensors, {r['bytes'] / GB:.2f} GB bf16 on {r['gpu']}; "
        f"bit-identical {r['identical']}; receiver start {r['receiver_start_s']:.1f} s",
        f"  baseline D2D copy of the same bytes: flat {r['d2d_flat_s'] * 1e3:.2f} ms "
        f"({r['d2d_flat_GBps']:.0f} GB/s), per tensor {r['d2d_per_tensor_s'] * 1e3:.2f} ms",
    ]
    for mode in ("per_tensor", "packed"):
        m = r[mode]
        rows.append(
            f"  {mode:10s} hand-over {m['wall_s'] * 1e3:7.2f} ms (median of {r['rounds']}; first "
            f"{m['first_wall_s'] * 1e3:.2f}): export {m['export_s'] * 1e3:.2f} ms, open {m['open_s'] * 1e3:.2f} ms, copy {m['copy_s'] * 1e3:.2f} ms; "
            f"{m['vs_d2d_per_tensor']:.2f}x the per-tensor D2D copy, {m['vs_d2d_flat']:.2f}x the flat one"
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the figures (JSON) here")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        figures_path = Path(tmp) / "figures.jsonl"
        env = dict(os.environ, RAYLESS_FIGURES=str(figures_path))
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", *TESTS, *args.pytest_args]
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        records = [json.loads(line) for line in figures_path.read_text().splitlines()] if figures_path.exists() else []

    summary = {"environment": environment(), "pytest_exit_code": rc, "results": records}
    print("\n== colocated GPU checks ==")
    for key, value in summary["environment"].items():
        print(f"{key}: {value}")
    for r in records:
        rows = offload_rows(r) if r["check"] == "deepspeed_offload" else ipc_rows(r)
        print("\n".join(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return rc


if __name__ == "__main__":
    sys.exit(main())
