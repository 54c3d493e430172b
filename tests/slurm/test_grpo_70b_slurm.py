"""`sbatch launch/grpo_70b.slurm` under a real Slurm, the script unedited.

Runs inside the emulated cluster of `make test-slurm` (launch/slurm_emulation/cluster.sh, 4
nodes). The script gets environment overrides only (tiny model, CPU, small batches, 3
steps) and `--nodes=4`, as its own usage line shows: the learner on node1+node2 (torchrun,
c10d rendezvous across them, gloo), one rollout server on node3, the reward service on node4.
Its #SBATCH lines (--gpus-per-node=8, --cpus-per-task=96, --exclusive) are met by the
emulated nodes as they are.
"""

from __future__ import annotations

import pytest
from slurm_jobs import cpu_run_env, metrics, submit, tails, wait

pytestmark = pytest.mark.slurm

STEPS = 3
JOB_TIMEOUT_S = 420  # the test measured 50 s on 2 cores


def test_grpo_70b_script_runs_on_four_nodes(tmp_path, tiny_model_dir):
    env = cpu_run_env(tmp_path, tiny_model_dir, steps=STEPS)
    env.update(LEARNER_NODES="2", ROLLOUT_NODES="1")
    submit_dir = tmp_path / "submit"  # the job's working directory: its --output lands here
    job = submit("grpo_70b.slurm", 4, env, submit_dir)
    fields = wait(job, JOB_TIMEOUT_S)

    save, logs = tmp_path / "save", tmp_path / "save" / "logs"
    out = submit_dir / f"rayless-rayless-grpo-70b-{job}.out"
    learner = [logs / "learner-node1.log", logs / "learner-node2.log"]
    rollout, reward = logs / "rollout-node3-0.log", logs / "reward-node4.log"
    every_log = [out, *learner, rollout, reward]
    why = tails(*every_log)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields["JobState"], why)
    assert fields["NodeList"] == "node[1-4]", fields["NodeList"]
    # CURVE is on by default: the script made the run's keys and every role got --auth_dir.
    assert (save / "auth" / "authorized" / "peer.key").exists()

    # Logs land where the script says: the job's output in its working dir, one per role and node.
    assert all(p.exists() for p in every_log), sorted(str(p) for p in logs.iterdir())
    job_out = out.read_text()
    assert "learner: node1 node2 (x1)  rollout: node3 (x1, TP 1)  reward: node4" in job_out, job_out

    # The learner trained every step: rank 0's metrics have steps 1..STEPS, each on the full
    # batch. Both ranks took part: ZeRO-3 gathers and reduces across them in every step, and the
    # torchrun on node2 ran global rank 1 of 2 and saw it finish.
    rows = metrics(save)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), why
    assert all(r["samples"] == 16 for r in rows), [r["samples"] for r in rows]
    node2 = learner[1].read_text()
    assert "global_ranks=[1]" in node2 and "global_world_sizes=[2]" in node2, tails(learner[1])
    assert "worker group successfully finished" in node2, tails(learner[1])
    assert "learner exited 0" in job_out, job_out
    assert (save / "config.json").exists(), sorted(p.name for p in save.iterdir())  # the final HF model

    # Every service exited on the learner's Shutdown, none had to be killed.
    assert "shutdown requested by the controller" in rollout.read_text(), tails(rollout)
    assert "Shutdown from the controller" in reward.read_text(), tails(reward)
    assert "rollout-node3-0 exited 0" in job_out and "reward-node4 exited 0" in job_out, job_out
    assert "killed" not in job_out, job_out
