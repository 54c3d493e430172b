"""A running GRPO job gains a rollout server by `sbatch launch/add_rollouts.slurm` and loses it
by `scancel`, and completes with nothing lost.

The run is launch/grpo_70b.slurm on 3 emulated nodes (learner, one rollout server, reward);
the added server's job gets the fourth. The learner is told to wait for 2 rollout servers
(`--min_rollout_servers 2`, the last flag wins), so the added server is part of the run from
its first step whatever the two vLLM start-ups cost on 2 cores; it is cancelled once steps
have run with it, and the run must finish every step on a full batch with the one server left.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from slurm_jobs import GENERATE_MAX_LEN, PROMPT_MAX_LEN, cpu_run_env, job_fields, metrics, submit, tails, wait

pytestmark = pytest.mark.slurm

STEPS = 30  # ~0.7 s each on 2 cores: room for the cancel to land while the run goes on
JOB_TIMEOUT_S = 420  # the test measured 105 s on 2 cores


def test_rollout_server_added_by_sbatch_and_removed_by_scancel(tmp_path, tiny_model_dir):
    env = cpu_run_env(tmp_path, tiny_model_dir, steps=STEPS)
    env.update(LEARNER_NODES="1", ROLLOUT_NODES="1", LEARNER_ARGS="--min_rollout_servers 2")
    run_dir, add_dir = tmp_path / "run", tmp_path / "add"
    run = submit("grpo_70b.slurm", 3, env, run_dir)
    assert wait(run, 120, states={"RUNNING"})["JobState"] == "RUNNING"

    add_env = dict(
        env,
        CONTROLLER=f"tcp://node1:{env['PORT']}",  # the run's first learner node, as its output says
        LOGS=str(add_dir / "logs"),
        MAX_MODEL_LEN=str(PROMPT_MAX_LEN + GENERATE_MAX_LEN),
        AUTH_DIR=str(tmp_path / "save" / "auth"),  # the run's CURVE keys (grpo_70b.slurm makes them)
    )
    added = submit("add_rollouts.slurm", 1, add_env, add_dir)
    save, logs = tmp_path / "save", tmp_path / "save" / "logs"
    added_log = add_dir / "logs" / "rollout-node4-0.log"
    name = f"rollout-node4-0-j{added}"
    every_log = [
        run_dir / f"rayless-rayless-grpo-70b-{run}.out",
        add_dir / f"rayless-rayless-add-rollouts-{added}.out",
        logs / "learner-node1.log",
        logs / "rollout-node2-0.log",
        added_log,
    ]

    # Cancel the added server once two steps ran with it.
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(metrics(save)) < 2:
        assert job_fields(run)["JobState"] == "RUNNING", tails(*every_log)
        assert time.monotonic() < deadline, tails(*every_log)
        time.sleep(1)
    subprocess.run(["scancel", added], check=True)
    cancelled_after = len(metrics(save))

    fields = wait(run, JOB_TIMEOUT_S)
    add_fields = wait(added, 60)
    why = tails(*every_log)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields["JobState"], why)
    assert add_fields["JobState"] == "CANCELLED" and add_fields["NodeList"] == "node4", (add_fields, why)

    learner = (logs / "learner-node1.log").read_text()
    assert f"{name} joined as rollout" in learner, why
    assert f"{name} (rollout) is gone" in learner, why  # its SIGTERM's last words reached the controller
    assert "stopping on SIGTERM" in added_log.read_text(), tails(added_log)

    # Nothing lost: every step trained on a full batch, no group dropped; the two servers at
    # the start, one after the cancel, the one death counted.
    rows = metrics(save)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), why
    assert all(r["samples"] == 16 and r["ledger/failed_groups"] == 0 for r in rows), why
    assert rows[0]["pool/rollout_servers"] == 2, rows[0]
    assert rows[-1]["pool/rollout_servers"] == 1 and rows[-1]["pool/died"] == 1, rows[-1]
    print(
        f"cancelled after step {cancelled_after}; prompts re-issued: {rows[-1]['ledger/reissued']}, "
        f"duplicates dropped: {rows[-1]['ledger/duplicates']}"
    )
    out = every_log[0].read_text()
    assert "rollout-node2-0 exited 0" in out and "killed" not in out, out
