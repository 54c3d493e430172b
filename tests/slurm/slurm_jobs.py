"""Submitting the project's Slurm scripts from tests and reading what became of the jobs.

Everything the scripts need comes from the environment (docs/slurm.md); `cpu_run_env`
holds what both tests share: the tiny model on CPU, one thread per process, small batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers.paths import ROOT

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}
PROMPT_MAX_LEN, GENERATE_MAX_LEN = 64, 8


def cpu_run_env(tmp_path: Path, model: Path, *, steps: int) -> dict:
    """Environment for launch/grpo_70b.slurm on the emulated cluster: 4 prompts x 4 samples a
    step, the demo's reversal task, free ports for everything the job listens on."""
    from common.transport import free_port

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"input": f"{n:04d}>", "label": f"{n:04d}"[::-1]} for n in range(1000, 1400)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(
        os.environ,
        # the job runs `python` and `torchrun` by name: this interpreter's
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        MODEL=str(model),
        PROMPTS=str(prompts),
        REWARD_FUNC=str(ROOT / "launch" / "demo_task.py"),
        SAVE=str(tmp_path / "save"),
        DEVICE="cpu",
        THREADS_PER_PROCESS="1",  # 5 processes on 2 cores: more threads only fight
        ROLLOUTS_PER_NODE="1",
        N_SAMPLES="4",
        ROLLOUT_BATCH_SIZE="4",
        TRAIN_BATCH_SIZE="16",
        MICRO_TRAIN_BATCH_SIZE="8",
        MICRO_ROLLOUT_BATCH_SIZE="16",
        PROMPT_MAX_LEN=str(PROMPT_MAX_LEN),
        GENERATE_MAX_LEN=str(GENERATE_MAX_LEN),
        MAX_STEPS=str(steps),
        PORT=str(free_port()),
        RDZV_PORT=str(free_port()),
        SERVICE_EXIT_TIMEOUT_S="60",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        LOGLEVEL="INFO",  # torchrun's agent then logs each node's ranks and how its workers ended
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def submit(script: str, nodes: int, env: dict, cwd: Path) -> str:
    """`sbatch --nodes=N launch/SCRIPT` from ``cwd`` (the job's working directory); the job id."""
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--parsable", f"--nodes={nodes}", str(ROOT / "launch" / script)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


def job_fields(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait(job: str, timeout: float, states: set[str] = TERMINAL) -> dict[str, str]:
    """Polls until the job is in one of ``states``; past ``timeout`` the job is cancelled and
    its state reported as timed out."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(job)
        if fields["JobState"] in states:
            return fields
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            return {**fields, "JobState": f"timed out after {timeout:.0f} s (was {fields['JobState']})"}
        time.sleep(1)


def metrics(save: Path) -> list[dict]:
    """Rank 0's step rows (metrics.jsonl lines that carry a rollout reward)."""
    path = save / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in (json.loads(line) for line in lines if line.strip()) if "rollout/reward" in r]


def tails(*paths: Path, lines: int = 40) -> str:
    parts = []
    for p in paths:
        text = p.read_text(errors="replace").splitlines()[-lines:] if p.exists() else ["(missing)"]
        parts.append(f"==> {p}\n" + "\n".join(text))
    return "\n".join(parts)
