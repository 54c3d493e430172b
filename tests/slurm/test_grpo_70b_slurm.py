"""`sbatch launch/grpo_70b.slurm` under a real Slurm, the script unedited.

Runs inside the emulated cluster of `make test-slurm` (launch/slurm_emulation/cluster.sh, 4
nodes). The script gets environment overrides only (tiny model, CPU, small batches, 3
steps) and `--nodes=4`, as its own usage line shows: the learner on node1+node2 (torchrun,
c10d rendezvous across them, gloo), one rollout server on node3, the reward service on node4.
Its #SBATCH lines (--gpus-per-node=8, --cpus-per-task=96, --exclusive) are met by the
emulated nodes as they are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.transport import free_port
from helpers.paths import ROOT

pytestmark = pytest.mark.slurm

STEPS = 3
JOB_TIMEOUT_S = 480  # measured ~3 min on 2 idle cores
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def _prompts(path: Path) -> Path:
    # The demo's task (reverse a digit string; launch/demo_task.py scores it against "label").
    rows = [{"input": f"{n:04d}>", "label": f"{n:04d}"[::-1]} for n in range(1000, 1040)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _job_env(tmp_path: Path, model: Path) -> dict:
    env = dict(
        os.environ,
        # the job runs `python`, `torchrun` by name: this interpreter's
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        MODEL=str(model),
        PROMPTS=str(_prompts(tmp_path / "prompts.jsonl")),
        REWARD_FUNC=str(ROOT / "launch" / "demo_task.py"),
        SAVE=str(tmp_path / "save"),
        LEARNER_NODES="2",
        ROLLOUT_NODES="1",
        ROLLOUTS_PER_NODE="1",
        DEVICE="cpu",
        THREADS_PER_PROCESS="1",  # 5 processes on 2 cores: more threads only fight
        N_SAMPLES="4",
        ROLLOUT_BATCH_SIZE="4",
        TRAIN_BATCH_SIZE="16",
        MICRO_TRAIN_BATCH_SIZE="8",
        MICRO_ROLLOUT_BATCH_SIZE="16",
        PROMPT_MAX_LEN="64",
        GENERATE_MAX_LEN="8",
        MAX_STEPS=str(STEPS),
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


def _job_fields(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def _wait(job: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        fields = _job_fields(job)
        if fields["JobState"] in TERMINAL:
            return fields
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            return {**fields, "JobState": f"timed out after {timeout:.0f} s (was {fields['JobState']})"}
        time.sleep(2)


def _tails(*paths: Path, lines: int = 40) -> str:
    parts = []
    for p in paths:
        text = p.read_text(errors="replace").splitlines()[-lines:] if p.exists() else ["(missing)"]
        parts.append(f"==> {p}\n" + "\n".join(text))
    return "\n".join(parts)


def test_grpo_70b_script_runs_on_four_nodes(tmp_path, tiny_model_dir):
    env = _job_env(tmp_path, tiny_model_dir)
    submit = tmp_path / "submit"  # the job's working directory: its --output lands here
    submit.mkdir()
    job = subprocess.run(
        ["sbatch", "--parsable", "--nodes=4", str(ROOT / "launch" / "grpo_70b.slurm")],
        cwd=submit,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    fields = _wait(job, JOB_TIMEOUT_S)

    save, logs = tmp_path / "save", tmp_path / "save" / "logs"
    out = submit / f"rayless-rayless-grpo-70b-{job}.out"
    learner = [logs / "learner-node1.log", logs / "learner-node2.log"]
    rollout, reward = logs / "rollout-node3-0.log", logs / "reward-node4.log"
    every_log = [out, *learner, rollout, reward]
    why = _tails(*every_log)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields["JobState"], why)
    assert fields["NodeList"] == "node[1-4]", fields["NodeList"]

    # Logs land where the script says: the job's output in its working dir, one per role and node.
    assert all(p.exists() for p in every_log), sorted(str(p) for p in logs.iterdir())
    job_out = out.read_text()
    assert "learner: node1 node2 (x1)  rollout: node3 (x1, TP 1)  reward: node4" in job_out, job_out

    # The learner trained every step: rank 0's metrics have steps 1..STEPS, each on the full
    # batch. Both ranks took part: ZeRO-3 gathers and reduces across them in every step, and the
    # torchrun on node2 ran global rank 1 of 2 and saw it finish.
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), why
    assert all(r["samples"] == 16 for r in rows), [r["samples"] for r in rows]
    node2 = learner[1].read_text()
    assert "global_ranks=[1]" in node2 and "global_world_sizes=[2]" in node2, _tails(learner[1])
    assert "worker group successfully finished" in node2, _tails(learner[1])
    assert "learner exited 0" in job_out, job_out
    assert (save / "config.json").exists(), sorted(p.name for p in save.iterdir())  # the final HF model

    # Every service exited on the learner's Shutdown, none had to be killed.
    assert "shutdown requested by the controller" in rollout.read_text(), _tails(rollout)
    assert "Shutdown from the controller" in reward.read_text(), _tails(reward)
    assert "rollout-node3-0 exited 0" in job_out and "reward-node4 exited 0" in job_out, job_out
    assert "killed" not in job_out, job_out
