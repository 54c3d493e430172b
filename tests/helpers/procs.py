"""Running the project's modules as child processes from tests: one thread each (2 shared
cores), offline, the repository and tests/ on the path (scripts run by path import helpers)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.paths import ROOT

__all__ = ["ROOT", "python_cmd", "read_log", "run_module", "run_worker", "worker_env"]


def worker_env() -> dict:
    """Env for child processes: one thread each (2 shared cores), offline, cached JIT ops."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a pytest run under a launcher must not leak its world
    return env


def python_cmd(target: list[str], nproc: int = 1) -> list[str]:
    """``python TARGET`` (a world of one) or the same under ``torchrun --standalone`` with
    ``nproc`` ranks; ``target`` is ``["-m", module, ...]`` or ``[script, ...]``."""
    if nproc == 1:
        return [sys.executable, *target]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target]


def run_module(module: str, args: list[str], *, nproc: int = 1, timeout: float = 600) -> str:
    """``python -m module args`` (or under torchrun with ``nproc`` ranks); returns the output,
    raising with its tail when the run fails. Used by the trainer tests."""
    cmd = python_cmd(["-m", module, *args], nproc)
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{module} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def run_worker(script: str, args: list[str], *, nproc: int = 1, timeout: float = 300) -> dict:
    """``python SCRIPT args`` (or under torchrun with ``nproc`` ranks) for a test whose worker side
    prints ``RESULT {json}``; returns the last such result, raising with the output's tail when
    the run fails or prints none."""
    cmd = python_cmd([script, *args], nproc)
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    results = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, (
        f"worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return json.loads(results[-1])


def read_log(save_path) -> list[dict]:
    """The records a trainer wrote to SAVE_PATH/train_log.jsonl."""
    return [json.loads(line) for line in (Path(save_path) / "train_log.jsonl").read_text().splitlines()]
